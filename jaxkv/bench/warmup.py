"""Compile time of `Engine.warmup` against model depth, with layers unrolled or scanned.

For each depth and layer layout, builds the 125M-class fp32 Llama of `bench peers` (hidden
768, 12 heads / 4 kv heads, vocab 32,000) with that many layers, runs `Engine.warmup()` for the
default engine config (every program serving can run, counted through `jax.monitoring`), then
times steady single-stream decode (`decode_loop`, 8 steps a call, 200 tokens of context).
Each configuration runs in its own process, so no compile is shared between them.

    jaxkv bench warmup [--layers 12 30] [--layouts unrolled scan]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

import jaxkv
from jaxkv.bench import common
from jaxkv.engine.warmup import idle_decode_loop
from jaxkv.runtime.compiles import count_compiles

NAME = "warmup"


def add_arguments(parser) -> None:
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 30])
    parser.add_argument("--layouts", nargs="+", default=["unrolled", "scan"],
                        choices=["unrolled", "scan"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # layers layout (child)
    common.add_engine_args(parser, num_pages=512, max_model_len=1024)


def one(layers: int, layout: str, engine_kw: dict) -> dict:
    """Warmup and decode of one (depth, layout), in this process."""
    cfg = common.peer_config(layers)
    model = jaxkv.random_model(cfg, seed=0, scan_layers=layout == "scan")
    engine = jaxkv.Engine(model, **engine_kw)
    t = time.perf_counter()
    with count_compiles() as c:
        programs = engine.warmup()
    warm = time.perf_counter() - t
    loop = idle_decode_loop(engine, 1).replace(
        live=np.ones(1, bool), limit=np.full(1, 8, np.int32), max_tokens=np.full(1, 99, np.int32),
        positions=np.full(1, 200, np.int32), num_steps=np.int32(8),
        page_table=np.arange(engine.max_pages_per_seq, dtype=np.int32)[None] % engine.num_pages)
    out, _ = engine.runner.run(engine.steps.decode_loop, loop)
    out.block_until_ready()
    t, calls = time.perf_counter(), 3
    for _ in range(calls):
        out, _ = engine.runner.run(engine.steps.decode_loop, loop)
        out.block_until_ready()
    decode = (time.perf_counter() - t) / (8 * calls)
    return dict(layers=layers, layout=layout, programs=programs, compiles=c.count,
                warmup_s=warm, compile_s=c.seconds, decode_ms=1e3 * decode)


def run(args) -> dict:
    kw = common.engine_kwargs(args)
    if args.one:
        r = one(int(args.one[0]), args.one[1], kw)
        print("ONE " + json.dumps(r))
        return r
    flags = [w for k, v in kw.items() for w in ("--" + k.replace("_", "-"), str(v))]
    print("| layers | layers applied | programs | compiles | warmup s | of which compiling s "
          "| single-stream decode ms/token |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for layers in args.layers:
        for layout in args.layouts:
            child = subprocess.run([sys.executable, "-m", "jaxkv.bench", NAME, "--one",
                                    str(layers), layout, *flags],
                                   capture_output=True, text=True, check=True)
            r = json.loads(next(ln[4:] for ln in child.stdout.splitlines()
                                if ln.startswith("ONE ")))
            rows.append(r)
            name = "lax.scan" if layout == "scan" else "Python loop (CPU default)"
            print(f"| {r['layers']} | {name} | {r['programs']} | {r['compiles']} | "
                  f"{r['warmup_s']:.1f} | {r['compile_s']:.1f} | {r['decode_ms']:.1f} |")
    return {"rows": rows}
