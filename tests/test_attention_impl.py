"""End to end through `attention_impl`: the kernels, run in interpret mode on CPU, give the
same greedy tokens as the reference inside `jaxkv.generate` (prefill, chunks and decode)."""

import pytest

import jaxkv
from jaxkv.attention import check_attention_impl, kernel_for

GREEDY = jaxkv.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_tokens(tiny_model):
    prompts = [[5, 9, 14, 2, 33, 7, 8, 61, 12, 40, 3, 3, 17], [71, 4]]
    return prompts, jaxkv.generate(tiny_model, prompts, GREEDY, page_size=8, prefill_chunk=8,
                                   attention_impl="reference")


@pytest.mark.parametrize("impl", ["interpret", "interpret-tpu"])
def test_kernels_match_reference_end_to_end(tiny_model, reference_tokens, impl):
    prompts, want = reference_tokens
    got = jaxkv.generate(tiny_model, prompts, GREEDY, page_size=8, prefill_chunk=8,
                         attention_impl=impl)
    assert got == want


def test_unknown_and_unavailable_impls_are_named():
    with pytest.raises(ValueError, match="attention_impl"):
        check_attention_impl("flash")
    with pytest.raises(ValueError, match="needs a GPU or TPU"):
        check_attention_impl("pallas")  # the test machine is a CPU


def test_explicit_platform_kernels_are_chosen_on_any_machine():
    """"pallas-gpu"/"pallas-tpu" pick that platform's compiled kernel even on this CPU machine
    (for ahead-of-time compiles), where "auto" picks the reference."""
    assert kernel_for("pallas-gpu") == "gpu" and kernel_for("pallas-tpu") == "tpu"
    assert kernel_for("auto") == "reference"


def test_public_api_is_exported():
    import pallas_kernels

    for name in pallas_kernels.__all__:
        assert callable(getattr(pallas_kernels, name)) or name == "BACKENDS", name
    from pallas_kernels import paged_decode_attention, ragged_paged_attention  # noqa: F401


def test_pack_and_split_kv_round_trip():
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import pack_kv, split_kv

    k = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
    kv = pack_kv(k, -k)
    assert kv.shape == (2, 3, 4, 10)
    np.testing.assert_array_equal(np.asarray(kv[..., :5]), np.asarray(k))
    back_k, back_v = split_kv(kv)
    np.testing.assert_array_equal(np.asarray(back_v), -np.asarray(k))
    np.testing.assert_array_equal(np.asarray(back_k), np.asarray(k))
    with pytest.raises(ValueError, match="must match"):
        pack_kv(k, k[..., :4])


def test_gpu_kernel_refuses_a_head_dim_it_cannot_tile():
    # Phi-3's head_dim 96: the Triton kernels tile powers of two; the engine says so up front
    # (naming the field and the way out) instead of failing inside a trace.
    config = jaxkv.ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=64,
                               num_layers=1, num_heads=1, num_kv_heads=1, head_dim=96)
    model = jaxkv.random_model(config)
    with pytest.raises(ValueError, match="head_dim=96: the GPU attention kernel"):
        jaxkv.Engine(model, attention_impl="interpret", num_pages=8, max_model_len=32,
                     warmup=False)
    jaxkv.Engine(model, attention_impl="reference", num_pages=8, max_model_len=32,
                 warmup=False)  # the way out named in the message
