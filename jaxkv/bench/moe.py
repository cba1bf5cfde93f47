"""Mixture-of-experts MLP on this backend: the grouped tile loop against jax.lax.ragged_dot.

One MoE layer's MLP (`jaxkv.model.moe.moe_mlp`: routing, rows sorted by expert, gate/up/down
grouped matmuls, the weighted sum) at a real model's layer shape, for decode batches and a
prefill chunk, with the experts computed by ``grouped_matmul_tiles`` (jaxkv's CPU and GPU
path) and by ``jax.lax.ragged_dot`` (jaxkv's TPU path; XLA:CPU lowers it as a dense product
over every expert). Also the time to read the experts the batch routes to once (the
bandwidth bound of a decode step), from the measured memory bandwidth.

    jaxkv bench moe [--shape qwen3-30b-a3b] [--tokens 1 16 64 256] [--repeats 5]
"""

from __future__ import annotations

import time

import numpy as np

from jaxkv.bench import common

NAME = "moe"
# (hidden, expert width, experts, experts per token): one layer of each model
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2),
          "olmoe-1b-7b": (2048, 1024, 64, 8), "tiny": (64, 32, 8, 2)}


def add_arguments(parser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)


def _best(fn, args, repeats: int) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxkv.model.moe import moe_mlp

    e, f, x, k = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    p = {"router": jnp.asarray(rng.standard_normal((e, x)) * 0.02, jnp.float32),
         "experts_gate": jnp.asarray(rng.standard_normal((x, e, f)) * 0.02, jnp.float32),
         "experts_up": jnp.asarray(rng.standard_normal((x, e, f)) * 0.02, jnp.float32),
         "experts_down": jnp.asarray(rng.standard_normal((x, f, e)) * 0.02, jnp.float32)}
    bandwidth = common.memory_bandwidth()
    per_expert = 3 * e * f * 4

    def mlp(platform):
        return jax.jit(lambda h, p: moe_mlp(h, p, k=k, normalize=True, activation=jax.nn.silu,
                                            platform=platform))

    tiles, ragged = mlp("cpu"), mlp("tpu")  # the tile loop; ragged_dot (as on TPU)
    rows = []
    print(f"MoE MLP, one layer of {args.shape}: hidden {e}, {x} experts of width {f}, top {k}, "
          f"fp32 ({per_expert * x / 2**30:.2f} GiB of experts); "
          f"memory bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'tokens':>7} {'experts hit':>12} {'read bound ms':>14} {'tiles ms':>10} "
          f"{'ragged_dot ms':>14} {'ragged / tiles':>15}")
    for t in args.tokens:
        h = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
        logits = np.asarray(h) @ np.asarray(p["router"])
        hit = len(np.unique(np.argsort(-logits, axis=-1)[:, :k]))
        bound = hit * per_expert / bandwidth
        a, b = _best(tiles, (h, p), args.repeats), _best(ragged, (h, p), args.repeats)
        np.testing.assert_allclose(np.asarray(tiles(h, p)), np.asarray(ragged(h, p)),
                                   atol=1e-4, rtol=1e-3)
        rows.append(dict(tokens=t, experts_hit=hit, bound_ms=bound * 1e3, tiles_ms=a * 1e3,
                         ragged_ms=b * 1e3))
        print(f"{t:>7} {hit:>12} {bound * 1e3:>14.2f} {a * 1e3:>10.2f} {b * 1e3:>14.2f} "
              f"{b / a:>14.1f}x")
    return {"shape": args.shape, "bandwidth": bandwidth, "rows": rows}
