"""Verification of speculated tokens (`jaxkv.runtime.spec_verify`): greedy rows keep exactly the
drafts that match the argmax, and sampled rows emit tokens distributed as the target alone,
for a one-hot proposer (n-gram) and for a draft model's distribution; a deliberately wrong
rule (resampling from p instead of the residual) is caught by the same statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.runtime.sampling import SamplingArrays, sample_tokens
from jaxkv.runtime.spec_verify import accept_drawn, target_probs, verify

V, K = 6, 3
N = 40_000  # trials per distribution check
TV_LIMIT = 0.02  # total variation of N samples over 6 outcomes is ~0.006


def _tv(samples, probs):
    counts = np.bincount(np.asarray(samples), minlength=len(probs)) / len(samples)
    return 0.5 * np.abs(counts - np.asarray(probs)).sum()


def _setup(seed):
    rng = np.random.default_rng(seed)
    p_logits = jnp.asarray(rng.normal(size=(K + 1, V)) * 1.5, jnp.float32)
    q_logits = jnp.asarray(rng.normal(size=(K, V)) * 1.5, jnp.float32)
    return p_logits, q_logits


def _probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    n = logits.shape[0]
    return target_probs(logits, jnp.full(n, temperature), jnp.full(n, top_k, jnp.int32),
                        jnp.full(n, top_p))


def test_greedy_rows_keep_the_drafts_matching_the_argmax():
    p_logits, _ = _setup(0)
    p = _probs(p_logits, temperature=0.0)[None]
    best = np.asarray(jnp.argmax(p_logits, -1))
    draft = np.array([[best[0], best[1], (best[2] + 1) % V]], np.int32)  # third is wrong
    keys, step = jnp.zeros((1, 2), jnp.uint32), jnp.zeros(1, jnp.int32)
    tokens, emitted = verify(p, jnp.asarray(draft), jnp.array([3]), keys, step)
    assert np.asarray(tokens)[0].tolist() == [best[0], best[1], best[2], -1]
    assert int(emitted[0]) == 3
    tokens, emitted = verify(p, jnp.asarray(best[None, :K]), jnp.array([3]), keys, step)
    assert np.asarray(tokens)[0].tolist() == best.tolist() and int(emitted[0]) == 4  # bonus
    tokens, emitted = verify(p, jnp.asarray(draft), jnp.array([0]), keys, step)  # no drafts
    assert np.asarray(tokens)[0].tolist() == [best[0], -1, -1, -1] and int(emitted[0]) == 1


def _trials(p, draft, q, seed):
    """verify() over N rows with distinct keys: the emitted tokens per row."""
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.PRNGKey(i)))(
        jnp.arange(seed * N, (seed + 1) * N)).astype(jnp.uint32)
    pp = jnp.broadcast_to(p, (N, *p.shape))
    qq = None if q is None else jnp.broadcast_to(q, (N, *q.shape))
    tokens, emitted = jax.jit(verify)(pp, draft, jnp.full(N, K), keys,
                                      jnp.zeros(N, jnp.int32), qq)
    return np.asarray(tokens), np.asarray(emitted)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
@pytest.mark.parametrize("filters", [dict(), dict(top_k=3, temperature=0.7),
                                     dict(top_p=0.8)])
def test_emitted_tokens_are_distributed_as_the_target_alone(proposer, filters):
    p_logits, q_logits = _setup(1)
    p = _probs(p_logits, **filters)
    rng = np.random.default_rng(2)
    if proposer == "ngram":  # the same draft every time (a lookup), one-hot q
        draft = jnp.broadcast_to(jnp.asarray(rng.integers(0, V, K), jnp.int32), (N, K))
        q = None
    else:  # drafts sampled from q, position by position
        q = jax.nn.softmax(q_logits, axis=-1)
        q64 = np.asarray(q, np.float64)
        q64 /= q64.sum(-1, keepdims=True)
        draft = jnp.asarray(np.stack([rng.choice(V, size=N, p=q64[i]) for i in range(K)], 1),
                            jnp.int32)
    tokens, emitted = _trials(p, draft, q, seed=3)
    assert _tv(tokens[:, 0], p[0]) < TV_LIMIT  # the first token: p_0 whatever was drafted
    # the second token where the first draft was kept: p_1 (the target after that draft)
    kept = (tokens[:, 0] == np.asarray(draft)[:, 0]) & (emitted >= 2)
    if proposer == "ngram":
        assert _tv(tokens[kept, 1], p[1]) < 2 * TV_LIMIT
    assert 1 <= emitted.min() and emitted.max() <= K + 1


def _coupled_trials(p_logits, draft, seed, temperature=1.0, top_k=0, top_p=1.0):
    """The engine's rule over N rows: each position drawn by the plain sampler (the row's key
    at that output index), drafts kept while they equal the draws (`accept_drawn`)."""
    k1 = K + 1
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.PRNGKey(i)))(
        jnp.arange(seed * N, (seed + 1) * N)).astype(jnp.uint32)
    rows = N * k1
    sampling = SamplingArrays.build([temperature] * rows, [top_k] * rows, [top_p] * rows,
                                    np.tile(np.arange(k1), N), rows)
    drawn = jax.jit(sample_tokens)(jnp.tile(p_logits, (N, 1)), jnp.repeat(keys, k1, axis=0),
                                   sampling).reshape(N, k1)
    tokens, emitted = jax.jit(accept_drawn)(drawn, draft, jnp.full(N, K))
    return np.asarray(tokens), np.asarray(emitted), np.asarray(drawn), keys


@pytest.mark.parametrize("filters", [dict(), dict(top_k=3, temperature=0.7),
                                     dict(top_p=0.8)])
def test_coupled_rule_emits_the_target_distribution_and_the_plain_draws(filters):
    p_logits, _ = _setup(1)
    p = np.asarray(_probs(p_logits, **filters))
    x = int(np.argsort(p[0])[-2])  # a likely, not the likeliest, first draft
    draft = jnp.broadcast_to(jnp.asarray([x, 1, 2], jnp.int32), (N, K))
    tokens, emitted, drawn, keys = _coupled_trials(p_logits, draft, seed=6, **filters)
    assert _tv(tokens[:, 0], p[0]) < TV_LIMIT
    kept = emitted >= 2
    assert _tv(tokens[kept, 1], p[1]) < 2 * TV_LIMIT
    np.testing.assert_allclose(kept.mean(), p[0][x], rtol=0, atol=0.01)  # min(1, p/q), q = 1
    # Every emitted token is the draw a plain step makes at that position with that key: a
    # sample's tokens are the same with or without speculation.
    for i in range(3):
        one = SamplingArrays.build([filters.get("temperature", 1.0)] * N,
                                   [filters.get("top_k", 0)] * N, [filters.get("top_p", 1.0)] * N,
                                   [i] * N, N)
        plain = np.asarray(sample_tokens(jnp.tile(p_logits[i:i + 1], (N, 1)), keys, one))
        live = emitted > i
        assert (tokens[live, i] == plain[live]).all() and (tokens[~live, i] == -1).all()
    assert (drawn[:, 0] == tokens[:, 0]).all()


def test_coupled_rule_keeps_drafts_only_while_they_match():
    drawn = jnp.asarray([[4, 5, 6, 7], [4, 9, 6, 7], [4, 5, 6, 7], [1, 2, 3, 0]], jnp.int32)
    draft = jnp.asarray([[4, 5, 6], [4, 5, 6], [4, 5, 6], [1, 2, 3]], jnp.int32)
    tokens, emitted = accept_drawn(drawn, draft, jnp.asarray([3, 3, 1, 0]))
    assert np.asarray(tokens).tolist() == [[4, 5, 6, 7], [4, 9, -1, -1], [4, 5, -1, -1],
                                           [1, -1, -1, -1]]
    assert np.asarray(emitted).tolist() == [4, 2, 2, 1]


def test_a_biased_acceptance_rule_fails_the_same_check():
    # The common mistake: a rejected draft resampled from p instead of max(p - q, 0). Its first
    # token over-weights the draft, P(x) = p(x) + (1 - p(x)) p(x): the check that verify()
    # passes must fail it.
    p_logits, _ = _setup(1)
    p = np.asarray(_probs(p_logits)[0], np.float64)
    x = int(np.argsort(p)[-2])  # a likely, not the likeliest, draft
    tokens, _ = _trials(jnp.asarray(_probs(p_logits)), jnp.full((N, K), x, jnp.int32), None,
                        seed=4)
    assert _tv(tokens[:, 0], p) < TV_LIMIT
    rng = np.random.default_rng(5)
    accept = rng.random(N) < p[x]
    wrong = np.where(accept, x, rng.choice(V, size=N, p=p / p.sum()))
    assert _tv(wrong, p) > 2 * TV_LIMIT


def test_target_probs_match_the_sampler_filters():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0, -3.0, 0.0]], jnp.float32)
    top2 = np.asarray(_probs(logits, top_k=2))[0]
    assert np.count_nonzero(top2) == 2 and top2[0] > top2[1] > 0
    np.testing.assert_allclose(top2.sum(), 1.0, rtol=0, atol=1e-6)
    greedy = np.asarray(_probs(logits, temperature=0.0))[0]
    assert greedy.tolist() == [1.0, 0, 0, 0, 0, 0]
    banned = np.asarray(target_probs(logits, jnp.ones(1), jnp.zeros(1, jnp.int32),
                                     jnp.ones(1), jnp.asarray([[0, -1]])))[0]
    assert banned[0] == 0 and banned[1] == banned.max()
