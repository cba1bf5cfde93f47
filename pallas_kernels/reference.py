"""Pure-jnp paged attention: the oracle for the kernels and the CPU attention path.

Axes: T query tokens (all sequences, concatenated), B sequences, H query heads, K kv heads,
G = H // K queries per kv head, D head_dim, P pages, S page_size, W pages per sequence row,
Q = max_q_len (new tokens of one sequence), L = W * S key positions per sequence.

Pages hold K and V side by side: ``kv_pages[k, p, s, :D]`` is the key and ``kv_pages[k, p, s,
D:]`` the value of slot s of page p for kv head k (see ``layout.py`` for why).

Semantics (shared by every kernel): sequence b owns queries ``q[cu_q_lens[b]:cu_q_lens[b+1]]``
and has ``kv_lens[b]`` cached tokens *including* those new ones. Its query i sits at position
``kv_lens[b] - q_len + i`` and attends causally to keys ``0..position`` (and, with a sliding
window w, only to the last w of them). Rows ``b >= num_seqs`` are padding; their queries, and any
query past ``cu_q_lens[num_seqs]``, return zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a fully masked row gives zeros, never NaN


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
):
    """Ragged causal attention of new query tokens over paged keys/values -> [T, H, D].

    ``max_q_len`` (static) bounds the new tokens of any one sequence; it sets the padded work
    ``B x max_q_len x W*S``. It defaults to T, always correct but wasteful for decode.
    """
    t, h, d = q.shape
    k, _, s, d2 = kv_pages.shape
    b, w = page_table.shape
    if d2 != 2 * d:
        raise ValueError(f"kv_pages last dim ({d2}) must be 2 * q head_dim ({2 * d})")
    if h % k:
        raise ValueError(f"q heads ({h}) must be a multiple of kv heads ({k})")
    g = h // k
    qmax = t if max_q_len is None else max_q_len

    starts = cu_q_lens[:-1]
    q_lens = cu_q_lens[1:] - starts
    valid_seq = jnp.arange(b) < num_seqs

    # Gather each sequence's queries into a padded [B, Q] grid.
    i_q = jnp.arange(qmax)
    rows_bq = starts[:, None] + i_q[None, :]
    valid_bq = (i_q[None, :] < q_lens[:, None]) & valid_seq[:, None]
    q_bqhd = q[jnp.clip(rows_bq, 0, t - 1)]
    q_bqkgd = q_bqhd.reshape(b, qmax, k, g, d)

    # Gather each sequence's keys/values from its pages: [B, K, L, D].
    kv_bkld = kv_pages[:, page_table].reshape(k, b, w * s, 2 * d).transpose(1, 0, 2, 3)
    k_bkld, v_bkld = kv_bkld[..., :d], kv_bkld[..., d:]

    logits = jnp.einsum(
        "bqkgd,bkld->bkgql", q_bqkgd.astype(jnp.float32), k_bkld.astype(jnp.float32)
    ) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    q_pos_bq = (kv_lens - q_lens)[:, None] + i_q[None, :]
    k_pos_l = jnp.arange(w * s)
    mask_bql = (k_pos_l[None, None, :] <= q_pos_bq[:, :, None]) & (
        k_pos_l[None, None, :] < kv_lens[:, None, None]
    )
    if sliding_window is not None:
        mask_bql &= q_pos_bq[:, :, None] - k_pos_l[None, None, :] < sliding_window
    mask_bql &= valid_bq[:, :, None]
    logits = jnp.where(mask_bql[:, None, None], logits, _MASKED)

    # Keys past a sequence's length may sit in freed pages holding anything, NaN included:
    # zero their values so a masked (zero) probability can never meet a NaN.
    v_bkld = jnp.where((k_pos_l[None, :] < kv_lens[:, None])[:, None, :, None], v_bkld, 0)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(mask_bql[:, None, None], jnp.exp(logits - m), 0.0)
    denom = jnp.maximum(p.sum(axis=-1, keepdims=True), 1e-30)
    out_bkgqd = jnp.einsum("bkgql,bkld->bkgqd", p / denom, v_bkld.astype(jnp.float32))
    out_bqhd = out_bkgqd.transpose(0, 3, 1, 2, 4).reshape(b, qmax, h, d)

    # Scatter back to the flat token layout; tokens past the last real row stay zero.
    seq_t = jnp.clip(jnp.searchsorted(cu_q_lens, jnp.arange(t), side="right") - 1, 0, b - 1)
    i_t = jnp.arange(t) - starts[seq_t]
    valid_t = ((jnp.arange(t) >= cu_q_lens[0]) & (jnp.arange(t) < cu_q_lens[num_seqs])
               & (i_t < qmax))
    out_thd = out_bqhd[seq_t, jnp.clip(i_t, 0, qmax - 1)]
    return jnp.where(valid_t[:, None, None], out_thd, 0).astype(q.dtype)


def paged_decode_attention_reference(
    q,  # [B, H, D]  one new token per sequence
    kv_pages,  # [K, P, S, 2D]
    page_table,  # i32[B, W]
    lengths,  # i32[B]  cached tokens including the new one
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
):
    """Decode attention (one query per sequence): the ragged reference with q_len = 1."""
    b = q.shape[0]
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32)
    # A padding row has length 0: its query position is -1, so every key is masked -> zeros.
    return ragged_paged_attention_reference(
        q, kv_pages, page_table, lengths, cu_q_lens, jnp.int32(b),
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, max_q_len=1,
    )


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
