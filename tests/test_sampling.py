"""Sampling: greedy, temperature, top-k, top-p, min-p, per-row keys; SamplingParams
validation; min-p through an engine's step and decode loop."""

import math

import jax
import numpy as np
import pytest
from sampling_ref import filtered_distribution

from jaxkv import SamplingParams
from jaxkv.runtime.sampling import CDF_BLOCK, SamplingArrays, argmax, request_key, sample


def _keys(n, seed=0):
    return np.stack([np.asarray(jax.random.key_data(jax.random.PRNGKey(seed + i)), np.uint32)
                     for i in range(n)])


def _draw(logits, n, **row):
    """n samples of one row of logits, each with its own key."""
    arrays = SamplingArrays.build([row.get("temperature", 1.0)] * n, [row.get("top_k", 0)] * n,
                                  [row.get("top_p", 1.0)] * n, [0] * n, n,
                                  min_p=[row.get("min_p", 0.0)] * n)
    return np.asarray(sample(np.tile(logits, (n, 1)), _keys(n), arrays))


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal((5, 50)).astype(np.float32)
    arrays = SamplingArrays.build([0.0] * 5, [0] * 5, [1.0] * 5, [0] * 5, 5)
    np.testing.assert_array_equal(np.asarray(sample(logits, _keys(5), arrays)),
                                  logits.argmax(-1))


@pytest.mark.parametrize("vocab", [7, CDF_BLOCK, 3 * CDF_BLOCK, 3 * CDF_BLOCK + 5, 49152 + 17])
def test_blockwise_argmax_is_numpys_first_largest_entry(vocab):
    """The block argmax (greedy sampling's) against numpy: random rows, ties across and within
    blocks (the first one wins), a maximum in the last partial block, all -inf."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((8, vocab)).astype(np.float32)
    x[1, [vocab // 3, vocab - 1]] = 9.0  # a tie between blocks: the first
    x[2, :] = 1.0  # every entry tied: entry 0
    x[3, vocab - 1] = 9.0  # the last entry (in the partial block when there is one)
    x[4, :] = -np.inf
    x[5, [vocab // 2, vocab - 1]] = np.inf
    x[6, [0, vocab // 2]] = 9.0
    x[7] = rng.integers(0, 3, vocab).astype(np.float32)  # many ties within blocks
    want = np.argmax(x, axis=-1)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), want)


def test_temperature_matches_softmax_frequencies():
    logits = np.log(np.array([0.5, 0.3, 0.2, 1e-9], np.float32))
    draws = _draw(logits, 4000, temperature=1.0)
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2, 0.0], atol=0.03, rtol=0)


def test_top_k_keeps_only_k_best():
    logits = np.array([3.0, 2.9, 2.8, 2.7, 0.0], np.float32)
    assert set(_draw(logits, 500, top_k=2).tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_covering_set():
    logits = np.log(np.array([0.6, 0.25, 0.1, 0.05], np.float32))
    # 0.6 < 0.7 so token 1 is needed; 0.85 >= 0.7 so tokens 2, 3 are cut.
    assert set(_draw(logits, 500, top_p=0.7).tolist()) == {0, 1}
    assert set(_draw(logits, 500, top_p=0.5).tolist()) == {0}


@pytest.mark.parametrize("vocab, row", [
    (40, dict(temperature=0.8, top_k=7)),
    (40, dict(temperature=1.3, top_p=0.6)),
    (40, dict(temperature=1.0, top_k=10, top_p=0.5)),
    # Past the candidate cap: top-k and the nucleus are found by bisection instead.
    (2000, dict(temperature=1.0, top_k=300)),
    (2000, dict(temperature=5.0, top_p=0.5)),
    (40, dict(temperature=1.0, min_p=0.1)),
    (40, dict(temperature=2.0, min_p=0.3)),
    (40, dict(temperature=1.0, min_p=0.05, top_k=12, top_p=0.8)),
])
def test_filtered_sampling_matches_the_exact_distribution(vocab, row):
    from jaxkv.runtime.sampling import TOP_K_CAP

    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(vocab) * 2).astype(np.float32)
    want = filtered_distribution(logits, **row)
    if vocab > TOP_K_CAP:  # the case really is past the cap
        assert np.count_nonzero(want) > TOP_K_CAP
    n = 6000
    draws = _draw(logits, n, **row)
    assert want[draws].min() > 0  # never a token outside the kept set
    if vocab <= 40:
        freq = np.bincount(draws, minlength=vocab) / n
        np.testing.assert_allclose(freq, want, atol=0.025, rtol=0)
    else:  # too many tokens for per-token frequencies: compare the kept set's size
        kept = np.count_nonzero(want)
        assert abs(len(set(draws.tolist())) - min(kept, n)) <= 0.35 * kept


def test_rows_use_their_own_keys_and_steps():
    logits = np.zeros((2, 1000), np.float32)
    keys = _keys(2)
    a = SamplingArrays.build([1.0, 1.0], [0, 0], [1.0, 1.0], [0, 0], 2)
    b = SamplingArrays.build([1.0, 1.0], [0, 0], [1.0, 1.0], [0, 1], 2)
    out_a = np.asarray(sample(logits, keys, a))
    out_b = np.asarray(sample(logits, keys, b))
    swapped = np.asarray(sample(logits, keys[::-1].copy(), a))
    assert out_a[0] == out_b[0] and out_a[1] != out_b[1]  # the step counter changes the draw
    np.testing.assert_array_equal(swapped, out_a[::-1])  # the key, not the row, decides


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(seed=2**64), "seed"),
    (dict(seed=1.5), "seed"), (dict(seed=True), "seed"), (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"), (dict(stop=5), "stop"),
    (dict(stop=[b"x"]), "stop"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=math.nan), "min_p"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_follow_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)


def test_every_bit_of_a_64_bit_seed_counts():
    """Seeds >= 2**32 must not alias their low word; a negative seed is its value modulo
    2**64 (as torch.Generator.manual_seed takes it); small seeds keep PRNGKey(seed)'s keys."""
    keys = {s: tuple(request_key(s)) for s in (5, 2**32 + 5, 2**63 + 5, 2**64 - 1)}
    assert len(set(keys.values())) == 4
    assert tuple(request_key(-1)) == keys[2**64 - 1]
    want = jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(5), 0))
    np.testing.assert_array_equal(request_key(5), np.asarray(want, np.uint32))
    with pytest.raises(ValueError, match="seed=18446744073709551616"):
        request_key(2**64)


def test_min_p_drops_rows_tokens_independently():
    """Two rows of one batch with different min_p: each keeps its own set (a row with min_p 0
    still draws the unlikely tokens), and a greedy row is unaffected."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 3, np.float32))
    n = 3000
    arrays = SamplingArrays.build([1.0, 1.0, 0.0] * n, [0] * (3 * n), [1.0] * (3 * n),
                                  [0] * (3 * n), 3 * n, min_p=[0.5, 0.0, 0.9] * n)
    draws = np.asarray(sample(np.tile(logits, (n, 1)), _keys(3 * n), arrays)).reshape(n, 3)
    assert set(draws[:, 0].tolist()) == {0, 1}  # 0.3 >= 0.5 x 0.5; 0.15 < 0.25
    assert set(draws[:, 1].tolist()) == {0, 1, 2, 3}
    assert set(draws[:, 2].tolist()) == {0}  # greedy


def test_min_p_in_an_engine_step_and_decode_loop(plain_model):
    """Through an Engine: every token sampled with min_p has probability >= min_p times the
    most likely one's (read from its logprobs, which run one step per token), and the same
    seeded request without logprobs (decode loops on device) draws the same tokens."""
    from jaxkv import Engine

    MIN_P = 0.8  # the random model's distributions are flat: a higher floor bites
    engine = Engine(plain_model, num_pages=64, max_num_seqs=4, max_model_len=96)
    prompt = list(range(5, 25))

    def run(**kw):
        sp = SamplingParams(temperature=1.0, min_p=MIN_P, seed=11, max_tokens=24, ignore_eos=True,
                            **kw)
        engine.add_request("r", prompt_token_ids=prompt, sampling_params=sp)
        while engine.has_unfinished_requests():
            outs = engine.step()
        return outs[0].outputs[0]

    with_lps, looped = run(logprobs=1), run()
    assert looped.token_ids == with_lps.token_ids
    for token, entry in zip(with_lps.token_ids, with_lps.logprobs, strict=True):
        best = max(lp.logprob for lp in entry.values())
        assert entry[token].logprob >= best + math.log(MIN_P) - 1e-5
    # min_p does something here: without it the same seed draws less likely tokens
    plain = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, logprobs=1)
    engine.add_request("p", prompt_token_ids=prompt, sampling_params=plain)
    while engine.has_unfinished_requests():
        outs = engine.step()
    free = outs[0].outputs[0]
    assert any(e[t].logprob < max(lp.logprob for lp in e.values()) + math.log(MIN_P)
               for t, e in zip(free.token_ids, free.logprobs, strict=True))
