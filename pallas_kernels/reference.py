"""Pure-jnp paged attention: the oracle for the kernels and the CPU attention path.

Axes: T query tokens (all sequences, concatenated), B sequences, H query heads, K kv heads,
G = H // K queries per kv head, D head_dim, P pages, S page_size, W pages per sequence row.

Pages hold K and V side by side: ``kv_pages[k, p, s, :D]`` is the key and ``kv_pages[k, p, s,
D:]`` the value of slot s of page p for kv head k (see ``layout.py`` for why).

Quantized pages (int8, float8_e4m3fn) come with ``kv_scales``, a key and a value scale per
slot in the scale array of ``quant.py`` (``[K, P / G, G * S]``, or ``[L, ...]`` with ``layer``):
keys and values are dequantized as each chunk of pages is gathered, never as a whole pool.

Semantics (shared by every kernel): sequence b owns queries ``q[cu_q_lens[b]:cu_q_lens[b+1]]``
and has ``kv_lens[b]`` cached tokens *including* those new ones. Its query i sits at position
``kv_lens[b] - q_len + i`` and attends causally to keys ``0..position`` (and, with a sliding
window w, only to the last w of them). Rows ``b >= num_seqs`` are padding; their queries, and any
query past ``cu_q_lens[num_seqs]``, return zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import scales_by_page, unpack_scales

_MASKED = -1e30  # finite, so a fully masked row gives zeros, never NaN
# Measured on XLA:CPU (2 cores, the 125M model of `jaxkv bench peers`): a decode step at
# batch 16 and ~330 tokens of context took 45 ms at 128 keys per chunk against 57-63 ms at 256
# (a chunk's gather covers whole chunks, so smaller ones waste less past the end of a row).
# 64 query tokens per block made a lone 512-token prefill 0.81 -> 0.59-0.65 s, but doubled
# TTFT on the mixed batches of bench peers (a block spanning rows gathers per token), so 32.
BLOCK_Q = 32  # query tokens per block of the ragged reference
BLOCK_KV = 256  # key positions per chunk of the ragged reference
DECODE_BLOCK_KV = 128  # key positions per chunk of the decode reference
SEGMENT_ROWS = 4  # a query block spanning up to this many rows goes row by row


def _keys_values(kv, scales, d):
    """Gathered packed pages [..., 2D] (and their scale words [...], or None) -> f32 keys and
    values [..., D]: where quantized pages are dequantized, chunk by chunk."""
    kk, vv = kv[..., :d].astype(jnp.float32), kv[..., d:].astype(jnp.float32)
    if scales is None:
        return kk, vv
    ks, vs = unpack_scales(scales)
    return kk * ks[..., None], vv * vs[..., None]


def _with_layer(kv_pages, kv_scales, layer):
    """5-D pages (and their scale words per page, [L, K, P', S]) and a layer index, whether or
    not ``layer`` was given."""
    if kv_scales is not None:
        kv_scales = scales_by_page(kv_scales, kv_pages.shape[-2])
    if layer is not None:
        return kv_pages, kv_scales, layer
    return kv_pages[None], None if kv_scales is None else kv_scales[None], 0


def ragged_paged_attention_reference(
    q,  # [T, H, D]
    kv_pages,  # [K, P, S, 2D]  keys in [..., :D], values in [..., D:]
    page_table,  # i32[B, W]
    kv_lens,  # i32[B]
    cu_q_lens,  # i32[B + 1]
    num_seqs,  # i32[]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    max_q_len: int | None = None,
    layer=None,
    kv_scales=None,  # i32[K, P / G, G * S] (or [L, ...]): scales of quantized pages (quant.py)
    block_q: int = BLOCK_Q,
    block_kv: int = BLOCK_KV,
):
    """Ragged causal attention of new query tokens over paged keys/values -> [T, H, D].

    Its work follows the real batch, not its padded shapes: queries go in blocks of
    ``block_q`` tokens, and only blocks holding real tokens run (a loop with a traced trip
    count); each block reads keys in chunks of ``block_kv`` positions, only up to the longest
    of its rows, with an online softmax (flash attention). A block whose tokens belong to at
    most SEGMENT_ROWS rows (the inside of a prefill chunk, or the edges between packed
    chunks) goes row by row, gathering each row's pages once for all its tokens; a block of
    more rows (decode tokens) gathers each token's pages. So neither the page-table width W
    nor the longest row is a cost, and neither needs to be a shape.
    ``max_q_len`` is accepted for the kernels' signature and unused. With ``layer``,
    ``kv_pages`` is the whole pool [L, K, P, S, 2D] and pages are gathered from that layer
    directly (slicing the layer out first would copy it).
    """
    del max_q_len
    t, h, d = q.shape
    kv_pages, kv_scales, layer = _with_layer(kv_pages, kv_scales, layer)
    _, k, _, s, d2 = kv_pages.shape
    heads = jnp.arange(k)
    b, w = page_table.shape
    if d2 != 2 * d:
        raise ValueError(f"kv_pages last dim ({d2}) must be 2 * q head_dim ({2 * d})")
    if h % k:
        raise ValueError(f"q heads ({h}) must be a multiple of kv heads ({k})")
    g = h // k
    bq = min(block_q, t)
    nb = -(-t // bq)
    pc = min(max(1, block_kv // s), w)  # pages per key chunk
    lc = pc * s
    table = jnp.pad(page_table, ((0, 0), (0, -(-w // pc) * pc - w)))

    starts = cu_q_lens[:-1]
    q_lens = cu_q_lens[1:] - starts
    tok = jnp.arange(nb * bq)
    row_t = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, b - 1)
    valid_t = (tok >= cu_q_lens[0]) & (tok < cu_q_lens[num_seqs]) & (tok < t)
    pos_t = kv_lens[row_t] - q_lens[row_t] + tok - starts[row_t]
    hi_t = jnp.where(valid_t, pos_t + 1, 0)  # token t sees keys [lo_t, hi_t)
    lo_t = jnp.zeros_like(hi_t) if sliding_window is None else \
        jnp.maximum(hi_t - sliding_window, 0)
    len_t = jnp.where(valid_t, kv_lens[row_t], 0)  # keys at or past it may be stale (NaN)
    q_b = jnp.pad(q, ((0, nb * bq - t), (0, 0), (0, 0))).reshape(nb, bq, k, g, d)
    q_b = q_b.astype(jnp.float32)

    big = jnp.iinfo(jnp.int32).max

    def block(i, out):
        qb = q_b[i]
        rows, valid = row_t.reshape(nb, bq)[i], valid_t.reshape(nb, bq)[i]
        hi, lo, ln = hi_t.reshape(nb, bq)[i], lo_t.reshape(nb, bq)[i], len_t.reshape(nb, bq)[i]
        # Valid tokens are contiguous and sorted by row: number the rows they belong to.
        starts_row = valid & jnp.concatenate([jnp.ones(1, bool),
                                              (rows[1:] != rows[:-1]) | ~valid[:-1]])
        seg = jnp.cumsum(starts_row) - 1  # the segment (row) of each token
        n_seg = jnp.sum(starts_row)

        def update(carry, x, vv, mask, per_tok):
            """Online-softmax step over one key chunk: logits x [bq, K, G, lc]; values [bq, K,
            lc, D] per token, or [K, lc, D] shared by the block's tokens."""
            m, l_sum, acc = carry  # [bq, K, G], [bq, K, G], [bq, K, G, D]
            if soft_cap is not None:
                x = soft_cap * jnp.tanh(x / soft_cap)
            x = jnp.where(mask[:, None, None], x, _MASKED)
            m_new = jnp.maximum(m, x.max(axis=-1))
            p = jnp.where(mask[:, None, None], jnp.exp(x - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = (jnp.einsum("tkgl,tkld->tkgd", p, vv) if per_tok
                  else jnp.einsum("tkgl,kld->tkgd", p, vv))
            return m_new, l_sum * alpha + p.sum(-1), acc * alpha[..., None] + pv

        def by_rows(carry):
            """Row by row (a prefill chunk, or a few rows' edges): each row's pages are
            gathered once for all of its tokens in the block; other tokens are masked."""
            def segment(j, carry):
                mine = valid & (seg == j)
                r = rows[jnp.argmax(mine)]
                first = jnp.min(jnp.where(mine, lo, big)) // lc
                last = -(-jnp.max(jnp.where(mine, hi, 0)) // lc)

                def chunk(c, carry):
                    kpos = c * lc + jnp.arange(lc)
                    mask = (kpos[None] < hi[:, None]) & (kpos[None] >= lo[:, None]) \
                        & mine[:, None]
                    pages = jax.lax.dynamic_slice_in_dim(table[r], c * pc, pc)
                    kv = kv_pages[layer, heads[:, None], pages[None]].reshape(k, lc, d2)
                    sc = None if kv_scales is None else \
                        kv_scales[layer, heads[:, None], pages[None]].reshape(k, lc)
                    kk, vv = _keys_values(kv, sc, d)
                    vv = jnp.where((kpos < kv_lens[r])[None, :, None], vv, 0)  # stale: NaN
                    x = jnp.einsum("tkgd,kld->tkgl", qb, kk) * sm_scale
                    return update(carry, x, vv, mask, False)

                return jax.lax.fori_loop(first, jnp.maximum(last, first), chunk, carry)

            return jax.lax.fori_loop(0, n_seg, segment, carry)

        def by_tokens(carry):
            """Token by token (a block of many decode rows): each token gathers its own
            row's pages."""
            first = jnp.min(jnp.where(valid, lo, big)) // lc
            last = -(-jnp.max(hi) // lc)

            def chunk(c, carry):
                kpos = c * lc + jnp.arange(lc)
                mask = (kpos[None] < hi[:, None]) & (kpos[None] >= lo[:, None])  # [bq, lc]
                pages = table[rows][:, c * pc + jnp.arange(pc)]  # [bq, pc]
                kv = kv_pages[layer, heads[:, None, None], pages[None]]  # [K, bq, pc, S, 2D]
                kv = kv.reshape(k, bq, lc, d2).transpose(1, 0, 2, 3)
                sc = None if kv_scales is None else kv_scales[
                    layer, heads[:, None, None], pages[None]].reshape(k, bq, lc).transpose(1, 0, 2)
                kk, vv = _keys_values(kv, sc, d)
                vv = jnp.where((kpos[None] < ln[:, None])[:, None, :, None], vv, 0)
                x = jnp.einsum("tkgd,tkld->tkgl", qb, kk) * sm_scale
                return update(carry, x, vv, mask, True)

            return jax.lax.fori_loop(first, jnp.maximum(last, first), chunk, carry)

        init = (jnp.full((bq, k, g), _MASKED, jnp.float32), jnp.zeros((bq, k, g), jnp.float32),
                jnp.zeros((bq, k, g, d), jnp.float32))
        _, l_sum, acc = jax.lax.cond(n_seg <= SEGMENT_ROWS, by_rows, by_tokens, init)
        res = acc / jnp.maximum(l_sum, 1e-30)[..., None]
        res = jnp.where(valid[:, None, None, None], res, 0.0)
        return out.at[i].set(res.reshape(bq, h, d))

    n_blocks = -(-cu_q_lens[num_seqs] // bq)
    out = jax.lax.fori_loop(0, n_blocks, block, jnp.zeros((nb, bq, h, d), jnp.float32))
    return out.reshape(nb * bq, h, d)[:t].astype(q.dtype)


def paged_decode_attention_reference(
    q,  # [B, H, D]  one new token per sequence
    kv_pages,  # [K, P, S, 2D], or [L, K, P, S, 2D] with ``layer``
    page_table,  # i32[B, W]
    lengths,  # i32[B]  cached tokens including the new one; 0 marks a padding row
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,
    kv_scales=None,  # i32[K, P / G, G * S] (or [L, ...]): scales of quantized pages (quant.py)
    block_kv: int = DECODE_BLOCK_KV,
):
    """Decode attention (one query per sequence, at position length - 1): the ragged
    reference with q_len = 1, as one loop over key chunks up to the longest row."""
    b, h, d = q.shape
    kv_pages, kv_scales, layer = _with_layer(kv_pages, kv_scales, layer)
    _, k, _, s, d2 = kv_pages.shape
    if d2 != 2 * d:
        raise ValueError(f"kv_pages last dim ({d2}) must be 2 * q head_dim ({2 * d})")
    if h % k:
        raise ValueError(f"q heads ({h}) must be a multiple of kv heads ({k})")
    g, w = h // k, page_table.shape[1]
    pc = min(max(1, block_kv // s), w)
    lc = pc * s
    table = jnp.pad(page_table, ((0, 0), (0, -(-w // pc) * pc - w)))
    heads = jnp.arange(k)
    qf = q.reshape(b, k, g, d).astype(jnp.float32)
    hi = lengths  # a row sees keys [lo, hi)
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(hi - sliding_window, 0)
    first = jnp.min(jnp.where(hi > 0, lo, jnp.iinfo(jnp.int32).max)) // lc
    last = -(-jnp.max(hi) // lc)

    def chunk(c, carry):
        m, l_sum, acc = carry  # [B, K, G], [B, K, G], [B, K, G, D]
        pages = jax.lax.dynamic_slice_in_dim(table, c * pc, pc, axis=1)  # [B, pc]
        kv = kv_pages[layer, heads[:, None, None], pages[None]].reshape(k, b, lc, d2)
        sc = None if kv_scales is None else \
            kv_scales[layer, heads[:, None, None], pages[None]].reshape(k, b, lc)
        kk, vv = _keys_values(kv, sc, d)
        kpos = c * lc + jnp.arange(lc)
        mask = (kpos[None] < hi[:, None]) & (kpos[None] >= lo[:, None])  # [B, lc]
        x = jnp.einsum("bkgd,kbld->bkgl", qf, kk) * sm_scale
        if soft_cap is not None:
            x = soft_cap * jnp.tanh(x / soft_cap)
        x = jnp.where(mask[:, None, None], x, _MASKED)
        vv = jnp.where(mask[None, :, :, None], vv, 0)
        m_new = jnp.maximum(m, x.max(axis=-1))
        p = jnp.where(mask[:, None, None], jnp.exp(x - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgl,kbld->bkgd", p, vv)
        return m_new, l_sum * alpha + p.sum(-1), acc * alpha[..., None] + pv

    init = (jnp.full((b, k, g), _MASKED, jnp.float32), jnp.zeros((b, k, g), jnp.float32),
            jnp.zeros((b, k, g, d), jnp.float32))
    _, l_sum, acc = jax.lax.fori_loop(first, jnp.maximum(last, first), chunk, init)
    out = acc / jnp.maximum(l_sum, 1e-30)[..., None]
    return jnp.where((hi > 0)[:, None, None], out.reshape(b, h, d), 0.0).astype(q.dtype)


def dense_causal_attention(q_bthd, k_btkd, v_btkd, *, sm_scale: float, soft_cap=None,
                           sliding_window=None, lengths_b=None):
    """Plain causal attention over contiguous [B, T] sequences (training and no-cache paths)."""
    b, t, h, d = q_bthd.shape
    k = k_btkd.shape[2]
    g = h // k
    q_btkgd = q_bthd.reshape(b, t, k, g, d).astype(jnp.float32)
    logits = jnp.einsum("bqkgd,blkd->bkgql", q_btkgd, k_btkd.astype(jnp.float32)) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    mask = jnp.broadcast_to(mask, (b, t, t))
    if lengths_b is not None:
        mask &= pos[None, None, :] < lengths_b[:, None, None]
    logits = jnp.where(mask[:, None, None], logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgql,blkd->bqkgd", probs, v_btkd.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q_bthd.dtype)
