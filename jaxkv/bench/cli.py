"""`jaxkv bench`: every number of docs/BENCHMARKS.md (and RELIABILITY.md, SCALEOUT.md) as a
subcommand. Each prints its tables, the environment it ran in and the ``reproduce:`` command;
``--json PATH`` writes {env, args, results}."""

from __future__ import annotations

import argparse
import functools
import importlib

from jaxkv.bench import common

# subcommand -> its module under jaxkv.bench, in the order of docs/BENCHMARKS.md
COMMANDS = {
    "cache": "cache",
    "kernels": "kernels",
    "peers": "peers",
    "warmup": "warmup",
    "startup": "startup",
    "profile": "profile",
    "throughput": "throughput",
    "prefix-cache": "prefix_cache",
    "serve": "serve",
    "soak": "soak",
    "quant": "quant",
    "moe": "moe",
    "window-kv": "window_kv",
    "spec": "spec",
    "spec-roofline": "spec_roofline",
    "structured": "structured",
    "kv-accuracy": "kv_accuracy",
    "kv-capacity": "kv_capacity",
    "host-tier": "host_tier",
    "scaleout": "scaleout",
    "disagg": "disagg",
    "sim-disagg": "sim.disagg",
    "determinism": "determinism",
}


def add_bench_parser(subparsers) -> None:
    """Registers ``jaxkv bench`` and one subcommand per entry of COMMANDS."""
    parser = subparsers.add_parser("bench", help="benchmarks (docs/BENCHMARKS.md)",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"jaxkv.bench.{module_name}")
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.add_argument("--json", metavar="PATH", help="write {env, args, results} here")
        p.set_defaults(func=functools.partial(common.run, name, module, p))


def main(argv=None) -> int:
    """``jaxkv bench *argv`` (``python -m jaxkv.bench``), without the jaxkv CLI's logging."""
    parser = argparse.ArgumentParser(prog="jaxkv")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv or [])])
    return args.func(args)
