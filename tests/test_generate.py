"""Cache vs no-cache, chunked prefill, page sizes, and batching all give the same greedy tokens."""

import numpy as np
import pytest

import jaxkv
from jaxkv import SamplingParams

GREEDY = jaxkv.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n, vocab, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def prompts(tiny_config):
    return _prompts(3, tiny_config.vocab_size)


@pytest.fixture(scope="module")
def baseline(tiny_model, prompts):
    return jaxkv.generate(tiny_model, prompts, GREEDY)


def test_cache_equals_no_cache(tiny_model, prompts, baseline):
    assert jaxkv.generate_no_cache(tiny_model, prompts, GREEDY) == baseline
    assert all(len(out) == GREEDY.max_tokens for out in baseline)


def test_outputs_are_not_degenerate(baseline):
    # A model that always emits one token would make every equality above trivially true.
    assert len({t for out in baseline for t in out}) > 5


@pytest.mark.parametrize("chunk", [1, 7, 16, None])
def test_chunked_prefill_equals_one_shot(tiny_model, prompts, baseline, chunk):
    assert jaxkv.generate(tiny_model, prompts, GREEDY, prefill_chunk=chunk) == baseline


@pytest.mark.parametrize("page_size", [1, 8, 16, 128])
def test_page_sizes_agree(tiny_model, prompts, baseline, page_size):
    assert jaxkv.generate(tiny_model, prompts, GREEDY, page_size=page_size) == baseline


def test_mixed_batch_equals_each_alone(tiny_model, tiny_config):
    prompts = _prompts(4, tiny_config.vocab_size, seed=1, lo=1, hi=60)
    together = jaxkv.generate(tiny_model, prompts, GREEDY)
    alone = [jaxkv.generate(tiny_model, [p], GREEDY)[0] for p in prompts]
    assert together == alone


def test_stop_tokens_and_max_tokens(tiny_model, prompts, baseline):
    stop_at = baseline[0][5]
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop_at,),
                              ignore_eos=True)
    out = jaxkv.generate(tiny_model, prompts[:1], sp)[0]
    first = baseline[0].index(stop_at)
    assert out == baseline[0][: first + 1]
    sp_min = jaxkv.SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop_at,),
                                  min_tokens=first + 2, ignore_eos=True)
    got = jaxkv.generate(tiny_model, prompts[:1], sp_min)[0]
    for field, value in (("stop", "x"), ("logprobs", 2)):  # token ids only: an error, not a no-op
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*jaxkv.generate"):
            jaxkv.generate(tiny_model, prompts[:1], jaxkv.SamplingParams(**{field: value}))
    assert got[:first] == baseline[0][:first] and stop_at not in got[:first + 2]


def test_seeded_sampling_is_reproducible_and_per_request(tiny_model, prompts):
    sp = jaxkv.SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    a = jaxkv.generate(tiny_model, prompts, sp)
    b = jaxkv.generate(tiny_model, prompts[::-1], sp)[::-1]
    assert a == b  # a request's samples do not depend on its batch neighbours
    other = jaxkv.generate(tiny_model, prompts, jaxkv.SamplingParams(
        temperature=1.0, max_tokens=16, seed=8, ignore_eos=True))
    assert a != other


def test_n_samples_differ(tiny_model, prompts):
    sp = jaxkv.SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1, ignore_eos=True)
    out = jaxkv.generate(tiny_model, prompts[:2], sp)
    assert len(out) == 6
    assert len({tuple(o) for o in out[:3]}) > 1


@pytest.mark.parametrize("bad, field", [
    ([[]], "prompts[0]"),
    ([[1, 2, 10_000]], "10000"),
    ([[1, -1]], "-1"),
])
def test_bad_prompts_are_named(tiny_model, bad, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        jaxkv.generate(tiny_model, bad, GREEDY)


def test_strings_need_a_tokenizer(tiny_model):
    with pytest.raises(ValueError, match="tokenizer"):
        jaxkv.generate(tiny_model, ["hello"], GREEDY)


def test_bad_page_size(tiny_model, prompts):
    with pytest.raises(ValueError, match="page_size"):
        jaxkv.generate(tiny_model, prompts, GREEDY, page_size=12)


def test_varied_lengths_compile_nothing_new_after_the_first_calls(tiny_model, tiny_config):
    """Rows, page-table width, pool size and prompt tokens are bucketed: once a call of each
    prompt-token bucket ran, 20 calls of other prompt lengths and max_tokens compile nothing."""
    from jaxkv.runtime.compiles import count_compiles

    rng = np.random.default_rng(0)
    greedy = dict(temperature=0, ignore_eos=True)

    def call(n, m):
        prompt = rng.integers(4, tiny_config.vocab_size, n).tolist()
        out = jaxkv.generate(tiny_model, [prompt], SamplingParams(max_tokens=m, **greedy))
        assert len(out[0]) == m

    for n in (5, 20, 40):  # the token buckets 16, 32, 64
        call(n, 3)
    lengths = [(int(rng.integers(2, 64)), int(rng.integers(1, 64))) for _ in range(20)]
    assert len(set(lengths)) == 20
    with count_compiles() as compiles:
        for n, m in lengths:
            call(n, m)
    assert compiles.count == 0


def test_prompts_sharing_full_pages_compute_them_once(plain_model, tiny_config):
    """A common prefix (and the prompt of n > 1 samples) is prefilled once: the later
    sequences read the first one's full pages. Tokens equal each prompt alone."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(4, tiny_config.vocab_size, 40).tolist()
    prompts = [prefix + rng.integers(4, tiny_config.vocab_size, n).tolist() for n in (5, 9, 1)]
    prompts.append(prefix[:20])  # shares only the first page (16 tokens)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together, stats = jaxkv.generate_with_stats(plain_model, prompts, sp)
    alone = [jaxkv.generate(plain_model, [p], sp)[0] for p in prompts]
    assert together == alone
    # The 40-token prefix holds 2 full pages of 16: the two longer prompts read them from
    # the first; the 20-token prompt reads its first page.
    assert stats.computed_prompt_tokens == sum(map(len, prompts)) - 2 * 32 - 16
    greedy3 = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    forks, fork_stats = jaxkv.generate_with_stats(plain_model, [prompts[0]], greedy3)
    assert fork_stats.computed_prompt_tokens == 45 + 2 * (45 - 32)
    assert forks == jaxkv.generate_no_cache(plain_model, [prompts[0]], greedy3)
