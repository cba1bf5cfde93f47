"""Ragged paged attention on TPU (Pallas Mosaic): prefill chunks and decode in one kernel.

Axes: T query tokens (all sequences concatenated), B sequences (page-table rows), H query heads,
K kv heads, G = H // K query heads per kv head, D head_dim, L layers, P pages, S page_size,
W pages per page-table row, Tq tokens per q block, R = Tq * G rows of a q block, N pages per kv
block, Bk = N * S keys per kv block.

Semantics are exactly those of ``reference.ragged_paged_attention_reference``. Design:

* Layout. Outside the kernel q [T, H, D] becomes q_krd [K, T_pad * G, D] with rows ordered
  (token, group), so one kv head's q block is a plain [R, D] matrix: one MXU matmul per kv block
  and no reshape in the kernel (the TPU interpreter cannot run ``ref.reshape``). K/V buffers are
  [2, Bk, D] and each page is DMA'd into its own row window, so a kv block is 2-D from the start.
* Grid (T_pad / Tq, K), both "parallel". A step owns one q block and one kv head and keeps no
  state across steps (scratch is reset on entry, every DMA it starts is waited before it ends),
  so steps may run in any order, megacore may split either axis, and steps cannot race. q
  blocks lead because a tensor-parallel shard often holds only one or two kv heads. One head
  per step keeps every block 2-D, and one head's page is a contiguous [S, D] slab of the pool.
* Scalar prefetch (SMEM): meta = [num_seqs, layer], the flattened page table, kv_lens and
  cu_q_lens. ``layer`` indexes the pool inside the DMA, so a scan over layers never slices it.
* Pipeline. Inside a step a while loop walks the (sequence, kv block) pairs the q block needs,
  sequence by sequence. Iteration i starts the page DMAs of pair i + 1 into the other slot and
  then computes pair i, so fetches overlap compute across sequence boundaries too; K is waited
  before QK^T and V only before PV. A step's first fetch is exposed (the price of independence).
* Skipping. Only sequences overlapping the q block are visited (binary search over cu_q_lens
  for the first). Per sequence, kv blocks span [first key any row may see, last row's causal
  limit], and inside a block only pages in that key range are fetched: pages past the causal
  limit or kv_len, and pages entirely before the sliding window, cost no DMA.
* Exactness. Masked logits are -1e30 (finite) and probabilities are zeroed under the mask, so
  a row with nothing to attend to (padding, other sequences' rows) keeps m/l/acc untouched and
  returns 0, never NaN. V rows outside the fetched key range are zeroed before PV: slots the DMA
  skipped may hold stale data or NaN (uninitialised VMEM; freed pages filled with NaN).

TPU constraints, met by the defaults in ``tpu_block_sizes``: R a multiple of the sublane tile
(8 f32 / 16 bf16) or the whole row axis; S a multiple of the sublane tile so every page DMA lands
tile-aligned; D = 128 is the natural lane width (smaller D is legal as a full-dim block, padded).
The interpreter checks none of this; the tests' tiny shapes respect it anyway (D = 64 or 128).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_block_sizes

_MASKED = -1e30  # finite, as in the reference: exp(_MASKED - _MASKED) = 1 keeps l/acc intact
_LANES = 128  # m and l are stored lane-replicated: Mosaic's native [*, 128] f32 layout


class _Seq(NamedTuple):
    """Scalars of one sequence as seen from one q block (all int32 scalars)."""

    live: jax.Array  # the sequence exists and starts before the block ends
    q_start: jax.Array  # first token of the sequence
    q_end: jax.Array  # one past its last token
    shift: jax.Array  # key position of token t is t + shift
    key_lo: jax.Array  # first key any of its rows in this block may see
    key_hi: jax.Array  # one past the last such key
    j_lo: jax.Array  # first kv block to visit
    j_hi: jax.Array  # one past the last (== j_lo: nothing to do)


def _kernel(meta_ref, pt_ref, kv_lens_ref, cu_ref,  # SMEM: i32[2], i32[B*W], i32[B], i32[B+1]
            q_ref, k_hbm, v_hbm,  # [R, D] VMEM; [L, K, P, S, D] HBM (twice)
            o_ref,  # [R, D]
            k_buf, v_buf, sems, m_ref, l_ref, acc_ref,  # [2, Bk, D] x2, DMA[2, 2], f32 scratch
            *, group, pages_per_block, pages_per_row, sm_scale, soft_cap, sliding_window):
    qb, kh = pl.program_id(0), pl.program_id(1)
    rows, _ = q_ref.shape
    page_size = k_hbm.shape[3]
    bk = pages_per_block * page_size
    max_seqs = kv_lens_ref.shape[0]
    num_seqs = jnp.minimum(meta_ref[0], max_seqs)
    layer = meta_ref[1]
    t0 = qb * (rows // group)
    t1 = t0 + rows // group  # this step's tokens: [t0, t1)

    def seq(b):
        bc = jnp.minimum(b, max_seqs - 1)  # b may equal num_seqs: keep SMEM reads in bounds
        q_start, q_end, kv_len = cu_ref[bc], cu_ref[bc + 1], kv_lens_ref[bc]
        live = (b < num_seqs) & (q_start < t1)
        lo_t, hi_t = jnp.maximum(q_start, t0), jnp.minimum(q_end, t1)
        shift = kv_len - q_end
        key_hi = jnp.minimum(jnp.minimum(hi_t + shift, kv_len), pages_per_row * page_size)
        key_lo = jnp.int32(0)
        if sliding_window is not None:
            key_lo = jnp.maximum(lo_t + shift - (sliding_window - 1), 0)
        j_lo = key_lo // bk
        busy = live & (lo_t < hi_t) & (key_lo < key_hi)
        j_hi = jnp.where(busy, (key_hi + bk - 1) // bk, j_lo)
        return _Seq(live, q_start, q_end, shift, key_lo, key_hi, j_lo, j_hi)

    def plan(s, b, j):
        """Physical page and needed-flag per page of kv block j (SMEM reads happen here only)."""
        base = jnp.minimum(b, max_seqs - 1) * pages_per_row
        pg_lo, pg_hi = s.key_lo // page_size, (s.key_hi + page_size - 1) // page_size
        pages, needed = [], []
        for i in range(pages_per_block):
            p = j * pages_per_block + i
            pages.append(pt_ref[base + jnp.clip(p, 0, pages_per_row - 1)])
            needed.append(s.live & (j < s.j_hi) & (p >= pg_lo) & (p < pg_hi))
        return tuple(pages), tuple(needed)

    def copies(pages, slot, hbm, buf, kind):  # page i -> rows [i*S, (i+1)*S) of the slot
        return [pltpu.make_async_copy(hbm.at[layer, kh, page],
                                      buf.at[slot, pl.ds(i * page_size, page_size)],
                                      sems.at[kind, slot])
                for i, page in enumerate(pages)]

    def start(pages, needed, slot):  # start and wait of one page share its `needed` flag
        for n, k_copy, v_copy in zip(needed, copies(pages, slot, k_hbm, k_buf, 0),
                                     copies(pages, slot, v_hbm, v_buf, 1), strict=True):
            @pl.when(n)
            def _(k_copy=k_copy, v_copy=v_copy):
                k_copy.start()
                v_copy.start()

    def wait(pages, needed, slot, hbm, buf, kind):
        for n, copy in zip(needed, copies(pages, slot, hbm, buf, kind), strict=True):
            pl.when(n)(copy.wait)

    def compute(s, j, slot, pages, needed):
        wait(pages, needed, slot, k_hbm, k_buf, 0)
        logits = lax.dot_general(q_ref[...], k_buf[slot], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        tok = t0 + lax.broadcasted_iota(jnp.int32, logits.shape, 0) // group
        key = j * bk + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        pos = tok + s.shift
        mask = (tok >= s.q_start) & (tok < s.q_end) & (key <= pos) & (key < s.key_hi)
        if sliding_window is not None:
            mask &= pos - key < sliding_window
        logits = jnp.where(mask, logits, _MASKED)
        m_prev, l_prev = m_ref[...][:, :1], l_ref[...][:, :1]
        m_next = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(logits - m_next), 0.0)
        m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(alpha * l_prev + p.sum(axis=1, keepdims=True), l_ref.shape)
        wait(pages, needed, slot, v_hbm, v_buf, 1)  # V's DMA overlapped QK^T and the softmax
        v_key = j * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        v_ok = (v_key >= s.key_lo) & (v_key < s.key_hi)  # select in f32: v5e has no bf16 VPU
        v = jnp.where(v_ok, v_buf[slot].astype(jnp.float32), 0.0).astype(v_buf.dtype)
        acc_ref[...] = alpha * acc_ref[...] + lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    # Binary search: the first sequence whose tokens reach into this block.
    def bisect(_, lo_hi):
        lo, hi = lo_hi
        mid = (lo + hi) // 2
        right = cu_ref[jnp.minimum(mid, max_seqs - 1) + 1] <= t0
        return (jnp.where((lo < hi) & right, mid + 1, lo),
                jnp.where((lo < hi) & ~right, mid, hi))

    b_first, _ = lax.fori_loop(0, max_seqs.bit_length(), bisect, (jnp.int32(0), num_seqs))
    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    first = seq(b_first)
    first_plan = plan(first, b_first, first.j_lo)
    start(*first_plan, 0)

    def body(carry):
        # Pair (b, j) was planned, and its DMAs started into `slot`, one iteration earlier.
        b, j, slot, cur, pages, needed = carry
        more = j + 1 < cur.j_hi
        nb = jnp.where(more, b, b + 1)
        nxt = seq(nb)
        nj = jnp.where(more, j + 1, nxt.j_lo)
        nxt_plan = plan(nxt, nb, nj)
        start(*nxt_plan, 1 - slot)
        pl.when(j < cur.j_hi)(functools.partial(compute, cur, j, slot, pages, needed))
        return (nb, nj, 1 - slot, nxt) + nxt_plan

    lax.while_loop(lambda carry: carry[3].live, body,
                   (b_first, first.j_lo, jnp.int32(0), first) + first_plan)
    l_fin = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(l_fin > 0, l_fin, 1.0)).astype(o_ref.dtype)


def _ragged_pallas_call(
    q_krd,  # [K, T_pad * G, D]  rows ordered (token, group)
    k_pages,  # [L, K, P, S, D]
    v_pages,  # [L, K, P, S, D]
    page_table,  # i32[B, W]
    kv_lens,  # i32[B]
    cu_q_lens,  # i32[B + 1]
    meta,  # i32[2]  (num_seqs, layer)
    *, group, num_q_per_block, pages_per_block, sm_scale, soft_cap, sliding_window,
    vmem_limit_bytes,
):
    """One pallas_call over the (q block, kv head) grid -> [K, T_pad * G, D]."""
    num_kv_heads, num_rows, head_dim = q_krd.shape
    page_size = k_pages.shape[3]
    pages_per_row = page_table.shape[1]
    rows = num_q_per_block * group
    bk = pages_per_block * page_size
    q_block = pl.BlockSpec((None, rows, head_dim), lambda qb, kh, *_: (kh, qb, 0))
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)  # pages stay in HBM; the kernel DMAs what it needs
    kernel = functools.partial(
        _kernel, group=group, pages_per_block=pages_per_block, pages_per_row=pages_per_row,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_rows // rows, num_kv_heads),
            in_specs=[q_block, in_hbm, in_hbm],
            out_specs=q_block,
            scratch_shapes=[
                pltpu.VMEM((2, bk, head_dim), k_pages.dtype),  # K double buffer
                pltpu.VMEM((2, bk, head_dim), v_pages.dtype),  # V double buffer
                pltpu.SemaphoreType.DMA((2, 2)),  # [K/V, slot]
                pltpu.VMEM((rows, _LANES), jnp.float32),  # m: running row max
                pltpu.VMEM((rows, _LANES), jnp.float32),  # l: running softmax denominator
                pltpu.VMEM((rows, head_dim), jnp.float32),  # acc: unnormalised output
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes),
        out_shape=jax.ShapeDtypeStruct(q_krd.shape, q_krd.dtype),
        name="ragged_paged_attention_tpu",
    )(meta, page_table.reshape(-1), kv_lens, cu_q_lens, q_krd, k_pages, v_pages)


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {msg}")


def _validate(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs, layer, *,
              sm_scale, soft_cap, sliding_window, num_q_per_block, pages_per_block,
              vmem_limit_bytes) -> None:
    """Static checks (shapes, dtypes, knobs); each error names the offending argument."""
    _check(q.ndim == 3, "q", f"expected [T, H, D], got shape {q.shape}")
    _check(k_pages.ndim in (4, 5), "k_pages",
           f"expected [K, P, S, D] or [L, K, P, S, D], got shape {k_pages.shape}")
    _check(v_pages.shape == k_pages.shape and v_pages.dtype == k_pages.dtype, "v_pages",
           f"must match k_pages {k_pages.dtype}{list(k_pages.shape)}, "
           f"got {v_pages.dtype}{list(v_pages.shape)}")
    _check(k_pages.dtype == q.dtype, "k_pages", f"dtype {k_pages.dtype} != q dtype {q.dtype}")
    t, h, d = q.shape
    num_kv_heads, _, page_size, head_dim = k_pages.shape[-4:]
    _check(head_dim == d, "k_pages", f"head_dim {head_dim} != q head_dim {d}")
    _check(h % num_kv_heads == 0, "q", f"{h} heads is not a multiple of {num_kv_heads} kv heads")
    tile = tpu_block_sizes.sublane_tile(k_pages.dtype)
    _check(page_size % tile == 0, "k_pages",
           f"page_size {page_size} must be a multiple of {tile} (the {k_pages.dtype} sublane "
           "tile) so each page DMA lands tile-aligned in VMEM")
    if k_pages.ndim == 5:
        _check(layer is not None and jnp.ndim(layer) == 0
               and jnp.issubdtype(jnp.result_type(layer), jnp.integer), "layer",
               f"5-D pages need an integer scalar layer, got {layer!r}")
    else:
        _check(layer is None, "layer", "only valid with 5-D [L, K, P, S, D] pages")
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


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "sliding_window", "num_q_per_block", "pages_per_block",
    "vmem_limit_bytes"))
def ragged_paged_attention_tpu(
    q,  # [T, H, D]  new tokens of all sequences, concatenated
    k_pages,  # [K, P, S, D], or [L, K, P, S, D] with `layer`
    v_pages,  # same as k_pages
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
):
    """Ragged causal attention of new tokens over a paged KV cache on TPU -> [T, H, D].

    Same semantics as ``ragged_paged_attention_reference``; tokens past ``cu_q_lens[num_seqs]``
    return zeros. Page-table entries, kv_lens and ``layer`` are trusted (checked dynamically only
    by the TPU interpreter, which raises on out-of-bounds reads).
    """
    _validate(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs, layer,
              sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
              num_q_per_block=num_q_per_block, pages_per_block=pages_per_block,
              vmem_limit_bytes=vmem_limit_bytes)
    t, h, d = q.shape
    if k_pages.ndim == 4:  # a unit layer axis is a free bitcast; one kernel serves both layouts
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    num_kv_heads, _, page_size, _ = k_pages.shape[1:]
    g = h // num_kv_heads
    tq = num_q_per_block or tpu_block_sizes.default_num_q_per_block(t, g, q.dtype)
    n = pages_per_block or tpu_block_sizes.default_pages_per_block(
        page_size, page_table.shape[1])
    t_pad = pl.cdiv(t, tq) * tq
    q_thd = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0)))
    q_krd = q_thd.reshape(t_pad, num_kv_heads, g, d).transpose(1, 0, 2, 3).reshape(
        num_kv_heads, t_pad * g, d)
    meta = jnp.stack([num_seqs.reshape(()), jnp.asarray(layer, jnp.int32)])
    out_krd = _ragged_pallas_call(
        q_krd, k_pages, v_pages, page_table, kv_lens, cu_q_lens, meta, group=g,
        num_q_per_block=tq, pages_per_block=n, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, vmem_limit_bytes=vmem_limit_bytes)
    out_thd = out_krd.reshape(num_kv_heads, t_pad, g, d).transpose(1, 0, 2, 3)
    return out_thd.reshape(t_pad, h, d)[:t]


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "sliding_window", "num_q_per_block", "pages_per_block",
    "vmem_limit_bytes"))
def paged_decode_attention_tpu(
    q,  # [B, H, D]  one new token per sequence
    k_pages,  # [K, P, S, D], or [L, K, P, S, D] with `layer`
    v_pages,  # same as k_pages
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
):
    """Decode attention (one query per sequence): the ragged kernel with cu_q_lens = arange."""
    b = page_table.shape[0]
    _check(q.ndim == 3 and q.shape[0] == b, "q", f"expected [{b}, H, D], got {q.shape}")
    _check(lengths.shape == (b,) and lengths.dtype == jnp.int32, "lengths",
           f"expected i32[{b}], got {lengths.dtype}{list(lengths.shape)}")
    ragged = (q, k_pages, v_pages, page_table, lengths, jnp.arange(b + 1, dtype=jnp.int32),
              jnp.int32(b))
    knobs = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                 pages_per_block=pages_per_block, vmem_limit_bytes=vmem_limit_bytes)
    _validate(*ragged, layer, num_q_per_block=num_q_per_block, **knobs)
    g = q.shape[1] // k_pages.shape[-4]
    tq = num_q_per_block or tpu_block_sizes.default_decode_num_q_per_block(b, g, q.dtype)
    return ragged_paged_attention_tpu(*ragged, layer=layer, num_q_per_block=tq, **knobs)
