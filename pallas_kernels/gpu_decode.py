"""Flash-decoding over a paged KV cache on GPU (Pallas, Triton lowering): one new query token
per sequence attends to every cached key of its sequence.

Axes: B sequences, H query heads, K kv heads, G = H // K, R rows of a query block (G padded),
D head_dim, L layers, P pages per (layer, kv head), S page_size, W pages per page-table row,
NS splits of a row, F = L * K * P pool rows (see ``gpu_paged_common``).

Design:
- Grid (B, K, NS). A program takes *all* G query heads of its kv head as one [R, D] block, so
  each K/V tile is read from memory once per kv head, not once per query head.
- G padding: the G rows are padded to a power of two Gp (a Triton tensor rule). With Gp >= 8
  (G >= 5) they go through ``tl.dot`` and are padded up to its 16-row minimum (G = 8 -> 16).
  With G <= 4 the scores and P @ V are broadcast multiply-reduces on the CUDA cores with no
  16-row padding (MHA: 1 row, not 16). Decode is memory-bound: by a rough H100/H200 estimate
  (~18 B/clk of HBM vs 128 FMA/clk per SM) <= 4 rows of FMAs per loaded key stay under the
  bandwidth roof and 8 would not; the threshold is a constant to confirm by benchmark.
- Splits: split s owns pages ``[s * pps, (s+1) * pps)`` of the row (pps a multiple of the tile,
  computed on device from the batch's longest row, so a table padded to max_model_len still
  spreads a short batch over every split), so short batches still fill the GPU; each split
  writes an unnormalized f32 (out, max, sum-exp) triple and a jnp log-sum-exp merge combines
  them. The default aims at ~256 programs.
- Page skipping: a program loops only over pages below ``cdiv(length, S)`` and, with a sliding
  window, from the page holding key ``length - window`` on; splits beyond the length do no loads.
- Quantized pages (int8, fp8 e4m3, with ``kv_scales``): each tile also gathers the scale words
  of its page rows and dequantizes in the loop (``gpu_paged_common``); q stays bf16/f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_block_sizes
from pallas_kernels.gpu_paged_common import (
    attend_pages,
    check_common,
    check_knob,
    check_lengths,
    flatten_pool,
    flatten_scales,
    pad_groups,
    resolve_f32_precision,
    whole,
)


def _decode_kernel(lengths_ref, split_ref, table_ref, q_ref, kv_ref, *refs, width: int,
                   num_pages: int, page_size: int, pages_per_block: int, sm_scale: float,
                   soft_cap, sliding_window, mma: bool, precision: str, quantized: bool):
    # refs: (scale_ref,) with quantized pages, then the outputs o_ref, m_ref, l_ref.
    scale_ref, (o_ref, m_ref, l_ref) = (refs[0] if quantized else None), refs[-3:]
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    pages_per_split = split_ref[0]  # from the batch's longest row, not the table's width
    lo = split * pages_per_split
    hi = jnp.minimum(lo + pages_per_split, (length + page_size - 1) // page_size)
    hi = jnp.minimum(hi, width)  # a length past the table is malformed: never read past the row
    if sliding_window is not None:
        lo = jnp.maximum(lo, jnp.maximum(length - sliding_window, 0) // page_size)
    q_rd = q_ref[...]
    q_pos = jnp.full((q_rd.shape[0],), length - 1, jnp.int32)  # a padding row (0) masks all

    def page_rows(p0):
        return table_ref[pl.ds(p0, pages_per_block)] + h * num_pages

    acc, m, l = attend_pages(
        q_rd, q_pos, None, length, lo, hi, page_rows, kv_ref, page_size=page_size,
        pages_per_block=pages_per_block, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, mma=mma, precision=precision, scale_ref=scale_ref)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _decode_call(q_bkrd, kv_fsd, scales_fs, table_bw, lengths_b, split_pages, *, width: int,
                 num_splits: int, num_pages: int, pages_per_block: int, sm_scale: float,
                 soft_cap, sliding_window, mma: bool, precision: str, num_warps: int,
                 num_stages: int, interpret: bool):
    """The pallas_call: per-split partials (o f32[B, K, NS, R, D], m and l f32[B, K, NS, R]).

    The batch is a grid axis rather than a vmap of a per-sequence call: that is the grid vmap
    would build anyway, and it keeps the per-sequence length a plain scalar read.
    ``scales_fs``: the pool's i32 scale words ``[F, S]`` (quantized pages), or None.
    """
    b, k, r, d = q_bkrd.shape
    _, s, _ = kv_fsd.shape
    kernel = functools.partial(
        _decode_kernel, width=width, num_pages=num_pages, page_size=s,
        pages_per_block=pages_per_block, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, mma=mma, precision=precision,
        quantized=scales_fs is not None)
    part = (b, k, num_splits, r)
    scales = () if scales_fs is None else (scales_fs,)
    return pl.pallas_call(
        kernel,
        grid=(b, k, num_splits),
        in_specs=[
            whole(lengths_b.shape),
            whole(split_pages.shape),
            pl.BlockSpec((None, table_bw.shape[1]), lambda i, j, t: (i, 0)),
            pl.BlockSpec((None, None, r, d), lambda i, j, t: (i, j, 0, 0)),
            whole(kv_fsd.shape),  # gathered page by page inside the kernel
            *(whole(x.shape) for x in scales),  # gathered with the pages
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, r, d), lambda i, j, t: (i, j, t, 0, 0)),
            pl.BlockSpec((None, None, None, r), lambda i, j, t: (i, j, t, 0)),
            pl.BlockSpec((None, None, None, r), lambda i, j, t: (i, j, t, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, d), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention_gpu",
    )(lengths_b, split_pages, table_bw, q_bkrd, kv_fsd, *scales)


def _merge_splits(o, m, l):
    """Log-sum-exp merge over the split axis: [B, K, NS, R, D] partials -> f32[B, K, R, D]."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_max)  # an empty split has m = MASKED, so w = 0 next to any real split
    l_tot = jnp.sum(w * l, axis=2)
    o_tot = jnp.sum(w[..., None] * o, axis=2)
    return o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]  # a row with no key -> 0


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "num_splits", "pages_per_block",
                     "num_warps", "num_stages", "precision", "interpret"))
def paged_decode_attention_gpu(
    q,  # [B, H, D]  one new token per sequence, already written into the cache
    kv_pages,  # [K, P, S, 2D], or [L, K, P, S, 2D] with `layer` (keys, then values)
    page_table,  # i32[B, W]  logical page -> physical page of each sequence
    lengths,  # i32[B]  cached tokens including the new one; 0 = padding row -> zeros
    *,
    sm_scale: float,
    kv_scales=None,  # i32 quant.scale_rows_shape(kv_pages.shape) (or [.., P, S]): int8/fp8
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,  # int or traced i32[] selecting the layer of 5-D pages inside the kernel
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    precision: str | None = None,  # f32 dots: tf32 | tf32x3 | bf16x3 | ieee (gpu_paged_common)
    interpret: bool = False,
):
    """Decode attention over paged K/V with flash-decoding splits -> [B, H, D] in q.dtype.

    Semantics match ``paged_decode_attention_reference``; ``interpret=True`` runs it on CPU.
    Quantized pages (int8, float8_e4m3fn) need ``kv_scales``; q stays bf16/f32/f16.
    """
    _, n_kv, n_pages, page_size, d = check_common(
        q, kv_pages, page_table, layer, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, kv_scales=kv_scales)
    b, h, _ = q.shape
    if page_table.shape[0] != b:
        raise ValueError(f"page_table rows ({page_table.shape[0]}) must equal q batch ({b})")
    check_lengths("lengths", lengths, b)
    for name, value in (("num_splits", num_splits), ("num_stages", num_stages)):
        check_knob(name, value)
    for name, value in (("pages_per_block", pages_per_block), ("num_warps", num_warps)):
        check_knob(name, value, pow2=True)
    precision = resolve_f32_precision(precision, interpret=interpret)

    g = h // n_kv
    width = page_table.shape[1]
    tile = gpu_block_sizes.decode_tile(g, d, page_size, width, jnp.dtype(q.dtype),
                                       pages_per_block=pages_per_block, num_warps=num_warps,
                                       num_stages=num_stages)
    ppb = tile.pages_per_block
    blocks = -(-width // ppb)
    target = gpu_block_sizes.TARGET_PROGRAMS
    splits = num_splits or max(1, min(blocks, -(-target // (b * n_kv))))
    splits = -(-width // (-(-blocks // min(splits, blocks)) * ppb))  # none empty at full width
    # Pages per split (whole tiles) follow the batch's longest row, so a table padded to
    # max_model_len still spreads a short batch over every split.
    longest = jnp.clip((jnp.max(lengths) + page_size - 1) // page_size, 1, width)
    tiles = (longest + ppb - 1) // ppb
    pps = (((tiles + splits - 1) // splits) * ppb).astype(jnp.int32).reshape(1)

    kv_fsd, table = flatten_pool(kv_pages, page_table, layer, pad_cols=ppb)
    scales_fs = None if kv_scales is None else flatten_scales(kv_scales, kv_pages)
    o, m, l = _decode_call(
        pad_groups(q, n_kv, g, tile.rows), kv_fsd, scales_fs, table, lengths, pps, width=width,
        num_splits=splits, num_pages=n_pages, pages_per_block=ppb,
        sm_scale=float(sm_scale), soft_cap=soft_cap, sliding_window=sliding_window,
        mma=tile.mma, precision=precision, num_warps=tile.num_warps,
        num_stages=tile.num_stages, interpret=interpret)
    out_bkrd = _merge_splits(o, m, l)
    return out_bkrd[:, :, :g].reshape(b, h, d).astype(q.dtype)
