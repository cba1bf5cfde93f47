"""TPU ragged paged attention, run on CPU by the Pallas TPU interpreter, against the reference.

Every kernel call runs under ``pltpu.force_tpu_interpret_mode`` with the interpreter's race
detector on. ``RACES`` executes DMAs eagerly at ``start`` with wide vector clocks: in that mode a
missing wait or a prefetch into the buffer being read is reported as a race (checked by
mutating the kernel by hand while writing these tests). ``TWO_CORES`` executes DMAs lazily at
``wait`` (a read before its wait then sees NaN, the interpreter's fill for uninitialised VMEM)
and splits the parallel grid over two simulated megacore cores in a shuffled order.

Axes: T tokens, B page-table rows, H q heads, K kv heads, G = H // K, D head_dim, P pages,
S page_size, W pages per row, L layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# The race detector's verdict lives only in this module-level object (it is what the
# InterpretParams.detect_races docstring points to); jax exposes no public accessor for it.
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter_state
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import quant, reference
from pallas_kernels.tpu_ragged_paged_attention import (
    paged_decode_attention_tpu,
    ragged_paged_attention_tpu,
    scale_rows_shape,
    tpu_scale_rows,
)

RACES = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager", vector_clock_size=64)
TWO_CORES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, random_seed=7)
# Jitted: op-by-op the reference spends seconds compiling dozens of tiny XLA programs per shape.
_STATIC = ("sm_scale", "soft_cap", "sliding_window", "layer")
ragged_paged_attention_reference = jax.jit(reference.ragged_paged_attention_reference,
                                           static_argnames=_STATIC)
paged_decode_attention_reference = jax.jit(reference.paged_decode_attention_reference,
                                           static_argnames=_STATIC)
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def run_interpreted(fn, *args, params=RACES, **kwargs):
    """Runs fn with TPU kernels interpreted on CPU; fails if the last kernel run had a race."""
    with pltpu.force_tpu_interpret_mode(params):
        out = jax.block_until_ready(fn(*args, **kwargs))
    assert interpreter_state.races is not None, "no TPU kernel was interpreted"
    raced = interpreter_state.races.races_found  # its report is printed to stdout
    assert not raced, "the TPU interpreter detected a data race"
    return out


@dataclasses.dataclass
class Batch:
    q: jax.Array  # [T, H, D]
    kv_pages: jax.Array  # [K, P, S, 2D] or [L, K, P, S, 2D]
    page_table: jax.Array  # i32[B, W]
    kv_lens: jax.Array  # i32[B]
    cu_q_lens: jax.Array  # i32[B + 1]
    num_seqs: jax.Array  # i32[]
    num_real: int  # tokens before the padding tail

    @property
    def args(self):
        return (self.q, self.kv_pages, self.page_table, self.kv_lens, self.cu_q_lens,
                self.num_seqs)


def make_batch(seed, seqs, *, page_size, kv_heads, group, head_dim, dtype=jnp.float32,
               num_rows=None, num_tokens=None, pages_per_row=None, layers=None) -> Batch:
    """seqs: (q_len, kv_len) per sequence; rows past them are padding, tokens past them too.

    Physical pages are a random permutation (a few owned by nobody); padding rows get a nonzero
    kv_len so that ignoring them is actually tested.
    """
    rng = np.random.default_rng(seed)
    q_lens = np.array([s[0] for s in seqs], np.int32)
    kv = np.array([s[1] for s in seqs], np.int32)
    b = num_rows or len(seqs) + 1
    w = pages_per_row or max(1, -(-int(kv.max(initial=1)) // page_size))
    num_pages = b * w + 3
    t = num_tokens or int(q_lens.sum()) + 3
    pad = b - len(seqs)
    kv_lens = np.concatenate([kv, np.full(pad, page_size + 1, np.int32)])
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad, q_lens.sum())]).astype(np.int32)
    pages_shape = (kv_heads, num_pages, page_size, 2 * head_dim)
    if layers is not None:
        pages_shape = (layers,) + pages_shape
    return Batch(
        q=jnp.asarray(rng.standard_normal((t, kv_heads * group, head_dim)), dtype),
        kv_pages=jnp.asarray(rng.standard_normal(pages_shape), dtype),
        page_table=jnp.asarray(rng.permutation(num_pages)[: b * w].reshape(b, w), jnp.int32),
        kv_lens=jnp.asarray(kv_lens), cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.int32(len(seqs)), num_real=int(q_lens.sum()))


def mixed_seqs(s):
    """Decode of 1 token, of exactly one page, of a page + 1 and a long one; a prefill chunk
    with no cached prefix and one continuing a cached prefix across page boundaries."""
    return [(1, 1), (1, s), (1, s + 1), (6, 6), (5, 2 * s + 5), (1, 3 * s + 5)]


def assert_matches(out, want, batch: Batch, dtype):
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, **TOL[dtype])
    np.testing.assert_array_equal(out[batch.num_real:], 0.0)  # padding tokens: zeros


@pytest.mark.parametrize("page_size,head_dim,kv_heads,group,knobs", [
    (8, 64, 2, 4, dict(num_q_per_block=4, pages_per_block=2)),
    (16, 128, 2, 1, dict(num_q_per_block=8, pages_per_block=2)),
    (32, 64, 1, 8, dict(num_q_per_block=2, pages_per_block=1)),
    (64, 128, 1, 4, {}),  # default block sizes: one q block, one kv block per sequence
])
def test_mixed_batch_matches_reference(page_size, head_dim, kv_heads, group, knobs):
    batch = make_batch(page_size, mixed_seqs(page_size), page_size=page_size, kv_heads=kv_heads,
                       group=group, head_dim=head_dim)
    scale = head_dim ** -0.5
    out = run_interpreted(ragged_paged_attention_tpu, *batch.args, sm_scale=scale, **knobs)
    want = ragged_paged_attention_reference(*batch.args, sm_scale=scale)
    assert_matches(out, want, batch, jnp.float32)


def test_bf16_matches_reference_on_two_cores():
    batch = make_batch(1, mixed_seqs(16), page_size=16, kv_heads=2, group=4, head_dim=64,
                       dtype=jnp.bfloat16)
    out = run_interpreted(ragged_paged_attention_tpu, *batch.args, sm_scale=0.125,
                          num_q_per_block=4, pages_per_block=2, params=TWO_CORES)
    assert out.dtype == jnp.bfloat16
    want = ragged_paged_attention_reference(*batch.args, sm_scale=0.125)
    assert_matches(out, want, batch, jnp.bfloat16)


@pytest.mark.parametrize("page_size,soft_cap,sliding_window", [
    (8, None, 5),  # window shorter than a page: whole pages before it are never fetched
    (16, 2.0, 19),
])
def test_soft_cap_and_sliding_window(page_size, soft_cap, sliding_window):
    """Page-table entries of pages wholly before every window of their sequence point out of
    range (clamped into the pool by the kernel; their keys are outside every window)."""
    batch = make_batch(2, mixed_seqs(page_size), page_size=page_size, kv_heads=1, group=4,
                       head_dim=64)
    pt = np.asarray(batch.page_table).copy()
    q_lens = np.diff(np.asarray(batch.cu_q_lens))
    first_key = np.asarray(batch.kv_lens) - q_lens - sliding_window + 1  # of the first query
    skipped = (np.arange(pt.shape[1]) + 1) * page_size <= first_key[:, None]
    assert skipped[: int(batch.num_seqs)].any()
    pt[skipped] = 10_000
    args = (*batch.args[:2], jnp.asarray(pt), *batch.args[3:])
    kw = dict(sm_scale=0.5, soft_cap=soft_cap, sliding_window=sliding_window)
    out = run_interpreted(ragged_paged_attention_tpu, *args, num_q_per_block=4,
                          pages_per_block=2, **kw)
    assert_matches(out, ragged_paged_attention_reference(*batch.args, **kw), batch, jnp.float32)


def test_garbage_outside_owned_keys_never_leaks():
    """NaN in pages nobody owns, past kv_len and in padding rows' pages; page-table entries
    past a sequence's pages point far out of range (clamped: the last page, which is NaN);
    the first sequence starts at token 2, so tokens 0 and 1 belong to nobody."""
    s = 8
    batch = make_batch(3, mixed_seqs(s), page_size=s, kv_heads=1, group=2, head_dim=64)
    pt = np.asarray(batch.page_table).copy()
    kv = np.asarray(batch.kv_lens)
    owned = np.zeros(batch.kv_pages.shape[1], bool)
    poisoned = np.asarray(batch.kv_pages).copy()
    for row in range(pt.shape[0]):
        n_keys = int(kv[row]) if row < int(batch.num_seqs) else 0
        for col in range(pt.shape[1]):
            if col * s >= n_keys:
                pt[row, col] = 10_000 + row
                continue
            owned[pt[row, col]] = True
            poisoned[:, pt[row, col], max(0, n_keys - col * s):] = np.nan
    poisoned[:, ~owned] = np.nan
    assert not owned[-1]  # so a clamped id reads a NaN page
    args = (batch.q, jnp.asarray(poisoned), jnp.asarray(pt), batch.kv_lens,
            batch.cu_q_lens + 2, batch.num_seqs)
    out = run_interpreted(ragged_paged_attention_tpu, *args, sm_scale=0.125,
                          num_q_per_block=4, pages_per_block=2)
    want = ragged_paged_attention_reference(*args, sm_scale=0.125)
    assert_matches(out, want, dataclasses.replace(batch, num_real=batch.num_real + 2),
                   jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[:2]), 0.0)


def test_bad_page_ids_and_layer_are_clamped_never_out_of_bounds():
    """Ids far outside the pool inside a live sequence's range, and a traced layer past the
    last: without the kernel's clamps these DMAs leave the array, which the interpreter
    reports as an error. Clamped, the call completes (the values are garbage in, finite out)."""
    batch = make_batch(6, mixed_seqs(8), page_size=8, kv_heads=1, group=2, head_dim=64,
                       layers=2)
    pt = np.asarray(batch.page_table).copy()
    pt[:, 0] = [10**6, -7, 2**30, 5, 10**6, -1, 3][: pt.shape[0]]
    q, kv5, _, *rest = batch.args

    @jax.jit
    def run(layer):
        return ragged_paged_attention_tpu(q, kv5, jnp.asarray(pt), *rest, layer=layer,
                                          sm_scale=0.125, num_q_per_block=4, pages_per_block=2)

    out = run_interpreted(run, jnp.int32(7))
    assert np.isfinite(np.asarray(out)).all()
    # A clamped layer reads the last layer: the same result as asking for it.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(run_interpreted(run, jnp.int32(1))))


@pytest.mark.parametrize("width", [384, 600])
def test_wide_page_table_windows(width):
    """Tables wider than one 256-column SMEM window, taller than 8 rows: the window of a kv
    block starts at column 128 or 256 (384: clamped to the last window; 600: padded to 640)
    and at row 8. A sliding window makes the long rows visit only their last few pages."""
    seqs = [(1, 40)] * 8 + [(1, 2500), (2, 3000)]  # rows 8 and 9: ~375 pages each
    batch = make_batch(11, seqs, page_size=8, kv_heads=1, group=2, head_dim=64, num_rows=12,
                       pages_per_row=width)
    kw = dict(sm_scale=0.125, sliding_window=16)
    out = run_interpreted(ragged_paged_attention_tpu, *batch.args, num_q_per_block=4,
                          pages_per_block=4, **kw)
    assert_matches(out, ragged_paged_attention_reference(*batch.args, **kw), batch, jnp.float32)


def test_layer_axis_matches_4d_slice_inside_scan(capfd):
    batch = make_batch(4, mixed_seqs(8), page_size=8, kv_heads=2, group=2, head_dim=64,
                       layers=2)
    q, kv5, *rest = batch.args
    knobs = dict(sm_scale=0.125, num_q_per_block=4, pages_per_block=2)

    def all_layers(kv5):  # the way jaxkv calls it: a traced layer, the pool never sliced
        def step(carry, layer):
            return carry, ragged_paged_attention_tpu(q, kv5, *rest, layer=layer, **knobs)

        return jax.lax.scan(step, 0, jnp.arange(2, dtype=jnp.int32))[1]

    scanned = run_interpreted(jax.jit(all_layers), kv5)
    for layer in range(2):
        sliced = run_interpreted(ragged_paged_attention_tpu, q, kv5[layer], *rest, **knobs)
        np.testing.assert_array_equal(np.asarray(scanned[layer]), np.asarray(sliced))
    # run_interpreted sees only the last kernel run's verdict; every run prints its races.
    assert "RACE DETECTED" not in capfd.readouterr().out


def test_decode_wrapper_matches_reference_decode():
    """Also the other form of `layer`: a Python int selecting from 5-D pages."""
    s, b = 8, 6
    batch = make_batch(5, [(1, n) for n in (1, s, s + 1, 3 * s + 2, 5)], page_size=s,
                       kv_heads=2, group=4, head_dim=64, num_rows=b, layers=2)
    lengths = batch.kv_lens.at[b - 1].set(0)  # a padding row: length 0 -> zeros
    q, kv5 = batch.q[:b], batch.kv_pages
    out = run_interpreted(paged_decode_attention_tpu, q, kv5, batch.page_table, lengths,
                          sm_scale=0.125, soft_cap=3.0, layer=1)
    want = paged_decode_attention_reference(q, kv5[1], batch.page_table, lengths,
                                            sm_scale=0.125, soft_cap=3.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[b - 1]), 0.0)


def quantize_batch(batch: Batch, dtype, *, poison: bool):
    """The batch's f32 pages quantized to ``dtype`` -> (pages, i32 scale words), both with the
    pages' leading axes. ``poison``: every slot no live sequence owns (pages of nobody, of
    padding rows, and past kv_len) gets NaN scale words (``quant.NAN_SCALES``) and, for fp8,
    NaN values: none of it may reach the output."""
    kv = np.asarray(batch.kv_pages, np.float32)
    d = kv.shape[-1] // 2
    flat = kv.reshape(-1, 1, 2 * d)
    pages, scales = quant.quantize_kv(jnp.asarray(flat[..., :d]), jnp.asarray(flat[..., d:]),
                                      dtype)
    pages = np.array(pages).reshape(kv.shape)
    scales = np.array(scales).reshape(kv.shape[:-1])
    if poison:
        s = kv.shape[-2]
        owned = np.zeros(kv.shape[-3:-1], bool)  # [P, S]
        table, lens = np.asarray(batch.page_table), np.asarray(batch.kv_lens)
        for row in range(int(batch.num_seqs)):
            for key in range(int(lens[row])):
                owned[table[row, key // s], key % s] = True
        scales[..., ~owned] = quant.NAN_SCALES
        if jnp.issubdtype(dtype, jnp.floating):
            pages[..., ~owned, :] = np.nan
        # whole pages nobody owns, and owned pages with stale slots past kv_len
        assert (~owned).all(axis=1).any() and (owned.any(axis=1) & ~owned.all(axis=1)).any()
    return jnp.asarray(pages), jnp.asarray(scales)


QUANT_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 q and output; the reference computes in f32


@pytest.mark.parametrize("kv_dtype,head_dim,kv_heads,group,layers,knobs", [
    (jnp.int8, 64, 2, 1, None, dict(num_q_per_block=8, pages_per_block=2)),
    (jnp.int8, 128, 1, 8, 2, dict(num_q_per_block=2, pages_per_block=1)),
    (jnp.float8_e4m3fn, 64, 1, 4, 2, dict(num_q_per_block=4, pages_per_block=3)),
    (jnp.float8_e4m3fn, 128, 2, 2, None, {}),  # default block sizes
])
def test_quantized_pages_match_reference(kv_dtype, head_dim, kv_heads, group, layers, knobs):
    """int8 / fp8 pages of 32 slots dequantized in the kernel, against the reference given
    the same pages and scales (itself checked against the reference on dequantized pages).
    Scale words of unowned slots are NaN; pages_per_block 1 and 3 put a block's pages at every
    offset inside their 128-word scale rows. 5-D cases run on two simulated cores with lazy
    DMAs (a scale read before its wait would see NaN)."""
    s = 32
    batch = make_batch(s + head_dim, mixed_seqs(s), page_size=s, kv_heads=kv_heads, group=group,
                       head_dim=head_dim, layers=layers)
    pages, scales = quantize_batch(batch, kv_dtype, poison=True)
    q = batch.q.astype(jnp.bfloat16)
    rest = batch.args[2:]
    kw = dict(sm_scale=head_dim ** -0.5, layer=None if layers is None else 1)
    out = run_interpreted(ragged_paged_attention_tpu, q, pages, *rest, kv_scales=scales,
                          params=RACES if layers is None else TWO_CORES, **knobs, **kw)
    assert out.dtype == jnp.bfloat16
    want = ragged_paged_attention_reference(q, pages, *rest, kv_scales=scales, **kw)
    assert_matches(out, want, batch, jnp.bfloat16)
    dequantized = ragged_paged_attention_reference(q, quant.dequantize_pages(pages, scales),
                                                   *rest, **kw)
    np.testing.assert_allclose(np.asarray(want, np.float32), np.asarray(dequantized, np.float32),
                               atol=1e-6, rtol=1e-6)
    if not knobs:  # the same words as TPU scale rows: the same kernel run, bit for bit
        rows = tpu_scale_rows(scales)
        assert rows.shape == scale_rows_shape(pages.shape) == (kv_heads, pages.shape[1] // 4
                                                                + 1, 128)
        again = run_interpreted(ragged_paged_attention_tpu, q, pages, *rest, kv_scales=rows,
                                **kw)
        np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize("kv_dtype,head_dim,q_dtype", [
    (jnp.int8, 64, jnp.float32), (jnp.float8_e4m3fn, 128, jnp.bfloat16)])
def test_quantized_decode_matches_reference(kv_dtype, head_dim, q_dtype):
    """Decode over 5-D quantized pages with GQA 4, a sliding window and a padding row; with
    f32 compute the kernel's int8 keys and values enter the MXU as f32."""
    s, b = 32, 5
    batch = make_batch(9, [(1, n) for n in (1, s, s + 1, 3 * s + 2)], page_size=s,
                       kv_heads=2, group=4, head_dim=head_dim, num_rows=b, layers=2)
    lengths = batch.kv_lens.at[b - 1].set(0)
    pages, scales = quantize_batch(dataclasses.replace(batch, kv_lens=lengths), kv_dtype,
                                   poison=True)
    q = batch.q[:b].astype(q_dtype)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=s + 7, layer=0)
    out = run_interpreted(paged_decode_attention_tpu, q, pages, batch.page_table, lengths,
                          kv_scales=scales, **kw)
    assert out.dtype == q_dtype
    want = paged_decode_attention_reference(q, pages, batch.page_table, lengths,
                                            kv_scales=scales, **kw)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               **(QUANT_TOL if q_dtype == jnp.bfloat16 else TOL[q_dtype]))
    np.testing.assert_array_equal(np.asarray(out[b - 1], np.float32), 0.0)
    dequantized = paged_decode_attention_reference(
        q, quant.dequantize_pages(pages, scales), batch.page_table, lengths, **kw)
    np.testing.assert_allclose(np.asarray(want, np.float32), np.asarray(dequantized, np.float32),
                               atol=1e-6, rtol=1e-6)


@st.composite
def ragged_batches(draw, *, rows=4, tokens=12, max_keys=32):
    n = draw(st.integers(1, rows))
    seqs, budget = [], tokens
    for _ in range(n):
        q_len = draw(st.integers(0, min(5, budget)))
        budget -= q_len
        seqs.append((q_len, draw(st.integers(q_len, max_keys))))
    return draw(st.integers(0, 2**16)), seqs


@settings(max_examples=3, deadline=None)
@given(ragged_batches())
def test_random_ragged_batches(seed_and_seqs):
    seed, seqs = seed_and_seqs  # fixed array shapes: one compilation for every example
    batch = make_batch(seed, seqs, page_size=8, kv_heads=1, group=2, head_dim=64, num_rows=4,
                       num_tokens=12, pages_per_row=4)
    out = run_interpreted(ragged_paged_attention_tpu, *batch.args, sm_scale=0.125,
                          num_q_per_block=4, pages_per_block=2)
    want = ragged_paged_attention_reference(*batch.args, sm_scale=0.125)
    assert_matches(out, want, batch, jnp.float32)


def _valid_args():
    f32 = jnp.zeros
    return dict(q=f32((4, 4, 16)), kv_pages=f32((2, 4, 8, 32)),
                page_table=jnp.zeros((2, 2), jnp.int32), kv_lens=jnp.zeros(2, jnp.int32),
                cu_q_lens=jnp.zeros(3, jnp.int32), num_seqs=jnp.int32(1))


@pytest.mark.parametrize("name,change", [
    ("q", dict(q=jnp.zeros((4, 64)))),
    ("q", dict(q=jnp.zeros((4, 3, 16)))),  # 3 heads over 2 kv heads
    ("kv_pages", dict(kv_pages=jnp.zeros((4, 8, 32)))),
    ("kv_pages", dict(kv_pages=jnp.zeros((2, 4, 8, 16)))),  # not 2 * head_dim
    ("kv_pages", dict(kv_pages=jnp.zeros((2, 4, 12, 32)))),
    ("kv_pages", dict(q=jnp.zeros((4, 4, 16), jnp.bfloat16),
                      kv_pages=jnp.zeros((2, 4, 8, 32), jnp.bfloat16))),  # 8 < bf16 tile 16
    ("kv_pages", dict(kv_pages=jnp.zeros((2, 4, 8, 32), jnp.bfloat16))),  # dtype != q's
    ("layer", dict(kv_pages=jnp.zeros((1, 2, 4, 8, 32)))),
    ("layer", dict(layer=0)),
    ("page_table", dict(page_table=jnp.zeros((2, 2)))),
    ("kv_lens", dict(kv_lens=jnp.zeros(3, jnp.int32))),
    ("cu_q_lens", dict(cu_q_lens=jnp.zeros(2, jnp.int32))),
    ("num_seqs", dict(num_seqs=jnp.float32(1))),
    ("soft_cap", dict(soft_cap=-1.0)),
    ("sliding_window", dict(sliding_window=0)),
    ("num_q_per_block", dict(num_q_per_block=1.5)),
    ("pages_per_block", dict(pages_per_block=0)),
    ("pages_per_block", dict(pages_per_block=129)),  # one 256-entry table chunk per block
    ("page_table", dict(page_table=jnp.zeros((70_000, 2), jnp.int32),
                        kv_lens=jnp.zeros(70_000, jnp.int32),
                        cu_q_lens=jnp.zeros(70_001, jnp.int32))),  # SMEM: kv_lens, cu_q_lens
    # Quantized pages (page_size 32: the int8 / fp8 sublane tile).
    ("kv_scales", dict(kv_pages=jnp.zeros((2, 4, 32, 32), jnp.int8))),  # missing
    ("kv_scales", dict(kv_scales=jnp.zeros((2, 4, 8), jnp.int32))),  # f32 pages take none
    ("kv_scales", dict(kv_pages=jnp.zeros((2, 4, 32, 32), jnp.float8_e4m3fn),
                       kv_scales=jnp.zeros((2, 4, 32), jnp.float32))),  # not i32
    ("kv_scales", dict(kv_pages=jnp.zeros((2, 4, 32, 32), jnp.int8),
                       kv_scales=jnp.zeros((2, 4, 16), jnp.int32))),  # not [K, P, S]
    ("kv_scales", dict(kv_pages=jnp.zeros((2, 4, 32, 32), jnp.int8),
                       kv_scales=jnp.zeros((2, 2, 128), jnp.int32))),  # rows: P / 4 = 1
    ("kv_pages", dict(kv_pages=jnp.zeros((2, 4, 16, 32), jnp.int8),
                      kv_scales=jnp.zeros((2, 4, 16), jnp.int32))),  # 16 < int8 tile 32
    ("q", dict(q=jnp.zeros((4, 4, 16), jnp.int8), kv_pages=jnp.zeros((2, 4, 32, 32), jnp.int8),
               kv_scales=jnp.zeros((2, 4, 32), jnp.int32))),  # q: the compute dtype
])
def test_static_validation_names_the_argument(name, change):
    kw = {**_valid_args(), "sm_scale": 1.0, **change}
    with pytest.raises(ValueError, match=rf"^{name}:"):
        ragged_paged_attention_tpu(**kw)


@pytest.mark.parametrize("name,change", [
    ("q", dict(q=jnp.zeros((3, 4, 16)))),
    ("lengths", dict(lengths=jnp.zeros(2, jnp.float32))),
    ("kv_pages", dict(kv_pages=jnp.zeros((4, 8, 32)))),
    ("sliding_window", dict(sliding_window=-3)),
    ("kv_scales", dict(kv_pages=jnp.zeros((2, 4, 32, 32), jnp.int8))),
    ("kv_scales", dict(kv_pages=jnp.zeros((2, 4, 32, 32), jnp.int8),
                       kv_scales=jnp.zeros((1, 2, 4, 32), jnp.int32))),
])
def test_decode_validation_names_the_argument(name, change):
    args = _valid_args()
    kw = dict(q=args["q"][:2], kv_pages=args["kv_pages"], page_table=args["page_table"],
              lengths=args["kv_lens"], sm_scale=1.0)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        paged_decode_attention_tpu(**{**kw, **change})


def test_race_detector_is_live():
    """A kernel that reads a DMA's destination before waiting must be reported, or the
    race assertions above would prove nothing."""
    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    with pltpu.force_tpu_interpret_mode(RACES):  # read when the pallas_call is built
        call = pl.pallas_call(
            racy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())])
        jax.block_until_ready(call(jnp.ones((8, 128), jnp.float32)))
    assert interpreter_state.races.races_found


@pytest.mark.slow
@pytest.mark.parametrize("dtype,page_size", [
    (jnp.float32, 8), (jnp.float32, 16), (jnp.float32, 32), (jnp.float32, 64),
    (jnp.bfloat16, 16), (jnp.bfloat16, 32), (jnp.bfloat16, 64),  # bf16 tile: 16 rows
])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 4, 1), (128, 2, 4), (128, 1, 8)])
def test_sweep(page_size, head_dim, kv_heads, group, dtype):
    seqs = mixed_seqs(page_size) + [(9, 9), (3, 4 * page_size), (2, 2)]
    batch = make_batch(page_size + head_dim, seqs, page_size=page_size, kv_heads=kv_heads,
                       group=group, head_dim=head_dim, dtype=dtype)
    for soft_cap, window in [(None, None), (5.0, page_size + 3)]:
        kw = dict(sm_scale=head_dim ** -0.5, soft_cap=soft_cap, sliding_window=window)
        out = run_interpreted(ragged_paged_attention_tpu, *batch.args, num_q_per_block=8,
                              pages_per_block=2, **kw)
        assert_matches(out, ragged_paged_attention_reference(*batch.args, **kw), batch, dtype)
