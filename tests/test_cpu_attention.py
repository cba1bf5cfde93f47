"""The CPU decode-attention kernel (C++ XLA FFI) against the jnp reference, and its place in
the CPU engine ("auto" attention on CPU decodes through it)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode_attention
from pallas_kernels.cpu_library import library
from pallas_kernels.cpu_paged_attention import paged_decode_attention_cpu
from pallas_kernels.quant import quantize_kv, to_scale_rows
from pallas_kernels.reference import paged_decode_attention_reference

pytestmark = pytest.mark.skipif(library() is None, reason="needs a C++ compiler")

RNG = np.random.default_rng(0)
L, K, P, S, D, B, H, W = 2, 2, 40, 16, 64, 5, 6, 8


def inputs(dtype):
    """q, 5-D pages of ``dtype`` (int8: quantized, with scale words), a table, lengths."""
    q = jnp.asarray(RNG.standard_normal((B, H, D)), jnp.float32)
    kv = RNG.standard_normal((L, K, P, S, 2 * D)).astype(np.float32)
    scales = None
    if dtype == "int8":
        pages, words = quantize_kv(jnp.asarray(kv[..., :D]), jnp.asarray(kv[..., D:]), jnp.int8)
        scales = to_scale_rows(words)
    else:
        pages = jnp.asarray(kv, dtype)
    table = jnp.asarray(RNG.permutation(P)[:B * W].reshape(B, W), jnp.int32)
    lengths = jnp.asarray([0, 1, 17, 100, 128], jnp.int32)  # a padding row, 1 to W * S keys
    return q, pages, table, lengths, scales


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window, cap", [(None, None), (20, None), (None, 30.0)])
def test_kernel_equals_the_reference(dtype, window, cap):
    q, pages, table, lengths, scales = inputs(dtype)
    kw = dict(sm_scale=0.125, soft_cap=cap, sliding_window=window, layer=1, kv_scales=scales)
    got = paged_decode_attention_cpu(q, pages, table, lengths, **kw)
    want = paged_decode_attention_reference(q, pages, table, lengths, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[0] == 0)  # the padding row
    assert np.abs(np.asarray(got)[1:]).min(axis=-1).max() > 0


def test_four_dimensional_pages_and_auto_dispatch():
    """4-D pages [K, P, S, 2D] without a layer; backend "auto" on CPU takes the kernel."""
    q, pages, table, lengths, _ = inputs("float32")
    want = paged_decode_attention_reference(q, pages[0], table, lengths, sm_scale=0.125)
    for got in (paged_decode_attention_cpu(q, pages[0], table, lengths, sm_scale=0.125),
                paged_decode_attention(q, pages[0], table, lengths, sm_scale=0.125)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_by_name():
    q, pages, table, lengths, scales = inputs("int8")
    with pytest.raises(ValueError, match="kv_scales"):
        paged_decode_attention_cpu(q, pages, table, lengths, sm_scale=1.0, layer=0)
    with pytest.raises(ValueError, match="layer"):
        paged_decode_attention_cpu(q, pages, table, lengths, sm_scale=1.0, kv_scales=scales)
    with pytest.raises(ValueError, match="pages must be"):
        paged_decode_attention_cpu(q, pages.astype(jnp.float16), table, lengths, sm_scale=1.0,
                                   layer=0)


def test_engine_decodes_as_with_the_reference(plain_model):
    """The CPU engine's decode loop ("auto") gives the reference engine's greedy tokens."""
    import jaxkv

    prompts = [RNG.integers(4, 97, n).tolist() for n in (5, 23, 40)]
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {impl: jaxkv.LLM(plain_model, attention_impl=impl, page_size=8, warmup=False)
            .generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
            for impl in ("auto", "reference")}
    assert ([o.outputs[0].token_ids for o in outs["auto"]]
            == [o.outputs[0].token_ids for o in outs["reference"]])
