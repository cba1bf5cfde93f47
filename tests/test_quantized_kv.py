"""Quantized KV pages (int8, fp8 e4m3): the scale words, quantization error bounds, quantize on
write, attention over quantized pages against attention over the dequantized pool, and the
engine end to end (prefix cache, copy-on-write, forks, preemption, NaN-poisoned freed pages)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxkv
from jaxkv import LLM, Engine, SamplingParams
from jaxkv.errors import KVStateError
from jaxkv.kv import PagedKVState, init_state, kv_bytes_per_token, write_kv
from jaxkv.runtime.page_copy import copy_pages, fill_pages, gather_pages, load_pages
from pallas_kernels import quant
from pallas_kernels.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)

KV_DTYPES = [("int8", jnp.int8), ("fp8_e4m3", jnp.float8_e4m3fn)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_scale_words_carry_two_bfloat16_exactly():
    rng = np.random.default_rng(0)
    k = _bf16(np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-6, 6, 500),
                              [0.0, 1e-30, 3.0e38, 2.0**-126]]))
    v = _bf16(rng.permutation(k))
    words = quant.pack_scales(jnp.asarray(k), jnp.asarray(v))
    assert words.dtype == jnp.int32
    got_k, got_v = quant.unpack_scales(words)
    np.testing.assert_array_equal(np.asarray(got_k), k)
    np.testing.assert_array_equal(np.asarray(got_v), v)
    # The high half is the key's bfloat16 bits, the low half the value's.
    w = int(quant.pack_scales(jnp.float32(1.0), jnp.float32(-2.0)))
    assert w & 0xFFFFFFFF == (0x3F80 << 16) | 0xC000
    nan_k, nan_v = quant.unpack_scales(jnp.int32(quant.NAN_SCALES))
    assert np.isnan(nan_k) and np.isnan(nan_v)


def test_int8_error_is_at_most_half_a_step():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 4, 128)).astype(np.float32) * rng.uniform(0.01, 30, (64, 4, 1))
    x[3, 1] = 0.0  # an all-zero row: scale 0, values 0
    q, scale = quant.quantize(jnp.asarray(x), jnp.int8)
    q, scale = np.asarray(q), np.asarray(scale)
    assert q.dtype == np.int8 and np.abs(q.astype(np.int32)).max() <= 127
    np.testing.assert_array_equal(scale, _bf16(scale))  # scales are exact bfloat16 values
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(scale, amax / 127, rtol=2**-8, atol=0)  # bf16 rounding only
    assert scale[3, 1] == 0 and not q[3, 1].any()
    err = np.abs(x - q * scale[..., None])
    # Rounding costs half a step; the largest entry may also be clipped by the scale's rounding.
    assert (err <= scale[..., None] * (0.5 + 127 * 2**-8) + 1e-7).all()
    assert np.mean(err / np.maximum(amax[..., None], 1e-30)) < 1 / 254  # mean below half a step


def test_fp8_error_is_relative():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 2, 64)).astype(np.float32) * 5
    q, scale = quant.quantize(jnp.asarray(x), jnp.float8_e4m3fn)
    deq = np.asarray(q).astype(np.float32) * np.asarray(scale)[..., None]
    assert np.isfinite(deq).all()
    np.testing.assert_allclose(np.abs(x).max(-1), np.abs(deq).max(-1), rtol=2**-4, atol=0)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 of the scale.
    bound = np.maximum(np.abs(x) * 2**-4, np.asarray(scale)[..., None] * 2**-9)
    assert (np.abs(x - deq) <= bound * 1.0001).all()


@pytest.mark.parametrize("name, dtype", KV_DTYPES)
def test_write_kv_quantizes_on_write_and_drops_padding(tiny_config, name, dtype):
    state = init_state(tiny_config, num_pages=5, page_size=4, kv_cache_dtype=name)
    # Pages of 4 tokens: 32 pages' words to a row of 128, so one row holds all 5.
    assert state.kv_pages.dtype == dtype and state.kv_scales.shape == (2, 2, 1, 128)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32)
    v = rng.standard_normal((3, 2, 16)).astype(np.float32) * 7
    pages, offsets = jnp.asarray([2, 4, 5]), jnp.asarray([1, 3, 0])  # page 5 >= P: padding
    kv_pages, kv_scales = write_kv(state.kv_pages, 1, jnp.asarray(k), jnp.asarray(v), pages,
                                   offsets, state.kv_scales)
    words = quant.scales_by_page(kv_scales, 4)  # [2, 2, 32, 4]: pages 5.. are padding
    deq = np.asarray(quant.dequantize_pages(kv_pages, words[:, :, :5]))
    tol = 0.5 / 127 if name == "int8" else 2**-4  # of the row's largest |x|
    kr = np.asarray(quant.rotate(jnp.asarray(k)))  # keys are stored rotated (k R)
    for t, (p, o) in enumerate([(2, 1), (4, 3)]):
        for x, got in ((kr[t], deq[1, :, p, o, :16]), (v[t], deq[1, :, p, o, 16:])):
            amax = np.abs(x).max(-1, keepdims=True)
            np.testing.assert_allclose(got, x, atol=float((amax * tol * 1.01).max()), rtol=0)
    written = np.zeros((2, 2, 32, 4), bool)
    written[1, :, 2, 1] = written[1, :, 4, 3] = True
    assert (np.asarray(words)[written] != 0).all()
    assert not np.asarray(words)[~written].any()  # padding and other layers untouched
    assert not np.asarray(kv_pages.astype(jnp.float32))[~written[:, :, :5]].any()
    # The word of slot (page p, offset o) is row p // 32, column p % 32 * 4 + o.
    assert np.asarray(kv_scales)[1, 0, 0, 4 * 4 + 3] == np.asarray(words)[1, 0, 4, 3]


def _quantized_pool(rng, dtype, shape):
    """A random quantized pool: (pages, scale words per page [..., P, S]) and its dequantized
    f32 twin."""
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 4, shape[:-1] + (1,))
    d = shape[-1] // 2
    kq, ks = quant.quantize(jnp.asarray(x[..., :d]), dtype)
    vq, vs = quant.quantize(jnp.asarray(x[..., d:]), dtype)
    pages, words = jnp.concatenate([kq, vq], -1), quant.pack_scales(ks, vs)
    return pages, words, quant.dequantize_pages(pages, words)


@pytest.mark.parametrize("name, dtype", KV_DTYPES)
def test_reference_attention_over_quantized_pages_equals_the_dequantized_pool(name, dtype):
    rng = np.random.default_rng(4)
    layers, k, p, s, d, g = 2, 2, 12, 4, 16, 3
    pages, words, dense = _quantized_pool(rng, dtype, (layers, k, p, s, 2 * d))
    words = words.at[:, :, 11].set(quant.NAN_SCALES)  # a page nobody owns: never read
    dense = dense.at[:, :, 11].set(jnp.nan)
    words = quant.to_scale_rows(words)  # the pool's layout: 12 pages of 4 -> one row of 128
    assert words.shape == (layers, k, 1, 128)
    table = jnp.asarray([[3, 7, 1, 11], [0, 9, 11, 11], [5, 2, 8, 11]], jnp.int32)
    kv_lens = jnp.asarray([12, 6, 9], jnp.int32)
    cu = jnp.asarray([0, 5, 6, 9], jnp.int32)
    q = jnp.asarray(rng.standard_normal((9, k * g, d)), jnp.float32)
    for layer in (0, 1):
        got = ragged_paged_attention_reference(q, pages, table, kv_lens, cu, jnp.int32(3),
                                               sm_scale=0.25, layer=layer, kv_scales=words)
        want = ragged_paged_attention_reference(q, dense, table, kv_lens, cu, jnp.int32(3),
                                                sm_scale=0.25, layer=layer)
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
        got = paged_decode_attention_reference(q[:3], pages, table, kv_lens, sm_scale=0.25,
                                               layer=layer, kv_scales=words)
        want = paged_decode_attention_reference(q[:3], dense, table, kv_lens, sm_scale=0.25,
                                                layer=layer)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kv_scales"):
        jaxkv.attention.paged_attention(q, pages, 0, table, kv_lens, cu, jnp.int32(3),
                                        decode=False, sm_scale=0.25, impl="reference")


def test_page_copies_and_poisoning_carry_the_scales(tiny_config):
    state = init_state(tiny_config, num_pages=6, page_size=4, kv_cache_dtype="int8")
    rng = np.random.default_rng(5)
    pages, words, _ = _quantized_pool(rng, jnp.int8, state.kv_pages.shape)
    state = state.replace(kv_pages=pages, kv_scales=quant.to_scale_rows(words))
    before_pages, before_words = np.asarray(pages), np.asarray(words)

    def by_page(state):
        return np.asarray(quant.scales_by_page(state.kv_scales, 4))[:, :, :6]

    state = copy_pages(state, jnp.asarray([1, 4]), jnp.asarray([3, 6]))  # 6 >= P: dropped
    np.testing.assert_array_equal(np.asarray(state.kv_pages)[:, :, 3], before_pages[:, :, 1])
    np.testing.assert_array_equal(by_page(state)[:, :, 3], before_words[:, :, 1])
    np.testing.assert_array_equal(np.delete(by_page(state), 3, axis=2),
                                  np.delete(before_words, 3, axis=2))
    state = fill_pages(state, jnp.asarray([2]), jnp.float32(jnp.nan))
    deq = np.asarray(quant.dequantize_pages(state.kv_pages, by_page(state)))
    assert np.isnan(deq[:, :, 2]).all() and not np.isnan(np.delete(deq, 2, axis=2)).any()
    # The host tier's gather and load move a page's values and words together.
    values, scales = gather_pages(state, jnp.asarray([3, 6]))
    np.testing.assert_array_equal(np.asarray(scales)[0], before_words[:, :, 1])
    assert not np.asarray(scales)[1].any()  # page 6 is past the pool: zeros
    state = load_pages(state, jnp.asarray([5, 6]), values, scales)
    np.testing.assert_array_equal(by_page(state)[:, :, 5], before_words[:, :, 1])
    np.testing.assert_array_equal(np.asarray(state.kv_pages)[:, :, 5], before_pages[:, :, 1])


def test_a_quantized_state_names_the_scales_field(tiny_config):
    state = init_state(tiny_config, num_pages=4, page_size=4, kv_cache_dtype="int8")
    with pytest.raises(KVStateError, match="PagedKVState.kv_scales: int8 pages need scales"):
        PagedKVState(kv_pages=state.kv_pages)
    with pytest.raises(KVStateError, match=r"PagedKVState.kv_scales: expected i32\[2, 2, 1, 128\]"):
        PagedKVState(kv_pages=state.kv_pages, kv_scales=state.kv_scales[..., :16])
    with pytest.raises(KVStateError, match="float32 pages take no scales"):
        PagedKVState(kv_pages=jnp.zeros((2, 2, 4, 4, 32)), kv_scales=state.kv_scales)


@pytest.mark.parametrize("make", [
    lambda m: Engine(m, num_pages=8, kv_cache_dtype="int4"),
    lambda m: LLM(m, num_pages=8, kv_cache_dtype="int4", warmup=False),
    lambda m: jaxkv.generate(m, [[1, 2]], kv_cache_dtype="int4"),
])
def test_bad_kv_cache_dtype_is_named(tiny_model, make):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* got 'int4'"):
        make(tiny_model)


def test_pool_sizing_counts_the_scales(tiny_model):
    c = tiny_model.config
    per_token = c.num_layers * c.num_kv_heads * (2 * c.head_dim + 4)  # int8 values + one word
    assert kv_bytes_per_token(c, jnp.int8) == per_token
    budget = 2**22
    llm = LLM(tiny_model, kv_cache_memory_bytes=budget, kv_cache_dtype="int8", warmup=False)
    # Whole rows of scale words: pages of 16 tokens pack 8 pages' words to a row.
    assert llm.kv_pool.pages == budget // (16 * per_token) // 8 * 8
    assert llm.engine.state.kv_pages.dtype == jnp.int8
    fp32 = LLM(tiny_model, kv_cache_memory_bytes=budget, warmup=False)
    assert fp32.kv_pool.bytes_per_token == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    # head_dim 16: 128 bytes of f32 per kv head and token against 32 + 4 of int8
    assert llm.kv_pool.pages / fp32.kv_pool.pages == pytest.approx(128 / 36, rel=1e-2)


def _serve(engine, requests):
    outs = {}
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [c.token_ids for c in out.outputs]
        engine.check()
    return outs


@pytest.mark.parametrize("kv", ["int8", pytest.param("fp8_e4m3", marks=pytest.mark.slow)])
def test_engine_with_quantized_pages_equals_requests_run_alone(tiny_model, kv):
    """Prefix hits (a shared system prompt, a partly matched page copied), n = 2 forks
    sharing the prompt's pages, preemption in a small pool and NaN in every freed page: each
    request's greedy tokens equal those of the same request alone in a fresh engine. (Here no
    token flips; in general int8 reuse and recompute may round a K/V value differently, see
    docs/BENCHMARKS.md "Host-memory KV tier".)"""
    rng = np.random.default_rng(6)
    shared = rng.integers(4, 96, 18).tolist()
    prompts = [shared + rng.integers(4, 96, int(n)).tolist() for n in (3, 7, 12)]
    prompts.append(rng.integers(4, 96, 21).tolist())
    fork = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    requests = [(f"r{i}", p, fork if i == 1 else GREEDY) for i, p in enumerate(prompts)]
    shape = dict(page_size=4, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16,
                 kv_cache_dtype=kv)
    busy = Engine(tiny_model, num_pages=14, debug_nan_freed_pages=True, **shape)
    together = _serve(busy, requests[:2])  # the shared prefix is cached before the rest
    together.update(_serve(busy, requests[2:]))
    stats = busy.stats()
    assert stats.cached_prompt_tokens > 0 and stats.preemptions > 0, stats
    for rid, prompt, sp in requests:
        alone = _serve(Engine(tiny_model, num_pages=64, **shape), [(rid, prompt, sp)])
        assert together[rid] == alone[rid], rid
