"""GPU paged-attention kernels (Pallas/Triton) in interpret mode on CPU, against the references.

Every case scatters pages through a permuted page table, leaves stale ids in unused slots and
mixes sequence shapes (1 token, exactly one page, a page + 1, several pages) in one batch, so a
handful of compiled shapes covers many cases. Tests reuse shapes so that jit caches hit.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import quant
from pallas_kernels.gpu_paged_attention import (
    paged_decode_attention_gpu,
    ragged_paged_attention_gpu,
)
from pallas_kernels.layout import split_kv
from pallas_kernels.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SCALE = 0.3
# On a GPU (scripts/device_check.sh) the same tests run the compiled kernels, with
# JAX_DEFAULT_MATMUL_PRECISION=highest so that f32 means exact f32 on both sides.
INTERPRET = os.environ.get("JAXKV_KERNELS_ON_DEVICE") != "1"
decode = functools.partial(paged_decode_attention_gpu, sm_scale=SCALE, interpret=INTERPRET)
ragged = functools.partial(ragged_paged_attention_gpu, sm_scale=SCALE, interpret=INTERPRET)
decode_ref = jax.jit(paged_decode_attention_reference,
                     static_argnames=("sm_scale", "soft_cap", "sliding_window"))
ragged_ref = jax.jit(ragged_paged_attention_reference,
                     static_argnames=("sm_scale", "soft_cap", "sliding_window", "max_q_len"))

# (page_size, kv_heads, group, head_dim): every page size, GQA 1/4/8 and a non-power-of-two
# group, head_dim 64 and 128; group <= 4 takes the broadcast path in decode, 8 the tl.dot path.
CONFIGS = [(8, 2, 1, 64), (16, 1, 4, 128), (32, 1, 8, 32), (64, 2, 3, 16)]


def _pool(rng, kv_lens, *, page_size, kv_heads, head_dim, width, dtype=jnp.float32, layers=0):
    """Random packed K|V pages and a scattered page table; unused slots hold stale or
    out-of-range ids."""
    needed = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(needed) + 3
    perm = rng.permutation(num_pages)
    table = rng.choice([0, 5, num_pages - 1, 10**6], size=(len(kv_lens), width)).astype(np.int32)
    at = 0
    for row, n in enumerate(needed):
        table[row, :n] = perm[at:at + n]
        at += n
    shape = (*((layers,) if layers else ()), kv_heads, num_pages, page_size, 2 * head_dim)
    return jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(table)


def _decode_case(rng, cfg, dtype=jnp.float32, layers=0):
    s, kh, g, d = cfg
    lens = [0, 1, s, s + 1, 3 * s + 5, 2]  # row 0 is padding
    kv, table = _pool(rng, lens, page_size=s, kv_heads=kh, head_dim=d, width=4, dtype=dtype,
                      layers=layers)
    q = jnp.asarray(rng.standard_normal((len(lens), kh * g, d)), dtype)
    return q, kv, table, jnp.asarray(lens, jnp.int32)


def _ragged_case(rng, cfg, dtype=jnp.float32, layers=0):
    """Chunks with and without cached prefix, a decode token, one page, a page + 1, an empty
    row, then 2 padding rows and 3 padding tokens."""
    s, kh, g, d = cfg
    q_lens = [7, 1, s, s + 1, 0, 3, 20]
    prefix = [0, 4, 0, 0, 2, s + 2, 2 * s + 3]
    kv_lens = [a + b for a, b in zip(q_lens, prefix, strict=True)] + [5, 0]
    kv, table = _pool(rng, kv_lens, page_size=s, kv_heads=kh, head_dim=d, width=5, dtype=dtype,
                      layers=layers)
    t = sum(q_lens)
    q = jnp.asarray(rng.standard_normal((t + 3, kh * g, d)), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens), [t, t]]), jnp.int32)
    return q, kv, table, jnp.asarray(kv_lens, jnp.int32), cu, jnp.int32(len(q_lens))


def _assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOL[dtype])


@pytest.mark.parametrize("cfg", CONFIGS)
def test_decode_matches_reference(cfg):
    q, kv, table, lens = _decode_case(np.random.default_rng(0), cfg)
    got = decode(q, kv, table, lens)
    assert got.shape == q.shape and got.dtype == q.dtype
    _assert_close(got, decode_ref(q, kv, table, lens, sm_scale=SCALE), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got[0]), 0)  # padding row: finite zeros


@pytest.mark.parametrize("cfg", CONFIGS)
def test_ragged_matches_reference(cfg):
    q, kv, table, kv_lens, cu, n = _ragged_case(np.random.default_rng(1), cfg)
    got = ragged(q, kv, table, kv_lens, cu, n)
    assert got.shape == q.shape and got.dtype == q.dtype
    _assert_close(got, ragged_ref(q, kv, table, kv_lens, cu, n, sm_scale=SCALE), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got[-3:]), 0)  # padding tokens: finite zeros


def test_bf16():
    cfg = (16, 2, 4, 64)
    q, kv, table, lens = _decode_case(np.random.default_rng(2), cfg, jnp.bfloat16)
    got = decode(q, kv, table, lens)
    assert got.dtype == jnp.bfloat16
    _assert_close(got, decode_ref(q, kv, table, lens, sm_scale=SCALE), jnp.bfloat16)
    q, kv, table, kv_lens, cu, n = _ragged_case(np.random.default_rng(3), cfg, jnp.bfloat16)
    got = ragged(q, kv, table, kv_lens, cu, n)
    _assert_close(got, ragged_ref(q, kv, table, kv_lens, cu, n, sm_scale=SCALE), jnp.bfloat16)


def test_soft_cap_and_sliding_window():
    cfg, opts = CONFIGS[1], dict(soft_cap=2.0, sliding_window=21)  # a window across pages
    q, kv, table, lens = _decode_case(np.random.default_rng(4), cfg)
    _assert_close(decode(q, kv, table, lens, num_splits=1, **opts),
           decode_ref(q, kv, table, lens, sm_scale=SCALE, **opts), jnp.float32)
    q, kv, table, kv_lens, cu, n = _ragged_case(np.random.default_rng(5), cfg)
    # block_q = 4: several query blocks per sequence, each with its own page range.
    _assert_close(ragged(q, kv, table, kv_lens, cu, n, block_q=4, **opts),
           ragged_ref(q, kv, table, kv_lens, cu, n, sm_scale=SCALE, **opts), jnp.float32)


def test_decode_split_count_does_not_change_the_result():
    """One page per split (unaligned window starts inside splits) vs a single split."""
    cfg, opts = CONFIGS[2], dict(sliding_window=45)
    q, kv, table, lens = _decode_case(np.random.default_rng(9), cfg)
    want = decode_ref(q, kv, table, lens, sm_scale=SCALE, **opts)
    _assert_close(decode(q, kv, table, lens, num_splits=4, pages_per_block=1, **opts), want,
           jnp.float32)
    _assert_close(decode(q, kv, table, lens, num_splits=1, pages_per_block=1, **opts), want,
           jnp.float32)


def test_layer_of_5d_pages_equals_4d_slice():
    """A traced layer inside lax.scan reads the same pages as slicing the layer out first."""
    cfg = CONFIGS[0]
    q, kv, table, lens = _decode_case(np.random.default_rng(6), cfg, layers=3)

    def step(_, layer):
        return None, decode(q, kv, table, lens, layer=layer)

    _, per_layer = jax.lax.scan(step, None, jnp.arange(3, dtype=jnp.int32))
    for layer in range(3):
        _assert_close(per_layer[layer], decode(q, kv[layer], table, lens), jnp.float32)

    q, kv, table, kv_lens, cu, n = _ragged_case(np.random.default_rng(7), cfg, layers=2)
    _assert_close(ragged(q, kv, table, kv_lens, cu, n, layer=jnp.int32(1)),
           ragged(q, kv[1], table, kv_lens, cu, n), jnp.float32)


def test_freed_pages_poisoned_with_nan_do_not_leak():
    cfg = CONFIGS[0]
    q, kv, table, lens = _decode_case(np.random.default_rng(0), cfg)
    used = np.zeros(kv.shape[1], bool)
    for row, n in enumerate(np.asarray(lens)):
        used[np.asarray(table)[row, :-(-n // cfg[0])]] = True
    kv_nan = jnp.where(jnp.asarray(used)[None, :, None, None], kv, jnp.nan)
    _assert_close(decode(q, kv_nan, table, lens), decode(q, kv, table, lens), jnp.float32)

    q, kv, table, kv_lens, cu, n = _ragged_case(np.random.default_rng(1), cfg)
    used = np.zeros(kv.shape[1], bool)
    for row, length in enumerate(np.asarray(kv_lens)[:int(n)]):
        used[np.asarray(table)[row, :-(-length // cfg[0])]] = True
    kv_nan = jnp.where(jnp.asarray(used)[None, :, None, None], kv, jnp.nan)
    got = ragged(q, kv_nan, table, kv_lens, cu, n)
    _assert_close(got, ragged(q, kv, table, kv_lens, cu, n), jnp.float32)
    assert np.isfinite(np.asarray(got)).all()


def test_ragged_matches_dense_rebuild():
    """Gather each sequence's pages into contiguous K/V and run plain causal attention (numpy)."""
    cfg = CONFIGS[2]
    s, kh, g, d = cfg
    q, kv, table, kv_lens, cu, n = _ragged_case(np.random.default_rng(8), cfg)
    got = np.asarray(ragged(q, kv, table, kv_lens, cu, n))
    k, v = split_kv(np.asarray(kv, np.float64))
    q, table = np.asarray(q, np.float64), np.asarray(table)
    for b in range(int(n)):
        lo, hi, kv = int(cu[b]), int(cu[b + 1]), int(kv_lens[b])
        if hi == lo:
            continue
        pages = table[b, :-(-kv // s)].astype(int)
        k_kld = k[:, pages].reshape(kh, -1, d)[:, :kv]
        v_kld = v[:, pages].reshape(kh, -1, d)[:, :kv]
        q_pos = kv - (hi - lo) + np.arange(hi - lo)
        logits = np.einsum("qkgd,kld->kgql", q[lo:hi].reshape(hi - lo, kh, g, d), k_kld) * SCALE
        logits = np.where(np.arange(kv)[None, :] <= q_pos[:, None], logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want = np.einsum("kgql,kld->qkgd", probs, v_kld).reshape(hi - lo, kh * g, d)
        np.testing.assert_allclose(got[lo:hi], want, atol=1e-5, rtol=1e-5)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_random_ragged_batches(data):
    """Random ragged batches in one fixed shape (one compile): 4 rows, 24 tokens, page 8."""
    s, kh, g, d, width, t = 8, 2, 4, 16, 6, 24
    nseq = data.draw(st.integers(0, 4))
    q_lens = [data.draw(st.integers(0, 6)) for _ in range(nseq)]  # at most T = 24 in all
    kv_lens = [ql + data.draw(st.integers(0, width * s - 8)) for ql in q_lens]
    kv_lens += [data.draw(st.integers(0, 9)) for _ in range(4 - nseq)]  # padding rows
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    kv, table = _pool(rng, kv_lens, page_size=s, kv_heads=kh, head_dim=d, width=width)
    kv = kv[:, :40] if kv.shape[1] >= 40 else jnp.pad(kv, ((0, 0), (0, 40 - kv.shape[1]),
                                                           (0, 0), (0, 0)))
    table = jnp.minimum(table, 39)
    q = jnp.asarray(rng.standard_normal((t, kh * g, d)), jnp.float32)
    cu = np.cumsum([0, *q_lens])
    cu = jnp.asarray(np.concatenate([cu, [cu[-1]] * (4 - nseq)]), jnp.int32)
    window = data.draw(st.sampled_from([None, 5]))
    got = ragged(q, kv, table, jnp.asarray(kv_lens, jnp.int32), cu, jnp.int32(nseq),
                 sliding_window=window)
    want = ragged_ref(q, kv, table, jnp.asarray(kv_lens, jnp.int32), cu, jnp.int32(nseq),
                      sm_scale=SCALE, sliding_window=window)
    _assert_close(got, want, jnp.float32)
    assert np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("group, head_dim, page_size, dtype, layers, opts, kv_dtype", [
    (1, 128, 16, jnp.bfloat16, 0, {}, None),
    (8, 64, 8, jnp.bfloat16, 4, dict(soft_cap=30.0, sliding_window=100), None),
    (7, 128, 64, jnp.float32, 0, {}, None),
    (2, 64, 16, jnp.bfloat16, 0, {}, jnp.int8),  # quantized pages: the scale words too
    (8, 128, 32, jnp.bfloat16, 4, {}, jnp.float8_e4m3fn),
])
def test_lowers_to_triton_without_a_gpu(group, head_dim, page_size, dtype, layers, opts,
                                        kv_dtype):
    """Lowering for CUDA on a CPU host runs JAX's Pallas->Triton rules (power-of-two tensors,
    supported primitives); Triton's own compiler passes still need a GPU."""
    spec = jax.ShapeDtypeStruct
    lead = ((layers,) if layers else ()) + (2, 50, page_size)
    pages = spec(lead + (2 * head_dim,), kv_dtype or dtype)
    more = dict(opts, layer=jnp.int32(1)) if layers else dict(opts)
    if kv_dtype is not None:
        more["kv_scales"] = jnp.zeros(lead, jnp.int32)
    cases = [
        (paged_decode_attention_gpu, [spec((3, 2 * group, head_dim), dtype), pages,
                                      spec((3, 9), jnp.int32), spec((3,), jnp.int32)]),
        (ragged_paged_attention_gpu, [spec((37, 2 * group, head_dim), dtype), pages,
                                      spec((3, 9), jnp.int32), spec((3,), jnp.int32),
                                      spec((4,), jnp.int32), spec((), jnp.int32)]),
    ]
    for fn, args in cases:
        lowered = jax.jit(functools.partial(fn, sm_scale=SCALE, **more)).trace(*args).lower(
            lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.zeros((6, 3, 64))), "kv heads"),
    (dict(kv_pages=jnp.zeros((2, 9, 8, 64))), "kv_pages last dim"),
    (dict(kv_pages=jnp.zeros((2, 9, 6, 128))), "page_size"),
    (dict(q=jnp.zeros((6, 2, 64), jnp.bfloat16)), "kv_pages dtype"),
    (dict(lengths=jnp.zeros((6,), jnp.int16)), "lengths"),
    (dict(page_table=jnp.zeros((6, 4), jnp.float32)), "page_table"),
    (dict(layer=0), "layer"),
    (dict(pages_per_block=3), "pages_per_block"),
    (dict(pages_per_block=16), "does not fit"),  # 128 keys x 64 dims: registers would spill
    (dict(num_splits=0), "num_splits"),
    (dict(num_warps=3), "num_warps"),
    (dict(precision="fp32"), "precision"),
    (dict(kv_pages=jnp.zeros((2, 9, 8, 128), jnp.int8)), "kv_scales"),  # quantized: scales needed
    (dict(kv_pages=jnp.zeros((2, 9, 8, 128), jnp.float8_e4m3fn),
          kv_scales=jnp.zeros((2, 9, 8), jnp.float32)), "kv_scales"),
    (dict(kv_pages=jnp.zeros((2, 9, 8, 128), jnp.int8), kv_scales=jnp.zeros((2, 9), jnp.int32)),
     "kv_scales"),
    (dict(kv_scales=jnp.zeros((2, 9, 8), jnp.int32)), "kv_scales"),  # scales of float pages
    (dict(kv_pages=jnp.zeros((2, 9, 8, 128), jnp.int16)), "kv_pages dtype"),
])
def test_decode_static_checks_name_the_argument(change, match):
    args = dict(q=jnp.zeros((6, 2, 64)), kv_pages=jnp.zeros((2, 9, 8, 128)),
                page_table=jnp.zeros((6, 4), jnp.int32), lengths=jnp.zeros((6,), jnp.int32))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        decode(**args)


@pytest.mark.parametrize("change, match", [
    (dict(cu_q_lens=jnp.zeros((3,), jnp.int32)), "cu_q_lens"),
    (dict(kv_lens=jnp.zeros((3,), jnp.float32)), "kv_lens"),
    (dict(num_seqs=jnp.zeros((2,), jnp.int32)), "num_seqs"),
    (dict(block_q=6), "block_q"),
    (dict(block_q=2), "block_q"),  # 2 tokens x 1 head < the 16-row tl.dot minimum
    (dict(kv_pages=jnp.zeros((1, 2, 9, 8, 128))), "layer"),
    (dict(kv_pages=jnp.zeros((2, 9, 8, 128), jnp.int8)), "kv_scales"),
    (dict(kv_pages=jnp.zeros((1, 2, 9, 8, 128), jnp.int8), layer=0,
          kv_scales=jnp.zeros((2, 9, 8), jnp.int32)), "kv_scales"),  # 4-D scales, 5-D pages
])
def test_ragged_static_checks_name_the_argument(change, match):
    args = dict(q=jnp.zeros((5, 2, 64)), kv_pages=jnp.zeros((2, 9, 8, 128)),
                page_table=jnp.zeros((3, 4), jnp.int32),
                kv_lens=jnp.zeros((3,), jnp.int32), cu_q_lens=jnp.zeros((4,), jnp.int32),
                num_seqs=jnp.int32(3))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ragged(**args)


def _quantize_poisoned(kv, table, lens, *, page_size, kv_dtype, layer=None):
    """A float pool quantized as the engine writes it (``quant.quantize_kv``), with every slot
    no sequence holds (unowned pages, the tail of a last page, other layers) poisoned: NaN
    scale words, and NaN values too where the format has them (fp8)."""
    d = kv.shape[-1] // 2
    pages, scales = quant.quantize_kv(kv[..., :d], kv[..., d:], kv_dtype)
    live = np.zeros(kv.shape[-3:-1], bool)  # [P, S]
    for row, n in enumerate(lens):
        pos = np.arange(n)
        live[np.asarray(table)[row, pos // page_size], pos % page_size] = True
    live = np.broadcast_to(live, scales.shape).copy()
    if layer is not None:
        live[np.arange(kv.shape[0]) != layer] = False
    live = jnp.asarray(live)
    scales = jnp.where(live, scales, jnp.int32(quant.NAN_SCALES))
    if kv_dtype == jnp.float8_e4m3fn:
        pages = jnp.where(live[..., None], pages, jnp.asarray(jnp.nan, kv_dtype))
    return pages, scales


# (page_size, kv_heads, group, head_dim), q dtype, page dtype, layers: GQA 1 (the decode
# broadcast path) and 8 (tl.dot), head_dim 64 and 128, 4-D and 5-D pages; fp8 on the broadcast
# path with the slow tests (each case compiles six functions in interpret mode).
QUANT_CASES = [
    pytest.param(CONFIGS[0], jnp.float32, jnp.int8, 0, id="int8-f32-G1-D64-4D"),
    pytest.param((16, 1, 8, 128), jnp.bfloat16, jnp.float8_e4m3fn, 3, id="fp8-bf16-G8-D128-5D"),
    pytest.param((16, 2, 4, 64), jnp.float32, jnp.float8_e4m3fn, 0, id="fp8-f32-G4-D64-4D",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("cfg, dtype, kv_dtype, layers", QUANT_CASES)
def test_quantized_pages_match_reference(cfg, dtype, kv_dtype, layers):
    """int8/fp8 pages and their scale words, dequantized inside the kernels: against the
    reference given the same (pages, scales), which itself equals the reference on the
    dequantized float pool; NaN-poisoned stale slots never reach the output."""
    s = cfg[0]
    rng = np.random.default_rng(12)
    layer = 1 if layers else None
    more = dict(layer=jnp.int32(1)) if layers else {}

    q, kv, table, lens = _decode_case(rng, cfg, layers=layers)
    q = q.astype(dtype)
    pages, scales = _quantize_poisoned(kv, table, np.asarray(lens), page_size=s,
                                       kv_dtype=kv_dtype, layer=layer)
    got = decode(q, pages, table, lens, kv_scales=scales, **more)
    want = decode_ref(q, pages, table, lens, sm_scale=SCALE, kv_scales=scales, **more)
    assert got.dtype == dtype and np.isfinite(np.asarray(got, np.float32)).all()
    _assert_close(got, want, dtype)
    _assert_close(want, decode_ref(q, quant.dequantize_pages(pages, scales), table, lens,
                                   sm_scale=SCALE, **more).astype(dtype), dtype)

    q, kv, table, kv_lens, cu, n = _ragged_case(rng, cfg, layers=layers)
    q = q.astype(dtype)
    pages, scales = _quantize_poisoned(kv, table, np.asarray(kv_lens)[:int(n)], page_size=s,
                                       kv_dtype=kv_dtype, layer=layer)
    got = ragged(q, pages, table, kv_lens, cu, n, kv_scales=scales, **more)
    want = ragged_ref(q, pages, table, kv_lens, cu, n, sm_scale=SCALE, kv_scales=scales, **more)
    assert got.dtype == dtype and np.isfinite(np.asarray(got, np.float32)).all()
    _assert_close(got, want, dtype)
    _assert_close(want, ragged_ref(q, quant.dequantize_pages(pages, scales), table, kv_lens, cu,
                                   n, sm_scale=SCALE, **more).astype(dtype), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [8, 16, 32, 64])
@pytest.mark.parametrize("kv_heads, group", [(1, 1), (2, 4), (1, 8), (2, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sweep(page_size, kv_heads, group, head_dim, dtype):
    cfg = (page_size, kv_heads, group, head_dim)
    rng = np.random.default_rng(page_size * group + head_dim)
    opts = dict(soft_cap=5.0, sliding_window=2 * page_size + 3) if group == 2 else {}
    q, kv, table, lens = _decode_case(rng, cfg, dtype)
    _assert_close(decode(q, kv, table, lens, **opts),
           decode_ref(q, kv, table, lens, sm_scale=SCALE, **opts), dtype)
    q, kv, table, kv_lens, cu, n = _ragged_case(rng, cfg, dtype)
    _assert_close(ragged(q, kv, table, kv_lens, cu, n, **opts),
           ragged_ref(q, kv, table, kv_lens, cu, n, sm_scale=SCALE, **opts), dtype)


def test_f32_precision_follows_jax_default_matmul_precision():
    """TF32 by default, as XLA's own f32 matmuls on GPU; exact f32 when jax is asked for it."""
    from pallas_kernels.gpu_paged_common import resolve_f32_precision

    with jax.default_matmul_precision("tensorfloat32"):
        assert resolve_f32_precision(None) == "tf32"
    with jax.default_matmul_precision("highest"):
        assert resolve_f32_precision(None) == "ieee"
    with jax.default_matmul_precision("high"):
        assert resolve_f32_precision(None) == "tf32x3"
    with jax.default_matmul_precision("BF16_BF16_F32_X3"):
        assert resolve_f32_precision(None) == "bf16x3"
    assert resolve_f32_precision("ieee") == "ieee"
    with pytest.raises(ValueError, match="precision"):
        resolve_f32_precision("fp32")


# On a GPU each mode's error is its own (TF32: a 10-bit mantissa); interpret mode is exact f32.
PRECISION_TOL = {"tf32": dict(atol=1e-2, rtol=1e-2), "tf32x3": dict(atol=1e-4, rtol=1e-4),
                 "bf16x3": dict(atol=1e-4, rtol=1e-4), "ieee": TOL[jnp.float32]}


@pytest.mark.parametrize("precision", sorted(PRECISION_TOL))
def test_every_f32_precision_matches_reference(precision):
    """The tl.dot path (group 8, and the ragged kernel) in each f32 mode against the reference
    (exact f32 on the device run, which sets jax_default_matmul_precision=highest)."""
    q, kv, table, lens = _decode_case(np.random.default_rng(10), CONFIGS[2])
    np.testing.assert_allclose(np.asarray(decode(q, kv, table, lens, precision=precision)),
                               np.asarray(decode_ref(q, kv, table, lens, sm_scale=SCALE)),
                               **PRECISION_TOL[precision])
    q, kv, table, kv_lens, cu, n = _ragged_case(np.random.default_rng(11), CONFIGS[1])
    np.testing.assert_allclose(
        np.asarray(ragged(q, kv, table, kv_lens, cu, n, precision=precision)),
        np.asarray(ragged_ref(q, kv, table, kv_lens, cu, n, sm_scale=SCALE)),
        **PRECISION_TOL[precision])
