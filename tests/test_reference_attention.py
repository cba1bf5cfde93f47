"""The ragged paged reference against a per-query numpy loop over a dense rebuild."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.layout import pack_kv
from pallas_kernels.reference import (
    dense_causal_attention,
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)


def _naive(q, k_dense, v_dense, kv_lens, q_lens, *, sm_scale, soft_cap=None, window=None):
    """Loop over sequences and queries on contiguous K/V ([B][K, L, D])."""
    h = q.shape[1]
    out = np.zeros_like(q)
    at = 0
    for b, (kv, ql) in enumerate(zip(kv_lens, q_lens, strict=True)):
        kk, vv = k_dense[b], v_dense[b]
        g = h // kk.shape[0]
        for i in range(ql):
            pos = kv - ql + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for head in range(h):
                s = (kk[head // g, lo:pos + 1] @ q[at + i, head]) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[at + i, head] = (p / p.sum()) @ vv[head // g, lo:pos + 1]
        at += ql
    return out


def _case(rng, *, kv_lens, q_lens, heads=4, kv_heads=2, d=8, page_size=4, extra_pages=3,
          pad_rows=1, pad_tokens=3):
    b = len(kv_lens)
    pages_needed = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_needed) + extra_pages
    perm = rng.permutation(num_pages)  # scattered, out-of-order pages
    width = max(pages_needed)
    table = np.zeros((b + pad_rows, width), np.int32)
    k_pages = rng.standard_normal((kv_heads, num_pages, page_size, d)).astype(np.float32)
    v_pages = rng.standard_normal((kv_heads, num_pages, page_size, d)).astype(np.float32)
    k_dense, v_dense, at = [], [], 0
    for i, n in enumerate(pages_needed):
        table[i, :n] = perm[at:at + n]
        at += n
        k_dense.append(k_pages[:, table[i, :n]].reshape(kv_heads, -1, d)[:, : kv_lens[i]])
        v_dense.append(v_pages[:, table[i, :n]].reshape(kv_heads, -1, d)[:, : kv_lens[i]])
    t = sum(q_lens)
    q = rng.standard_normal((t + pad_tokens, heads, d)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens), [t] * pad_rows]).astype(np.int32)
    lens = np.array(list(kv_lens) + [0] * pad_rows, np.int32)
    return q, k_pages, v_pages, table, lens, cu, np.int32(b), k_dense, v_dense


def _arrays(q, k_pages, v_pages, *rest):
    """Device arrays for the reference: q, packed K|V pages, then the rest unchanged."""
    return (jnp.asarray(q), pack_kv(jnp.asarray(k_pages), jnp.asarray(v_pages)),
            *map(jnp.asarray, rest))


@pytest.mark.parametrize("soft_cap, window", [(None, None), (5.0, None), (None, 3)])
def test_ragged_matches_naive(soft_cap, window):
    rng = np.random.default_rng(0)
    kv_lens, q_lens = [1, 4, 5, 11, 9], [1, 4, 2, 1, 9]  # a page, a page + 1, chunks, decode
    q, kp, vp, table, lens, cu, n, kd, vd = _case(rng, kv_lens=kv_lens, q_lens=q_lens)
    got = ragged_paged_attention_reference(
        *_arrays(q, kp, vp, table, lens, cu, n), sm_scale=0.3, soft_cap=soft_cap,
        sliding_window=window, max_q_len=16)
    want = _naive(q, kd, vd, kv_lens, q_lens, sm_scale=0.3, soft_cap=soft_cap, window=window)
    t = sum(q_lens)
    np.testing.assert_allclose(np.asarray(got)[:t], want[:t], atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(got)[t:] == 0)  # padding tokens: finite zeros


@pytest.mark.parametrize("window", [None, 5])
def test_ragged_blocks_chunks_idle_rows_and_a_leading_gap(window):
    """Small query blocks and key chunks (so both loops run many times, and blocks are both
    one-row and mixed), idle rows (no new tokens) between real ones, and queries that start
    after a gap (cu_q_lens[0] > 0): every real query matches the per-query loop."""
    rng = np.random.default_rng(1)
    kv_lens, q_lens = [13, 6, 20, 3, 1], [13, 0, 9, 0, 1]
    q, kp, vp, table, lens, cu, n, kd, vd = _case(rng, kv_lens=kv_lens, q_lens=q_lens,
                                                  pad_tokens=0)
    gap = 3
    q_gap = np.concatenate([rng.standard_normal((gap, *q.shape[1:])).astype(np.float32), q])
    got = ragged_paged_attention_reference(
        *_arrays(q_gap, kp, vp, table, lens, cu + gap, n), sm_scale=0.3,
        sliding_window=window, block_q=4, block_kv=8)
    want = _naive(q, kd, vd, kv_lens, q_lens, sm_scale=0.3, window=window)
    np.testing.assert_allclose(np.asarray(got)[gap:], want, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(got)[:gap] == 0)


def test_decode_matches_ragged():
    rng = np.random.default_rng(1)
    kv_lens = [3, 8, 13]
    q, kp, vp, table, lens, cu, n, kd, vd = _case(rng, kv_lens=kv_lens, q_lens=[1, 1, 1],
                                                  pad_tokens=1)
    q_, kv, table_, lens_ = _arrays(q, kp, vp, table, lens)
    got = paged_decode_attention_reference(q_, kv, table_, lens_, sm_scale=0.5)
    want = _naive(q, kd, vd, kv_lens, [1, 1, 1], sm_scale=0.5)
    np.testing.assert_allclose(np.asarray(got)[:3], want[:3], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[3], np.zeros_like(q[3]))  # length-0 row


def test_dense_matches_paged_prefill():
    rng = np.random.default_rng(2)
    b, t, h, k, d = 2, 7, 4, 1, 8
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    kk = rng.standard_normal((b, t, k, d)).astype(np.float32)
    vv = rng.standard_normal((b, t, k, d)).astype(np.float32)
    got = dense_causal_attention(jnp.asarray(q), jnp.asarray(kk), jnp.asarray(vv), sm_scale=0.4)
    want = _naive(q.reshape(b * t, h, d), kk.transpose(0, 2, 1, 3), vv.transpose(0, 2, 1, 3),
                  [t, t], [t, t], sm_scale=0.4)
    np.testing.assert_allclose(np.asarray(got).reshape(b * t, h, d), want, atol=1e-5, rtol=1e-5)


@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_random_ragged_batches(data):
    nseq = data.draw(st.integers(1, 4))
    kv_lens, q_lens = [], []
    for _ in range(nseq):
        kv = data.draw(st.integers(1, 20))
        kv_lens.append(kv)
        q_lens.append(data.draw(st.integers(1, kv)))
    group = data.draw(st.sampled_from([1, 2, 4]))
    page_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    q, kp, vp, table, lens, cu, n, kd, vd = _case(
        rng, kv_lens=kv_lens, q_lens=q_lens, heads=2 * group, kv_heads=2, page_size=page_size)
    got = ragged_paged_attention_reference(
        *_arrays(q, kp, vp, table, lens, cu, n), sm_scale=0.25, max_q_len=max(q_lens))
    want = _naive(q, kd, vd, kv_lens, q_lens, sm_scale=0.25)
    t = sum(q_lens)
    np.testing.assert_allclose(np.asarray(got)[:t], want[:t], atol=1e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_nan_in_freed_pages_is_never_read():
    rng = np.random.default_rng(3)
    kv_lens, q_lens = [5, 2], [2, 1]
    q, kp, vp, table, lens, cu, n, kd, vd = _case(rng, kv_lens=kv_lens, q_lens=q_lens)
    clean = ragged_paged_attention_reference(
        *_arrays(q, kp, vp, table, lens, cu, n), sm_scale=0.3)
    used = {int(p) for b, kv in enumerate(kv_lens) for p in table[b, : -(-kv // 4)]}
    for page in range(kp.shape[1]):
        if page not in used:  # a freed page, possibly still named by a stale table slot
            kp[:, page], vp[:, page] = np.nan, np.nan
    kp[:, table[0, 1], 1:], vp[:, table[0, 1], 1:] = np.nan, np.nan  # past seq 0's length
    table[1, 1] = [p for p in range(kp.shape[1]) if p not in used][0]  # stale slot -> freed
    dirty = ragged_paged_attention_reference(
        *_arrays(q, kp, vp, table, lens, cu, n), sm_scale=0.3)
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
