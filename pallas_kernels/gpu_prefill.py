"""Ragged, chunked prefill attention over a paged KV cache on GPU (Pallas, Triton lowering).

Sequence b owns queries ``q[cu_q_lens[b]:cu_q_lens[b+1]]``; query i sits at position
``kv_lens[b] - q_len + i`` and attends causally to the cached prefix plus the chunk (see
``pallas_kernels.reference``). Rows ``b >= num_seqs`` and tokens past ``cu_q_lens[num_seqs]``
are padding and come back as zeros.

Axes: B sequences, T query tokens (flat), H query heads, K kv heads, G = H // K, Gp = G padded to
a power of two, Q = block_q query tokens per program, R = Q * Gp rows, D head_dim, S page_size,
W pages per page-table row, NB query blocks, F pool rows (see ``gpu_paged_common``).

Design:
- Work list, built on device with a few [B]-sized jnp ops (no host sync, no recompiles): every
  sequence is cut into ``cdiv(q_len, Q)`` blocks that never straddle two sequences, numbered
  densely; block i learns its sequence by a searchsorted over the cumulative block counts. The
  static grid is (NB, K) with NB = cdiv(T, Q) + min(B, T), an upper bound of the true count
  (each sequence wastes at most one partial block); programs past the count return at once.
  Compared with a (B, max_q_blocks, K) grid this launches O(T / Q + B) programs instead of
  O(B * T / Q); compared with blocks over the flat T axis, a block sees one page table, so
  decode-heavy batches (q_len = 1) do not serialize many sequences inside one program.
- Query block: Q tokens x all Gp heads of a kv head = R rows of ``tl.dot`` (R >= 16), so K/V
  tiles are loaded once per kv head. q is padded to Gp heads and by Q tokens at the end so that
  a block load never runs off the array; stores are masked to the block's real tokens.
- Page skipping: a block reads pages up to the causal limit of its last query (and the length),
  and with a sliding window from the page of its first query's oldest visible key on.
- Quantized pages (int8, fp8 e4m3, with ``kv_scales``): each tile also gathers the scale words
  of its page rows and dequantizes in the loop (``gpu_paged_common``); q stays bf16/f32.
- Grid dim 0 (CUDA x, launched fastest) runs over query blocks, so consecutive programs are
  neighbouring blocks of one sequence and kv head, which share K/V pages in L2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
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
    next_pow2,
    pad_groups,
    resolve_f32_precision,
    whole,
)


def _prefill_kernel(seq_ref, tok0_ref, nrows_ref, pos0_ref, kv_len_ref, table_ref, q_ref, kv_ref,
                    *refs, width: int, num_pages: int, page_size: int, block_q: int,
                    pages_per_block: int, sm_scale: float, soft_cap, sliding_window,
                    precision: str, quantized: bool):
    # refs: (scale_ref,) with quantized pages, then the output o_ref.
    scale_ref, o_ref = (refs[0] if quantized else None), refs[-1]
    i, h = pl.program_id(0), pl.program_id(1)
    nrows = nrows_ref[i]

    @pl.when(nrows > 0)
    def _():
        seq, tok0, pos0, kv_len = seq_ref[i], tok0_ref[i], pos0_ref[i], kv_len_ref[i]
        q_qgd = q_ref[pl.ds(tok0, block_q)]
        _, gp, d = q_qgd.shape
        t_r = lax.iota(jnp.int32, block_q * gp) // gp  # rows are token-major, head-minor
        q_pos = pos0 + t_r
        last_key = jnp.minimum(pos0 + nrows, kv_len)  # one past the newest key any row sees
        hi = jnp.minimum((last_key + page_size - 1) // page_size, width)
        lo = 0
        if sliding_window is not None:
            lo = jnp.maximum(pos0 - (sliding_window - 1), 0) // page_size

        def page_rows(p0):
            return table_ref[seq, pl.ds(p0, pages_per_block)] + h * num_pages

        acc, _, l = attend_pages(
            q_qgd.reshape(block_q * gp, d), q_pos, t_r < nrows, kv_len, lo, hi, page_rows,
            kv_ref, page_size=page_size, pages_per_block=pages_per_block, sm_scale=sm_scale,
            soft_cap=soft_cap, sliding_window=sliding_window, mma=True, precision=precision,
            scale_ref=scale_ref)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # a row that saw no key -> 0, not NaN
        out_qgd = out.reshape(block_q, gp, d).astype(o_ref.dtype)
        keep = jnp.broadcast_to((lax.iota(jnp.int32, block_q) < nrows)[:, None, None],
                                out_qgd.shape)
        # Rows past the block's sequence belong to the next sequence's program: never write them.
        plgpu.store(o_ref.at[pl.ds(tok0, block_q)], out_qgd, mask=keep)


def _work_list(kv_lens, cu_q_lens, num_seqs, *, num_tokens: int, block_q: int, num_blocks: int):
    """Per query block: (sequence, first token row, real rows, first query position, kv_len)."""
    b = kv_lens.shape[0]
    starts = cu_q_lens[:-1]
    q_lens = jnp.where(jnp.arange(b) < num_seqs, jnp.maximum(cu_q_lens[1:] - starts, 0), 0)
    n_blk = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(n_blk)
    i = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, i, side="right"), b - 1).astype(jnp.int32)
    qb = i - (ends[seq] - n_blk[seq])
    # Clamps keep malformed cu_q_lens (past T) from touching memory outside q and the output.
    tok0 = jnp.clip(starts[seq] + qb * block_q, 0, num_tokens)
    nrows = jnp.clip(q_lens[seq] - qb * block_q, 0, block_q)
    nrows = jnp.where(i < ends[-1], jnp.minimum(nrows, num_tokens - tok0), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + qb * block_q
    return seq, tok0, nrows, pos0, kv_lens[seq]


def _prefill_call(work, table_bw, q_tkgd, kv_fsd, scales_fs, *, width: int, num_pages: int,
                  block_q: int, pages_per_block: int, sm_scale: float, soft_cap, sliding_window,
                  precision: str, num_warps: int, num_stages: int, interpret: bool):
    """The pallas_call over the (NB, K) grid -> [T + Q, K, Gp, D] (unwritten rows undefined).

    ``scales_fs``: the pool's i32 scale words ``[F, S]`` (quantized pages), or None."""
    t_pad, k, gp, d = q_tkgd.shape
    _, s, _ = kv_fsd.shape
    nb = work[0].shape[0]
    kernel = functools.partial(
        _prefill_kernel, width=width, num_pages=num_pages, page_size=s, block_q=block_q,
        pages_per_block=pages_per_block, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, precision=precision, quantized=scales_fs is not None)
    scales = () if scales_fs is None else (scales_fs,)
    per_head = pl.BlockSpec((t_pad, None, gp, d), lambda i, j: (0, j, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(nb, k),
        in_specs=[*(whole((nb,)) for _ in work), whole(table_bw.shape), per_head,
                  whole(kv_fsd.shape), *(whole(x.shape) for x in scales)],
        out_specs=per_head,
        out_shape=jax.ShapeDtypeStruct(q_tkgd.shape, q_tkgd.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*work, table_bw, q_tkgd, kv_fsd, *scales)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "block_q", "pages_per_block",
                     "num_warps", "num_stages", "precision", "interpret"))
def ragged_paged_attention_gpu(
    q,  # [T, H, D]  new query tokens of all sequences, concatenated
    kv_pages,  # [K, P, S, 2D], or [L, K, P, S, 2D] with `layer` (keys, then values)
    page_table,  # i32[B, W]  logical page -> physical page of each sequence
    kv_lens,  # i32[B]  cached tokens per sequence, including this chunk
    cu_q_lens,  # i32[B + 1]  query token offsets of each sequence
    num_seqs,  # i32[] (or int)  rows >= num_seqs are padding
    *,
    sm_scale: float,
    kv_scales=None,  # i32 quant.scale_rows_shape(kv_pages.shape) (or [.., P, S]): int8/fp8
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,  # int or traced i32[] selecting the layer of 5-D pages inside the kernel
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    precision: str | None = None,  # f32 dots: tf32 | tf32x3 | bf16x3 | ieee (gpu_paged_common)
    interpret: bool = False,
):
    """Causal ragged attention of new tokens over paged K/V -> [T, H, D] in q.dtype.

    Semantics match ``ragged_paged_attention_reference``; ``interpret=True`` runs it on CPU.
    Quantized pages (int8, float8_e4m3fn) need ``kv_scales``; q stays bf16/f32/f16.
    """
    _, n_kv, n_pages, page_size, d = check_common(
        q, kv_pages, page_table, layer, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, kv_scales=kv_scales)
    t, h, _ = q.shape
    b, width = page_table.shape
    check_lengths("kv_lens", kv_lens, b)
    check_lengths("cu_q_lens", cu_q_lens, b + 1)
    if jnp.shape(num_seqs) not in ((), (1,)) or not jnp.issubdtype(
            jnp.result_type(num_seqs), jnp.integer):
        raise ValueError(f"num_seqs must be an int or an i32[] scalar, got {num_seqs!r}")
    for name, value in (("block_q", block_q), ("pages_per_block", pages_per_block),
                        ("num_warps", num_warps)):
        check_knob(name, value, pow2=True)
    check_knob("num_stages", num_stages)
    precision = resolve_f32_precision(precision, interpret=interpret)

    g = h // n_kv
    gp = next_pow2(g)
    bq = block_q or gpu_block_sizes.prefill_block_q(g, t)
    tile = gpu_block_sizes.prefill_tile(bq, g, d, page_size, width, jnp.dtype(q.dtype),
                                        pages_per_block=pages_per_block, num_warps=num_warps,
                                        num_stages=num_stages)
    ppb = tile.pages_per_block

    num_seqs = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, b)
    num_blocks = -(-t // bq) + min(b, t)
    work = _work_list(kv_lens, cu_q_lens, num_seqs, num_tokens=t, block_q=bq,
                      num_blocks=num_blocks)
    kv_fsd, table = flatten_pool(kv_pages, page_table, layer, pad_cols=ppb)
    q_tkgd = jnp.pad(pad_groups(q, n_kv, g, gp), ((0, bq), (0, 0), (0, 0), (0, 0)))
    scales_fs = None if kv_scales is None else flatten_scales(kv_scales, kv_pages)
    out = _prefill_call(
        work, table, q_tkgd, kv_fsd, scales_fs, width=width, num_pages=n_pages, block_q=bq,
        pages_per_block=ppb, sm_scale=float(sm_scale), soft_cap=soft_cap,
        sliding_window=sliding_window, precision=precision, num_warps=tile.num_warps,
        num_stages=tile.num_stages, interpret=interpret)
    out_thd = out[:t, :, :g].reshape(t, h, d)
    # Padding tokens were never written (their memory is undefined): select, don't multiply.
    tok = jnp.arange(t)
    valid = (tok >= cu_q_lens[0]) & (tok < cu_q_lens[num_seqs])
    return jnp.where(valid[:, None, None], out_thd, jnp.zeros_like(out_thd))
