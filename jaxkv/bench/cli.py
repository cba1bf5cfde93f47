"""`jaxkv bench`: every number of docs/BENCHMARKS.md (and RELIABILITY.md, SCALEOUT.md) as a
subcommand. Each prints its tables, the environment it ran in and the ``reproduce:`` command;
``--json PATH`` writes {env, args, results}."""

from __future__ import annotations

import argparse
import functools
import importlib

from jaxkv.bench import common

# subcommand -> (its module under jaxkv.bench, one line of help), in the order of
# docs/BENCHMARKS.md. A module is imported only when its subcommand runs or shows its help.
COMMANDS = {
    "cache": ("cache", "cache vs recompute: decode with the paged KV cache and without"),
    "kernels": ("kernels", "paged decode attention kernels against each other"),
    "peers": ("peers", "jaxkv against the engines a user would pick instead, in one run"),
    "warmup": ("warmup", "Engine.warmup's compile time against model depth"),
    "startup": ("startup", "start-up time of `jaxkv serve` and `LLM(model)`, cold and warm"),
    "profile": ("profile", "where a decode step's time goes"),
    "throughput": ("throughput", "offline throughput against transformers' generate"),
    "prefix-cache": ("prefix_cache", "prefix caching on vs off: TTFT and tokens computed"),
    "serve": ("serve", "streaming clients against `jaxkv serve`, and offline"),
    "soak": ("soak", "thousands of requests through one Engine: nothing lost or leaking"),
    "quant": ("quant", "quantized weights side by side: speed, TTFT, perplexity, memory"),
    "moe": ("moe", "mixture-of-experts MLP: the grouped tile loop against ragged_dot"),
    "window-kv": ("window_kv", "window-only KV: what local layers store"),
    "spec": ("spec", "speculative decoding: tokens/s by method"),
    "spec-roofline": ("spec_roofline", "speculative decoding on H200 and TPU v5e, estimated"),
    "structured": ("structured", "structured outputs: valid replies, grammar and mask times"),
    "kv-accuracy": ("kv_accuracy", "int8 and fp8 KV pages' accuracy against the compute dtype"),
    "kv-capacity": ("kv_capacity", "KV capacity with int8 pages"),
    "host-tier": ("host_tier", "host-memory KV tier off vs on"),
    "scaleout": ("scaleout", "scale-out capacity under tensor parallelism"),
    "disagg": ("disagg", "prefill/decode disaggregation on virtual CPU devices"),
    "sim-disagg": ("sim.disagg", "disaggregated vs colocated serving, simulated"),
    "determinism": ("determinism", "where logits are bitwise identical, and where only tokens"),
}


class _BenchParser(argparse.ArgumentParser):
    """A subcommand's parser that imports its module (which adds its arguments) the first time
    it parses or prints help, so the ``jaxkv`` command starts without importing every bench."""

    def __init__(self, *args, bench: tuple[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._bench = bench

    def _load(self) -> None:
        if self._bench is None:
            return
        name, module_name = self._bench
        self._bench = None
        module = importlib.import_module(f"jaxkv.bench.{module_name}")
        self.description = module.__doc__
        module.add_arguments(self)
        self.add_argument("--json", metavar="PATH", help="write {env, args, results} here")
        self.set_defaults(func=functools.partial(common.run, name, module, self))

    def parse_known_args(self, args=None, namespace=None):
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def add_bench_parser(subparsers) -> None:
    """Registers ``jaxkv bench`` and one subcommand per entry of COMMANDS."""
    parser = subparsers.add_parser("bench", help="benchmarks (docs/BENCHMARKS.md)",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK",
                                parser_class=_BenchParser)
    for name, (module_name, help_line) in COMMANDS.items():
        sub.add_parser(name, help=help_line, bench=(name, module_name),
                       formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv=None) -> int:
    """``jaxkv bench *argv`` (``python -m jaxkv.bench``), without the jaxkv CLI's logging."""
    parser = argparse.ArgumentParser(prog="jaxkv")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv or [])])
    return args.func(args)
