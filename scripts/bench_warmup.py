"""Compile time of `Engine.warmup` against model depth, with layers unrolled or scanned.

For each depth and layer layout, builds the 125M-class fp32 Llama of `bench_peers.py` (hidden
768, 12 heads / 4 kv heads, vocab 32,000) with that many layers, runs `Engine.warmup()` for the
default engine config (every program serving can run, counted through `jax.monitoring`), then
times steady single-stream decode (`decode_loop`, 8 steps a call, 200 tokens of context).
Each configuration runs in its own process, so no compile is shared between them.

    python scripts/bench_warmup.py [--layers 12 30] [--layouts unrolled scan]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(layers: int, layout: str) -> dict:
    import numpy as np

    import jaxkv
    from jaxkv.engine.warmup import idle_decode_loop
    from jaxkv.runtime.compiles import count_compiles

    cfg = jaxkv.ModelConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                            num_layers=layers, num_heads=12, num_kv_heads=4, head_dim=64,
                            tie_word_embeddings=False, max_position_embeddings=4096)
    model = jaxkv.random_model(cfg, seed=0, scan_layers=layout == "scan")
    engine = jaxkv.Engine(model, num_pages=512, max_model_len=1024)
    t = time.perf_counter()
    with count_compiles() as c:
        programs = engine.warmup()
    warm = time.perf_counter() - t
    loop = idle_decode_loop(engine, 1).replace(
        live=np.ones(1, bool), limit=np.full(1, 8, np.int32), max_tokens=np.full(1, 99, np.int32),
        positions=np.full(1, 200, np.int32), num_steps=np.int32(8),
        page_table=np.arange(engine.max_pages_per_seq, dtype=np.int32)[None] % 512)
    out, _, engine.state = engine.steps.decode_loop(model.params, engine.state, loop)
    out.block_until_ready()
    t, calls = time.perf_counter(), 3
    for _ in range(calls):
        out, _, engine.state = engine.steps.decode_loop(model.params, engine.state, loop)
        out.block_until_ready()
    decode = (time.perf_counter() - t) / (8 * calls)
    return dict(layers=layers, layout=layout, programs=programs, compiles=c.count,
                warmup_s=warm, compile_s=c.seconds, decode_ms=1e3 * decode)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 30])
    parser.add_argument("--layouts", nargs="+", default=["unrolled", "scan"],
                        choices=["unrolled", "scan"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # layers layout (child)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1])))
        return 0
    print("| layers | layers applied | programs | compiles | warmup s | of which compiling s "
          "| single-stream decode ms/token |")
    print("|---|---|---|---|---|---|---|")
    for layers in args.layers:
        for layout in args.layouts:
            run = subprocess.run([sys.executable, __file__, "--one", str(layers), layout],
                                 capture_output=True, text=True, check=True)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            name = "lax.scan" if layout == "scan" else "Python loop (CPU default)"
            print(f"| {r['layers']} | {name} | {r['programs']} | {r['compiles']} | "
                  f"{r['warmup_s']:.1f} | {r['compile_s']:.1f} | {r['decode_ms']:.1f} |")
    print("reproduce: python scripts/bench_warmup.py " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
