"""The TPU ragged paged-attention kernel (Pallas Mosaic): body on refs and its pallas_call.

Axes: T query tokens (all sequences concatenated), B sequences (page-table rows), H query heads,
K kv heads, G = H // K query heads per kv head, D head_dim, L layers, P pages, S page_size,
W pages per page-table row, Tq tokens per q block, R = Tq * G rows of a q block, N pages per kv
block, Bk = N * S keys per kv block, E = D (D a multiple of 128) or 2D (otherwise): q lanes.

Semantics are exactly those of ``reference.ragged_paged_attention_reference``. Design:

* Layout. Pages are packed K|V, ``[L, K, P, S, 2D]`` (``layout.py``): one DMA brings a page's
  keys and values, and at D = 64 a page row is exactly the 128-lane tile, so XLA keeps the pool
  row-major and never copies it for the kernel. Outside the kernel q [T, H, D] becomes
  q_kre [K, T_pad * G, E] with rows ordered (token, group), so one kv head's q block is a plain
  [R, E] matrix (no reshape in the kernel; the TPU interpreter cannot run ``ref.reshape``).
  With D a multiple of 128 the kernel reads K and V as lane-aligned halves of the buffer. With
  D = 64 (not lane-aligned) q is zero-padded to 2D lanes: q_pad @ [K|V]^T = q @ K^T exactly,
  and P @ [K|V] carries P @ V in its upper D lanes, which the wrapper keeps.
* Grid (T_pad / Tq, K), both "parallel". A step owns one q block and one kv head and keeps no
  state across steps (scratch is reset on entry, every DMA it starts is waited before it ends),
  so steps may run in any order, megacore may split either axis, and steps cannot race. q
  blocks lead because a tensor-parallel shard often holds only one or two kv heads.
* SMEM. Scalar prefetch holds meta = [num_seqs, layer], kv_lens and cu_q_lens: O(B). The page
  table stays [B, W] in HBM: for each kv block it visits, a step DMAs the tile-aligned window
  (8 rows x up to 256 columns) holding that block's N entries into SMEM, so SMEM does not grow
  with B x W (a whole 256 x 2048 table would not fit the 1 MiB of SMEM) and the table is never
  reshaped or copied. ``layer`` indexes the pool inside the DMA, so a scan over layers never
  slices it.
* Pipeline. Inside a step a while loop walks the (sequence, kv block) pairs the q block needs,
  sequence by sequence. Iteration i starts the page DMAs of pair i + 1 (its table entries
  arrived during iteration i - 1), starts the table DMA of pair i + 2, then computes pair i, so
  fetches overlap compute across sequence boundaries too. A step's first fetch is exposed.
* Skipping. Only sequences overlapping the q block are visited (binary search over cu_q_lens
  for the first). Per sequence, kv blocks span [first key any row may see, last row's causal
  limit], and inside a block only pages in that key range are fetched: pages past the causal
  limit or kv_len, and pages entirely before the sliding window, cost no DMA.
* Safety. Page ids are clamped to [0, P) and ``layer`` to [0, L) before they address HBM, so
  a stale or garbage table entry can never become an out-of-bounds DMA.
* Exactness. Masked logits are -1e30 (finite) and probabilities are zeroed under the mask, so
  a row with nothing to attend to (padding, other sequences' rows) keeps m/l/acc untouched and
  returns 0, never NaN. Rows outside the fetched key range are zeroed before PV: slots the DMA
  skipped may hold stale data or NaN (uninitialised VMEM; freed pages filled with NaN).
* Quantized pages (int8, fp8 e4m3; ``quant.py``). Each page DMA comes with a DMA of the 32-bit
  scale row holding the page's S scale words (rows of Ws = Gs * S words, Gs = 128 / S pages
  per row: ``quant.scale_rows_shape`` says why) into a double-buffered
  [2, N, Ws] VMEM buffer, on a semaphore of its own, started and waited with the page's DMA
  (same clamped page id, same `needed` flag). No dequantized copy of K or V is made: the
  integer tile is converted to q's dtype (exact for int8 and e4m3 into bf16) and the scales
  act on the key columns: logits = (q @ K^T) * k_scale[1, Bk] before the mask, and
  acc += (p * v_scale[1, Bk]) @ V, with the softmax denominator summing the unscaled p. The
  [1, Bk] scale rows are gathered from the buffer by a one-hot MXU matmul (``scale_rows``),
  exact because scales are bfloat16 numbers; words of keys outside the block's key range
  (rows the DMA skipped: garbage, NaN included) are zeroed before it, the mask is applied
  after the key scale, and fp8 value rows out of range are zeroed (fp8 garbage can be NaN,
  int8 cannot), so garbage never reaches m, l or acc.

TPU constraints, met by the defaults in ``tpu_block_sizes``: R a multiple of the sublane tile
(8 f32 / 16 bf16) or the whole row axis; S a multiple of the pages' sublane tile (32 for int8
and fp8) so every page DMA lands tile-aligned. The interpreter checks none of this;
``make test-aot`` compiles the kernel for v5e and v6e.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_MASKED = -1e30  # finite, as in the reference: exp(_MASKED - _MASKED) = 1 keeps l/acc intact
_LANES = 128  # m and l are stored lane-replicated: Mosaic's native [*, 128] f32 layout
# The page table stays [B, W] in HBM, tiled (8, 128) as XLA lays out i32 matrices: a DMA must
# start on a tile, so a kv block fetches the 8-row, 256-column window holding its N entries.
TABLE_ROWS = 8
_TABLE_LANES = 128
_TABLE_COLS = 2 * _TABLE_LANES  # covers N <= 128 entries at any column offset
MAX_PAGES_PER_BLOCK = _TABLE_LANES


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


class _Pair(NamedTuple):
    """One (sequence, kv block) pair of the walk."""

    b: jax.Array
    j: jax.Array
    seq: _Seq

    @property
    def busy(self):  # a kv block with keys to fetch and compute
        return self.seq.live & (self.j < self.seq.j_hi)


def _kernel(meta_ref, kv_lens_ref, cu_ref,  # SMEM: i32[2], i32[B], i32[B+1]
            q_ref, kv_hbm, pt_hbm,  # [R, E] VMEM; [L, K, P, S, 2D] HBM; i32[B8, Wt] HBM
            *refs, group, pages_per_block, pages_per_row, sm_scale, soft_cap, sliding_window,
            quantized):
    """refs: [sc_hbm (quantized: i32[L, K, ceil(P / Gs), Ws] HBM),] o_ref [R, E], then
    scratch: kv_buf [2, Bk, 2D], [sc_buf i32[2, N, Ws] and fold_ref bf16[Ws, Bk] (quantized),]
    pt_buf SMEM i32[2, 8, C], sems DMA[2 or 3, 2] ([pages, table, scales], slot), m_ref,
    l_ref, acc_ref."""
    if quantized:
        sc_hbm, o_ref, kv_buf, sc_buf, fold_ref, pt_buf, sems, m_ref, l_ref, acc_ref = refs
        scale_width = sc_hbm.shape[-1]  # Ws = Gs * S: the scale words of Gs pages per row
    else:
        o_ref, kv_buf, pt_buf, sems, m_ref, l_ref, acc_ref = refs
    qb, kh = pl.program_id(0), pl.program_id(1)
    rows, lanes = q_ref.shape
    n_layers, _, n_pages, page_size, d2 = kv_hbm.shape
    d = d2 // 2
    aligned = lanes == d  # D % 128 == 0: K and V are lane-aligned halves of a buffer row
    bk = pages_per_block * page_size
    max_seqs = kv_lens_ref.shape[0]
    num_seqs = jnp.minimum(meta_ref[0], max_seqs)
    layer = jnp.clip(meta_ref[1], 0, n_layers - 1)
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

    def advance(p: _Pair) -> _Pair:
        more = p.j + 1 < p.seq.j_hi
        nb = jnp.where(more, p.b, p.b + 1)
        nxt = seq(nb)
        return _Pair(nb, jnp.where(more, p.j + 1, nxt.j_lo), nxt)

    window_rows, table_cols = pt_buf.shape[1:]  # 8 rows (or all, if fewer); C columns
    table_width = pt_hbm.shape[1]

    def table_window(p: _Pair):
        """(first row, first column) of the tile-aligned window holding the pair's entries,
        and the entries' row and column inside it."""
        b = jnp.minimum(p.b, max_seqs - 1)
        col = jnp.clip(p.j * pages_per_block, 0, table_width - 1)
        r0 = jnp.int32(0)  # a window of all rows starts at row 0 (no tile alignment needed)
        if window_rows < pt_hbm.shape[0]:  # 8-row windows of a table padded to 8k rows
            r0 = b // window_rows * window_rows
        c0 = jnp.int32(0)
        if table_cols < table_width:  # both multiples of 128: c0 is too
            c0 = jnp.minimum(col // _TABLE_LANES * _TABLE_LANES, table_width - table_cols)
        return r0, c0, b - r0, col - c0

    def table_copy(p: _Pair, slot):
        r0, c0, _, _ = table_window(p)
        src = pt_hbm.at[pl.ds(pl.multiple_of(r0, window_rows), window_rows),
                        pl.ds(pl.multiple_of(c0, _TABLE_LANES), table_cols)]
        return pltpu.make_async_copy(src, pt_buf.at[slot], sems.at[1, slot])

    def plan(p: _Pair, slot):
        """Physical page and needed-flag per page of the pair (its table entries in `slot`)."""
        s = p.seq
        pg_lo, pg_hi = s.key_lo // page_size, (s.key_hi + page_size - 1) // page_size
        _, _, row, col = table_window(p)
        pages, needed = [], []
        for i in range(pages_per_block):
            logical = p.j * pages_per_block + i
            # Entries past the window belong to pages past the row (never needed): clamp the
            # SMEM read, then the page id into the pool.
            entry = pt_buf[slot, row, jnp.minimum(col + i, table_cols - 1)]
            pages.append(jnp.clip(entry, 0, n_pages - 1))
            needed.append(p.busy & (logical >= pg_lo) & (logical < pg_hi))
        return tuple(pages), tuple(needed)

    def copies(pages, slot):
        """Per page, its DMAs: page i -> rows [i*S, (i+1)*S) of the slot, and (quantized) the
        scale row holding its S words -> row i of the slot's scale buffer."""
        out = []
        for i, page in enumerate(pages):
            page_copies = [pltpu.make_async_copy(
                kv_hbm.at[layer, kh, page], kv_buf.at[slot, pl.ds(i * page_size, page_size)],
                sems.at[0, slot])]
            if quantized:
                page_copies.append(pltpu.make_async_copy(
                    sc_hbm.at[layer, kh, pl.ds(page // (scale_width // page_size), 1)],
                    sc_buf.at[slot, pl.ds(i, 1)], sems.at[2, slot]))
            out.append(page_copies)
        return out

    def start_pages(pages, needed, slot):  # start and wait of one page share its `needed` flag
        for n, page_copies in zip(needed, copies(pages, slot), strict=True):
            for copy in page_copies:
                pl.when(n)(copy.start)

    def wait_pages(pages, needed, slot):
        for n, page_copies in zip(needed, copies(pages, slot), strict=True):
            for copy in page_copies:
                pl.when(n)(copy.wait)

    def scale_rows(p: _Pair, slot, pages):
        """(key scales, value scales), each f32[1, Bk] with key j*Bk + c in lane c: the words
        of the block's keys gathered from the scale buffer, 0 for keys outside
        [key_lo, key_hi) (rows the DMA skipped may hold anything, NaN included).

        Row i of the buffer holds the Ws words of scale row page_i // Gs; page i's S words
        start at lane o_i = page_i % Gs * S. A one-hot MXU matmul moves them into lanes
        [i*S, (i+1)*S): with X[i, l] the word at lane l of row i, zeroed outside
        [o_i, o_i + S) and for keys out of range, and F[l, c] = (l % S == c % S),
        (X @ F)[i, c] = X[i, o_i + c % S]; then row i's own lanes (c // S == i) are kept and
        the rows summed. Scales are bfloat16 numbers (quant.py), so the bf16 matmul with f32
        accumulation is exact: one nonzero product per output."""
        n = pages_per_block
        shape = (n, scale_width)
        row = lax.broadcasted_iota(jnp.int32, shape, 0)
        lane = lax.broadcasted_iota(jnp.int32, shape, 1)
        start = jnp.zeros(shape, jnp.int32)
        for i, page in enumerate(pages):
            start = jnp.where(row == i, page % (scale_width // page_size) * page_size, start)
        slot_in_page = lane - start
        key = p.j * bk + row * page_size + slot_in_page
        ok = ((slot_in_page >= 0) & (slot_in_page < page_size)
              & (key >= p.seq.key_lo) & (key < p.seq.key_hi))
        words, fold = sc_buf[slot], fold_ref[...]
        own = (lax.broadcasted_iota(jnp.int32, (n, bk), 1) // page_size
               == lax.broadcasted_iota(jnp.int32, (n, bk), 0))
        out = []
        for bits in (words & jnp.int32(-65536), words << 16):  # key: high half; value: low
            x = jnp.where(ok, lax.bitcast_convert_type(bits, jnp.float32), 0.0)
            a = lax.dot_general(x.astype(jnp.bfloat16), fold, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
            out.append(jnp.where(own, a, 0.0).sum(axis=0, keepdims=True))
        return out

    def compute(p: _Pair, slot, pages, needed):
        s, j = p.seq, p.j
        wait_pages(pages, needed, slot)
        if aligned:
            k = kv_buf[slot, :, pl.ds(0, d)]
            v = kv_buf[slot, :, pl.ds(d, d)]
        else:  # q's upper D lanes are zero: q @ [K|V]^T == q @ K^T
            k = v = kv_buf[slot]
        v_key = j * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        v_ok = (v_key >= s.key_lo) & (v_key < s.key_hi)  # select in f32: v5e has no bf16 VPU
        if quantized:
            # Integer values, scaled per key column outside the MXU: q @ (k * ks)^T is
            # (q @ k^T) * ks, and p @ (v * vs) is (p * vs) @ v. int8 and fp8 e4m3 values
            # convert to bf16 exactly, so the MXU takes q's dtype (v5e has no int8 x bf16).
            k_scale, v_scale = scale_rows(p, slot, pages)
            k = k.astype(jnp.float32)
            v = k if not aligned else v.astype(jnp.float32)
            if jnp.issubdtype(kv_buf.dtype, jnp.floating):  # fp8 garbage may be NaN; int8 not
                v = jnp.where(v_ok, v, 0.0)
            k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
        logits = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        if quantized:  # keys out of range have scale 0 (scale_rows); masked below anyway
            logits = logits * k_scale
        logits = logits * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        tok = t0 + lax.broadcasted_iota(jnp.int32, logits.shape, 0) // group
        key = j * bk + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        pos = tok + s.shift
        mask = (tok >= s.q_start) & (tok < s.q_end) & (key <= pos) & (key < s.key_hi)
        if sliding_window is not None:
            mask &= pos - key < sliding_window
        logits = jnp.where(mask, logits, _MASKED)  # after scaling: NaN * scale stays masked
        m_prev, l_prev = m_ref[...][:, :1], l_ref[...][:, :1]
        m_next = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p_rk = jnp.where(mask, jnp.exp(logits - m_next), 0.0)
        m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(alpha * l_prev + p_rk.sum(axis=1, keepdims=True),
                                      l_ref.shape)
        if quantized:
            # v_scale is 0 for every key out of range (never NaN there): p * v_scale is 0 for
            # them, and the softmax denominator above uses the unscaled p.
            p_rk = p_rk * v_scale
        else:
            v = jnp.where(v_ok, v.astype(jnp.float32), 0.0).astype(kv_buf.dtype)
        acc_ref[...] = alpha * acc_ref[...] + lax.dot_general(
            p_rk.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32)

    # Binary search: the first sequence whose tokens reach into this block.
    def bisect(_, lo_hi):
        lo, hi = lo_hi
        mid = (lo + hi) // 2
        right = cu_ref[jnp.minimum(mid, max_seqs - 1) + 1] <= t0
        return (jnp.where((lo < hi) & right, mid + 1, lo),
                jnp.where((lo < hi) & ~right, mid, hi))

    b_first, _ = lax.fori_loop(0, max_seqs.bit_length(), bisect, (jnp.int32(0), num_seqs))
    if quantized:  # F of scale_rows, built once per step (its iotas would cost every block)
        fold = (lax.broadcasted_iota(jnp.int32, fold_ref.shape, 0) % page_size
                == lax.broadcasted_iota(jnp.int32, fold_ref.shape, 1) % page_size)
        fold_ref[...] = fold.astype(jnp.float32).astype(fold_ref.dtype)
    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    first_seq = seq(b_first)
    first = _Pair(b_first, first_seq.j_lo, first_seq)
    first_copy = table_copy(first, 0)

    @pl.when(first.busy)
    def _():
        first_copy.start()
        first_copy.wait()

    first_plan = plan(first, 0)
    start_pages(*first_plan, 0)
    second = advance(first)
    pl.when(second.busy)(table_copy(second, 1).start)

    def body(carry):
        # `cur`'s page DMAs were started into `slot` one iteration earlier; `nxt`'s table
        # entries are on their way into the other slot.
        cur, slot, pages, needed, nxt = carry
        other = 1 - slot
        pl.when(nxt.busy)(table_copy(nxt, other).wait)
        nxt_plan = plan(nxt, other)
        start_pages(*nxt_plan, other)
        after = advance(nxt)
        pl.when(after.busy)(table_copy(after, slot).start)  # cur's entries were read already
        pl.when(cur.busy)(functools.partial(compute, cur, slot, pages, needed))
        return (nxt, other) + nxt_plan + (after,)

    lax.while_loop(lambda carry: carry[0].seq.live, body,
                   (first, jnp.int32(0)) + first_plan + (second,))
    l_fin = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(l_fin > 0, l_fin, 1.0)).astype(o_ref.dtype)


def table_window(rows: int, cols: int) -> tuple[int, int]:
    """(rows, columns) of one table window: all rows up to 8 (else 8), the whole row up to 256
    columns (else 256). A window dim equal to the whole array dim needs no tile alignment."""
    return min(rows, TABLE_ROWS), min(cols, _TABLE_COLS)


def _table_for_dma(page_table):
    """The table as the kernel DMAs it: past 8 rows, rows padded to a multiple of 8, and past
    256 columns, columns to a multiple of 128, so every window starts on a tile. Tables whose
    sides are already such multiples (or small) are used as they are; padding copies the table
    (B x W i32: small next to the pages)."""
    b, w = page_table.shape
    rows = b if b <= TABLE_ROWS else -(-b // TABLE_ROWS) * TABLE_ROWS
    cols = w if w <= _TABLE_COLS else -(-w // _TABLE_LANES) * _TABLE_LANES
    if (rows, cols) == (b, w):
        return page_table
    return jnp.pad(page_table, ((0, rows - b), (0, cols - w)))


def ragged_pallas_call(
    q_kre,  # [K, T_pad * G, E]  rows ordered (token, group)
    kv_pages,  # [L, K, P, S, 2D]
    page_table,  # i32[B, W]
    kv_lens,  # i32[B]
    cu_q_lens,  # i32[B + 1]
    meta,  # i32[2]  (num_seqs, layer)
    kv_scales=None,  # i32[L, K, P / Gs, Ws]: scale rows of quantized pages (or None)
    *, group, num_q_per_block, pages_per_block, sm_scale, soft_cap, sliding_window,
    vmem_limit_bytes,
):
    """One pallas_call over the (q block, kv head) grid -> [K, T_pad * G, E].

    ``kv_scales`` (quantized pages only): the scale words as rows of Ws = Gs * S words, Gs
    consecutive pages per row (``quant.scale_rows_shape``)."""
    num_kv_heads, num_rows, lanes = q_kre.shape
    page_size, d2 = kv_pages.shape[3:]
    pages_per_row = page_table.shape[1]
    rows = num_q_per_block * group
    bk = pages_per_block * page_size
    table = _table_for_dma(page_table)
    quantized = kv_scales is not None
    q_block = pl.BlockSpec((None, rows, lanes), lambda qb, kh, *_: (kh, qb, 0))
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)  # pages and table stay in HBM; DMA'd on demand
    kernel = functools.partial(
        _kernel, group=group, pages_per_block=pages_per_block, pages_per_row=pages_per_row,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        quantized=quantized)
    scale_buffer = []
    if quantized:  # the scale rows of the block's pages, double-buffered like the pages; F
        scale_width = kv_scales.shape[-1]
        scale_buffer = [pltpu.VMEM((2, pages_per_block, scale_width), jnp.int32),
                        pltpu.VMEM((scale_width, bk), jnp.bfloat16)]
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_rows // rows, num_kv_heads),
            in_specs=[q_block, in_hbm, in_hbm] + ([in_hbm] if quantized else []),
            out_specs=q_block,
            scratch_shapes=[
                pltpu.VMEM((2, bk, d2), kv_pages.dtype),  # K|V double buffer
                *scale_buffer,
                pltpu.SMEM((2, *table_window(*table.shape)), jnp.int32),  # table windows
                # [pages, table, scales (quantized)] x slot
                pltpu.SemaphoreType.DMA((3 if quantized else 2, 2)),
                pltpu.VMEM((rows, _LANES), jnp.float32),  # m: running row max
                pltpu.VMEM((rows, _LANES), jnp.float32),  # l: running softmax denominator
                pltpu.VMEM((rows, lanes), jnp.float32),  # acc: unnormalised output
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes),
        out_shape=jax.ShapeDtypeStruct(q_kre.shape, q_kre.dtype),
        name="ragged_paged_attention_tpu",
    )(meta, kv_lens, cu_q_lens, q_kre, kv_pages, table,
      *([kv_scales] if quantized else []))
