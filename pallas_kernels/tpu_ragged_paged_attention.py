"""Ragged paged attention on TPU (Pallas Mosaic): prefill chunks and decode in one kernel.

Axes: T query tokens, B sequences (page-table rows), H query heads, K kv heads, D head_dim,
L layers, P pages, S page_size, W pages per page-table row.

The public, jitted entry points: static validation (each error names its argument), default
block sizes (``tpu_block_sizes``) and the q layout around the kernel; the kernel itself and its
design notes are in ``tpu_ragged_kernel``. Semantics are those of
``reference.ragged_paged_attention_reference``.

Quantized pages (int8, float8_e4m3fn, ``quant.py``) take ``kv_scales``: the pool's scale array
(``quant.scale_rows_shape``: 128 words a row, the layout the kernel reads in place on TPU, one
DMA of one row per page), or the words per page ``[..., P, S]``, which are reshaped to it first:
on TPU that copies them (XLA stores that shape page-minor) on every call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import tpu_block_sizes
from pallas_kernels.quant import is_quantized, scale_rows_shape
from pallas_kernels.quant import to_scale_rows as tpu_scale_rows
from pallas_kernels.tpu_ragged_kernel import (
    MAX_PAGES_PER_BLOCK,
    ragged_pallas_call,
    table_window,
)


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {msg}")


def _validate(q, kv_pages, page_table, kv_lens, cu_q_lens, num_seqs, layer, *, sm_scale,
              soft_cap, sliding_window, num_q_per_block, pages_per_block,
              vmem_limit_bytes, kv_scales) -> None:
    """Static checks (shapes, dtypes, knobs); each error names the offending argument."""
    _check(q.ndim == 3, "q", f"expected [T, H, D], got shape {q.shape}")
    _check(kv_pages.ndim in (4, 5), "kv_pages",
           f"expected [K, P, S, 2D] or [L, K, P, S, 2D], got shape {kv_pages.shape}")
    quantized = is_quantized(kv_pages.dtype)
    if quantized:
        _check(jnp.issubdtype(q.dtype, jnp.floating) and not is_quantized(q.dtype), "q",
               f"dtype {q.dtype}: quantized {kv_pages.dtype} pages need a float compute dtype")
    else:
        _check(kv_pages.dtype == q.dtype, "kv_pages",
               f"dtype {kv_pages.dtype} != q dtype {q.dtype}")
    _check(quantized == (kv_scales is not None), "kv_scales",
           f"{kv_pages.dtype} pages " + ("need i32 scales (int8, float8_e4m3fn pages carry "
                                         "them)" if quantized else "take no scales"))
    if kv_scales is not None:
        shapes = {tuple(kv_pages.shape[:-1]), scale_rows_shape(kv_pages.shape)}
        _check(kv_scales.dtype == jnp.int32 and tuple(kv_scales.shape) in shapes, "kv_scales",
               f"expected i32{list(kv_pages.shape[:-1])} (one word per page slot) or "
               f"i32{list(scale_rows_shape(kv_pages.shape))} (the same words in TPU rows), "
               f"got {kv_scales.dtype}{list(kv_scales.shape)}")
    t, h, d = q.shape
    num_kv_heads, _, page_size, d2 = kv_pages.shape[-4:]
    _check(d2 == 2 * d, "kv_pages", f"last dim {d2} != 2 * q head_dim {d} (keys, then values)")
    _check(h % num_kv_heads == 0, "q", f"{h} heads is not a multiple of {num_kv_heads} kv heads")
    tile = tpu_block_sizes.sublane_tile(kv_pages.dtype)
    _check(page_size % tile == 0, "kv_pages",
           f"page_size {page_size} must be a multiple of {tile} (the {kv_pages.dtype} sublane "
           "tile) so each page DMA lands tile-aligned in VMEM")
    if kv_pages.ndim == 5:
        _check(layer is not None and jnp.ndim(layer) == 0
               and jnp.issubdtype(jnp.result_type(layer), jnp.integer), "layer",
               f"5-D pages need an integer scalar layer, got {layer!r}")
    else:
        _check(layer is None, "layer", "only valid with 5-D [L, K, P, S, 2D] pages")
    _check(page_table.ndim == 2 and page_table.dtype == jnp.int32, "page_table",
           f"expected i32[B, W], got {page_table.dtype}{list(page_table.shape)}")
    for x, name, shape in ((kv_lens, "kv_lens", page_table.shape[:1]),
                           (cu_q_lens, "cu_q_lens", (page_table.shape[0] + 1,))):
        _check(x.shape == shape and x.dtype == jnp.int32, name,
               f"expected i32{list(shape)}, got {x.dtype}{list(x.shape)}")
    _check(num_seqs.size == 1 and num_seqs.dtype == jnp.int32, "num_seqs",
           f"expected i32[], got {num_seqs.dtype}{list(num_seqs.shape)}")
    _check(isinstance(sm_scale, (int, float)), "sm_scale", f"must be a float, got {sm_scale!r}")
    _check(soft_cap is None or soft_cap > 0, "soft_cap", f"must be None or > 0, got {soft_cap}")
    for value, name in ((sliding_window, "sliding_window"), (num_q_per_block, "num_q_per_block"),
                        (pages_per_block, "pages_per_block"),
                        (vmem_limit_bytes, "vmem_limit_bytes")):
        _check(value is None or (isinstance(value, int) and value > 0), name,
               f"must be None or a positive int, got {value!r}")
    _check(pages_per_block is None or pages_per_block <= MAX_PAGES_PER_BLOCK, "pages_per_block",
           f"at most {MAX_PAGES_PER_BLOCK}, got {pages_per_block}")
    window = table_window(*page_table.shape)
    smem = tpu_block_sizes.smem_bytes(page_table.shape[0], window[0] * window[1])
    _check(smem <= tpu_block_sizes.SMEM_BUDGET, "page_table",
           f"{page_table.shape[0]} rows need {smem} B of SMEM for kv_lens and cu_q_lens, over "
           f"the {tpu_block_sizes.SMEM_BUDGET} B budget: split the batch")


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "sliding_window", "num_q_per_block", "pages_per_block",
    "vmem_limit_bytes"))
def ragged_paged_attention_tpu(
    q,  # [T, H, D]  new tokens of all sequences, concatenated
    kv_pages,  # [K, P, S, 2D], or [L, K, P, S, 2D] with `layer` (keys, then values)
    page_table,  # i32[B, W]
    kv_lens,  # i32[B]  cached tokens including the new ones
    cu_q_lens,  # i32[B + 1]
    num_seqs,  # i32[]  rows >= num_seqs are padding
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,  # int or i32[] (may be traced): the layer of 5-D pages, read in the kernel
    num_q_per_block: int | None = None,  # Tq; on TPU keep Tq * G a multiple of the sublane tile
    pages_per_block: int | None = None,  # N
    vmem_limit_bytes: int | None = None,
    kv_scales=None,  # i32[K, P, S] / [L, K, P, S], or scale_rows_shape: quantized pages' scales
):
    """Ragged causal attention of new tokens over a paged KV cache on TPU -> [T, H, D].

    Same semantics as ``ragged_paged_attention_reference``; tokens past ``cu_q_lens[num_seqs]``
    return zeros. Page ids and ``layer`` are clamped into the pool, and every SMEM index is
    bounded, so malformed lengths give wrong numbers for their own rows, never a stray read.

    Quantized pages (int8, float8_e4m3fn; page_size a multiple of 32) come with ``kv_scales``
    (``quant.py``) and are dequantized in the kernel's inner loop; q (and the output) stay in
    the compute dtype. Scales in ``scale_rows_shape`` are read in place; in the
    ``[..., P, S]`` shape of ``quant.py`` they are reshaped to it first, which on TPU copies
    them (XLA stores that shape page-minor) on every call.
    """
    _validate(q, kv_pages, page_table, kv_lens, cu_q_lens, num_seqs, layer,
              sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
              num_q_per_block=num_q_per_block, pages_per_block=pages_per_block,
              vmem_limit_bytes=vmem_limit_bytes, kv_scales=kv_scales)
    t, h, d = q.shape
    page_size = kv_pages.shape[-2]
    if kv_scales is not None and kv_scales.shape == kv_pages.shape[:-1]:
        kv_scales = tpu_scale_rows(kv_scales)
    if kv_pages.ndim == 4:  # a unit layer axis is a free bitcast; one kernel serves both layouts
        kv_pages, layer = kv_pages[None], 0
        kv_scales = None if kv_scales is None else kv_scales[None]
    num_kv_heads = kv_pages.shape[1]
    g = h // num_kv_heads
    tq = num_q_per_block or tpu_block_sizes.default_num_q_per_block(t, g, q.dtype)
    n = pages_per_block or tpu_block_sizes.default_pages_per_block(
        page_size, page_table.shape[1])
    lanes = tpu_block_sizes.q_lanes(d)
    t_pad = pl.cdiv(t, tq) * tq
    q_the = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, lanes - d)))  # zero lanes meet V: no-op
    q_kre = q_the.reshape(t_pad, num_kv_heads, g, lanes).transpose(1, 0, 2, 3).reshape(
        num_kv_heads, t_pad * g, lanes)
    meta = jnp.stack([num_seqs.reshape(()), jnp.asarray(layer, jnp.int32)])
    out_kre = ragged_pallas_call(
        q_kre, kv_pages, page_table, kv_lens, cu_q_lens, meta, kv_scales, group=g,
        num_q_per_block=tq, pages_per_block=n, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, vmem_limit_bytes=vmem_limit_bytes)
    out_the = out_kre.reshape(num_kv_heads, t_pad, g, lanes).transpose(1, 0, 2, 3)
    return out_the.reshape(t_pad, h, lanes)[:t, :, lanes - d:]  # P @ V: the last D lanes


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "sliding_window", "num_q_per_block", "pages_per_block",
    "vmem_limit_bytes"))
def paged_decode_attention_tpu(
    q,  # [B, H, D]  one new token per sequence
    kv_pages,  # [K, P, S, 2D], or [L, K, P, S, 2D] with `layer`
    page_table,  # i32[B, W]
    lengths,  # i32[B]  cached tokens including the new one; 0 marks a padding row
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,  # int or i32[]: the layer of 5-D pages
    num_q_per_block: int | None = None,  # sequences per q block
    pages_per_block: int | None = None,  # N
    vmem_limit_bytes: int | None = None,
    kv_scales=None,  # as for ragged_paged_attention_tpu
):
    """Decode attention (one query per sequence): the ragged kernel with cu_q_lens = arange."""
    b = page_table.shape[0]
    _check(q.ndim == 3 and q.shape[0] == b, "q", f"expected [{b}, H, D], got {q.shape}")
    _check(lengths.shape == (b,) and lengths.dtype == jnp.int32, "lengths",
           f"expected i32[{b}], got {lengths.dtype}{list(lengths.shape)}")
    ragged = (q, kv_pages, page_table, lengths, jnp.arange(b + 1, dtype=jnp.int32),
              jnp.int32(b))
    knobs = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                 pages_per_block=pages_per_block, vmem_limit_bytes=vmem_limit_bytes)
    _validate(*ragged, layer, num_q_per_block=num_q_per_block, kv_scales=kv_scales, **knobs)
    g = q.shape[1] // kv_pages.shape[-4]
    tq = num_q_per_block or tpu_block_sizes.default_decode_num_q_per_block(b, g, q.dtype)
    return ragged_paged_attention_tpu(*ragged, layer=layer, num_q_per_block=tq,
                                      kv_scales=kv_scales, **knobs)
