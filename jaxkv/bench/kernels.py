"""Paged decode attention: jaxkv's Pallas kernel vs JAX's shipped kernel vs the XLA reference.

Identical inputs for every implementation (bf16, GQA 8 by default, random pages scattered over
the pool). For each (batch, context) it reports the time per call, the achieved bandwidth
(K/V bytes read / time) and its fraction of the device peak, prints a table and saves a plot.
On CPU, Pallas runs only in interpret mode, whose timings mean nothing: the bench says so
and exits unless ``--smoke`` asks for a tiny correctness-and-plumbing run.

    jaxkv bench kernels [--batch 1 8 64 256] [--context 512 4096 32768]
                        [--kv-heads 8 --group 8 --head-dim 128 --page-size 16]
                        [--peak-gbs 4800] [--out bench_kernels.png]
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.bench import common
from jaxkv.config import cdiv
from pallas_kernels import pack_kv, paged_decode_attention

# HBM bandwidth of common accelerators (GB/s), for the "% of peak" column; --peak-gbs overrides.
PEAK_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "TPU v5 lite": 819, "TPU v5e": 819,
            "TPU v6 lite": 1640, "TPU v4": 1228, "TPU v5p": 2765}


def add_arguments(p) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[512, 4096, 32768])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="query heads per KV head (GQA ratio)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--max-kv-gib", type=float, default=24.0,
                   help="skip configurations whose K/V pool exceeds this (peak memory ~2x)")
    p.add_argument("--peak-gbs", type=float, default=None, help="device HBM bandwidth, GB/s")
    p.add_argument("--pages-per-block", type=int, default=None,
                   help="jaxkv kernel knob (default: gpu/tpu_block_sizes)")
    p.add_argument("--num-warps", type=int, default=None, help="jaxkv GPU kernel knob")
    p.add_argument("--out", default="bench_kernels.png")
    p.add_argument("--smoke", action="store_true",
                   help="on CPU: tiny shapes in interpret mode, to check plumbing only")


def _inputs(batch, context, *, kv_heads, group, head_dim, page_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    pages_per_seq = cdiv(context, page_size)
    num_pages = batch * pages_per_seq
    table = rng.permutation(num_pages).astype(np.int32).reshape(batch, pages_per_seq)
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (kv_heads, num_pages, page_size, head_dim)
    q = jax.random.normal(kq, (batch, kv_heads * group, head_dim), dtype)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, k, v, jnp.asarray(table), lengths


def _implementations(platform, interpret, knobs):
    """name -> (page layout, fn(q, *pages, table, lengths, scale)). jaxkv reads K and V packed
    side by side ("packed": one [..., 2D] array); JAX's shipped kernels read them separately."""
    impls = {"jaxkv": ("packed", lambda q, kv, t, n, s: paged_decode_attention(
        q, kv, t, n, sm_scale=s, backend="gpu" if platform != "tpu" else "tpu",
        interpret=interpret, **knobs))}
    impls["xla-reference"] = ("packed", lambda q, kv, t, n, s: paged_decode_attention(
        q, kv, t, n, sm_scale=s, backend="reference"))
    if platform == "gpu" or interpret:
        from jax.experimental.pallas.ops.gpu import paged_attention as shipped

        # The shipped kernel does not scale queries: pre-scale q so all compute the same thing.
        def shipped_gpu(q, k, v, t, n, s):
            # Its splits must divide the pages per sequence, and its blocks each split.
            splits = math.gcd(16, t.shape[1])
            block = math.gcd(8, t.shape[1] // splits)
            return shipped.paged_attention(q * jnp.asarray(s, q.dtype), k, v, t, n,
                                           interpret=interpret, pages_per_compute_block=block,
                                           k_splits=splits)

        impls["jax-shipped"] = ("split", shipped_gpu)
    elif platform == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as shipped

        impls["jax-shipped"] = ("split", lambda q, k, v, t, n, s: shipped(
            q * jnp.asarray(s, q.dtype), k, v, n, t, pages_per_compute_block=8))
    return impls


def _time(fn, args, repeats):
    f = jax.jit(fn, static_argnums=(len(args) - 1,))
    out = f(*args)
    out.block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best, out


def _time_all(impls, layout, pages, q, table, lengths, scale, repeats):
    """(seconds, output) of each implementation that reads its pages in ``layout``."""
    return {name: _time(fn, (q, *pages, table, lengths, scale), repeats)
            for name, (kind, fn) in impls.items() if kind == layout}


def run(args) -> dict:
    platform = jax.default_backend()
    device = jax.devices()[0].device_kind
    interpret = platform not in ("gpu", "tpu")
    if interpret and not args.smoke:
        print(f"No GPU or TPU here ({platform}): Pallas kernels would run in interpret mode, "
              "whose timings say nothing about kernel speed. Run this on a GPU or TPU VM, "
              "or pass --smoke for a tiny plumbing check.")
        return {"skipped": f"no GPU or TPU ({platform})"}
    if args.smoke:
        args.batch, args.context, args.repeats = [2], [64], 1
        args.kv_heads, args.group, args.head_dim = 2, 4, 64
    peak = args.peak_gbs or next((v for k, v in PEAK_GBS.items() if k in device), None)
    knobs = {k: v for k, v in (("pages_per_block", args.pages_per_block),
                               ("num_warps", args.num_warps)) if v is not None}
    impls = _implementations(platform, interpret, knobs)
    dtype = jnp.bfloat16
    rows = []
    for batch in args.batch:
        for context in args.context:
            kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * 2
            if kv_bytes > args.max_kv_gib * 2**30:
                continue
            q, k, v, table, lengths = _inputs(
                batch, context, kv_heads=args.kv_heads, group=args.group,
                head_dim=args.head_dim, page_size=args.page_size, dtype=dtype)
            scale = 1.0 / np.sqrt(args.head_dim)
            common_args = (q, table, lengths, scale, args.repeats)
            # Separate K/V first, then the packed copy: one layout in memory at a time (plus
            # the reference's gather), so --max-kv-gib bounds about half the device memory.
            results = _time_all(impls, "split", (k, v), *common_args)
            kv = pack_kv(k, v)
            del k, v
            results |= _time_all(impls, "packed", (kv,), *common_args)
            del kv
            ref = np.asarray(results["xla-reference"][1].astype(jnp.float32))
            for name, (seconds, out) in results.items():
                err = float(np.abs(np.asarray(out.astype(jnp.float32)) - ref).max())
                gbs = kv_bytes / seconds / 1e9
                rows.append((batch, context, name, seconds * 1e6, gbs,
                             gbs / peak * 100 if peak else float("nan"), err))
    print(f"device: {device} ({platform}); bf16, kv_heads {args.kv_heads}, GQA {args.group}, "
          f"head_dim {args.head_dim}, page_size {args.page_size}"
          + (" [interpret mode: timings meaningless]" if interpret else ""))
    print(f"{'batch':>5} {'context':>7} {'impl':<14} {'us':>10} {'GB/s':>8} {'%peak':>6} "
          f"{'max|err|':>9}")
    for b, c, name, us, gbs, frac, err in rows:
        print(f"{b:>5} {c:>7} {name:<14} {us:>10.1f} {gbs:>8.1f} {frac:>6.1f} {err:>9.2e}")
    common.save_plot(args.out, lambda fig, ax: _draw(ax, rows, device), figsize=(7, 4))
    keys = ("batch", "context", "impl", "us", "gbs", "pct_peak", "max_err")
    return {"device": device, "interpret": interpret, "rows": [dict(zip(keys, r, strict=True))
                                                               for r in rows]}


def _draw(ax, rows, device) -> None:
    for name in sorted({r[2] for r in rows}):
        pts = [(f"{b}x{c}", r[4]) for r in rows if r[2] == name for b, c in [(r[0], r[1])]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("batch x context")
    ax.set_ylabel("achieved K/V bandwidth (GB/s)")
    ax.set_title(f"paged decode attention on {device}")
    ax.legend()
    ax.tick_params(axis="x", rotation=45)
