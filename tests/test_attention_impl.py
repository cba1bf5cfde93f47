"""End to end through `attention_impl`: the kernels, run in interpret mode on CPU, give the
same greedy tokens as the reference inside `jaxkv.generate` (prefill, chunks and decode)."""

import pytest

import jaxkv
from jaxkv.attention import check_attention_impl

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
