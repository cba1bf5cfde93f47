"""Speculative decoding through the engine (issue 29): n-gram prompt lookup,
self-speculation and a draft model, verified in the ragged step.

Greedy tokens equal decoding without speculation on random traces (shared prefixes, n = 2,
aborts, a pool small enough to preempt), with the page books checked after every step and
nothing left held when the engine is idle; sampled continuations are distributed as without
speculation, and a deliberately biased acceptance rule fails the same statistic.
"""

import dataclasses
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import Engine, SamplingParams
from jaxkv.config import SpeculativeConfig
from jaxkv.runtime import steps as steps_module
from jaxkv.spec.ngram import ngram_drafts

SHAPE = dict(page_size=4, num_pages=40, max_num_seqs=4, max_model_len=96,
             max_num_batched_tokens=32)
# speculating at every batch size, so the traces' company speculates too
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None,
         "min_draft_tokens": 1}
SELF = {"method": "self", "num_speculative_tokens": 3, "num_draft_layers": 1,
        "min_acceptance_rate": 0.0,  # keeps speculating, whatever the random draft's rate
        "disable_by_batch_size": None}
# a quantized copy of the target drafts (it mostly agrees with the target, not always)
DRAFT = {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3,
         "min_acceptance_rate": 0.0, "disable_by_batch_size": None}


def test_ngram_drafts_take_the_latest_longest_match():
    seq = [1, 2, 3, 9, 1, 2, 4, 7, 5, 2, 3, 8, 6, 1, 2]
    # "1 2" last occurs at 4 (followed by 4 7 5); the suffix itself is not a match
    assert ngram_drafts(seq, 3, 1, 3) == [4, 7, 5]
    # a longer suffix wins: "6 1 2" never occurred, "2 3" did not end it... "x 1 2" neither
    assert ngram_drafts([7, 1, 2, 3, 0, 1, 2, 5, 7, 1, 2], 2, 2, 3) == [3, 0]
    assert ngram_drafts([1, 2, 3, 4], 3, 2, 3) == []  # nothing repeats
    assert ngram_drafts([1, 2, 1, 2], 5, 2, 2) == [1, 2]  # cut at the sequence's end
    assert ngram_drafts([4], 3, 1, 2) == []


def test_config_errors_name_the_field(tiny_model):
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="num_speculative_tokenz"):
        Engine(tiny_model, num_pages=16, speculative_config={"num_speculative_tokenz": 2})
    with pytest.raises(ValueError, match="not JSON"):
        Engine(tiny_model, num_pages=16, speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="num_draft_layers=2"):
        Engine(tiny_model, num_pages=16, speculative_config={"method": "self",
                                                             "num_draft_layers": 2})
    with pytest.raises(ValueError, match="speculate"):
        SamplingParams(speculate="no")
    with pytest.raises(ValueError, match="num_draft_layers is for method 'self'"):
        SpeculativeConfig(method="ngram", num_draft_layers=3)
    with pytest.raises(ValueError, match="min_draft_tokens"):
        SpeculativeConfig(num_speculative_tokens=1, min_draft_tokens=2)
    with pytest.raises(ValueError, match="needs a model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="model is for method 'draft_model'"):
        SpeculativeConfig(method="ngram", model="smollm2")
    with pytest.raises(ValueError, match="quantization must be one of"):
        SpeculativeConfig(method="draft_model", quantization="int3")
    other = dataclasses.replace(tiny_model.config, vocab_size=tiny_model.config.vocab_size + 1)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary"):
        Engine(tiny_model, num_pages=16, speculative_config={
            "method": "draft_model", "model": jaxkv.random_model(other)})
    int8 = jaxkv.random_model(tiny_model.config, quantization="int8")
    with pytest.raises(ValueError, match="speculative_config.quantization: the target is "):
        Engine(int8, num_pages=16, speculative_config={"method": "draft_model",
                                                       "quantization": "int4"})
    with pytest.raises(ValueError, match="speculative_config.quantization='int4', but the "):
        Engine(tiny_model, num_pages=16, speculative_config={
            "method": "draft_model", "model": int8, "quantization": "int4"})
    with pytest.raises(ValueError, match="speculative_config.model='/nowhere'"):
        Engine(tiny_model, num_pages=16, speculative_config={"method": "draft_model",
                                                             "model": "/nowhere"})
    assert SpeculativeConfig(num_speculative_tokens=1).min_drafts == 1  # the default follows k
    assert SpeculativeConfig.of("null") is None
    # the default k follows the method, also through dataclasses.replace
    assert SpeculativeConfig().k == 7
    assert dataclasses.replace(SpeculativeConfig(), method="self").k == 3
    engine = Engine(tiny_model, num_pages=16, speculative_config='{"num_speculative_tokens": 2}')
    assert engine.config.scheduler.speculative_config == SpeculativeConfig(
        num_speculative_tokens=2)


def _run(model, requests, spec, *, aborts=(), **shape):
    """Runs ``requests`` ((rid, prompt, SamplingParams, arrival step)); returns the finished
    outputs by id and the engine. The page books are checked after every step."""
    return _run_on(Engine(model, **{**SHAPE, **shape}, speculative_config=spec), requests,
                   aborts)


def _run_on(engine, requests, aborts=()):
    done, aborted = {}, set()
    for step in range(600):
        for rid, prompt, sp, arrive in requests:
            if arrive == step:
                engine.add_request(rid, prompt_token_ids=prompt, sampling_params=sp)
        for rid, at in aborts:
            if at == step and engine.has_request(rid):
                engine.abort(rid)
                aborted.add(rid)
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                done[out.request_id] = out
        engine.check()
        if step > max(r[3] for r in requests) and not engine.has_unfinished_requests():
            break
    else:
        raise AssertionError("the requests did not finish")
    stats = engine.stats()
    assert stats.kv_pages_used == 0  # only the prefix cache holds pages once idle
    assert stats.kv_pages_cached + stats.kv_pages_free == stats.kv_pages_total
    return done, engine


@st.composite
def traces(draw):
    """Prompts with repeats (so n-gram lookup finds drafts), some sharing a prefix."""
    shared = draw(st.lists(st.integers(4, 96), min_size=2, max_size=9))
    requests, aborts = [], []
    for i in range(draw(st.integers(2, 5))):
        chunk = draw(st.lists(st.integers(4, 96), min_size=2, max_size=6))
        prompt = draw(st.sampled_from([[], shared])) + chunk * draw(st.integers(1, 3))
        n = draw(st.sampled_from([1, 1, 2]))
        sp = SamplingParams(n=n, temperature=0, max_tokens=draw(st.integers(1, 24)),
                            ignore_eos=True, logprobs=draw(st.sampled_from([None, 2])))
        requests.append((f"r{i}", prompt, sp, draw(st.integers(0, 4))))
        if draw(st.integers(0, 4)) == 0:
            aborts.append((f"r{i}", requests[-1][3] + draw(st.integers(0, 6))))
    return requests, aborts


def _check_greedy_trace(model, trace, spec):
    requests, aborts = trace
    want, _ = _run(model, requests, None, aborts=aborts)
    got, engine = _run(model, requests, spec, aborts=aborts)
    # an abort may land before or after a request finished: compare what finished in both
    never_aborted = {r[0] for r in requests} - {rid for rid, _ in aborts}
    assert never_aborted <= got.keys() & want.keys()
    for rid in got.keys() & want.keys():
        a, b = got[rid].outputs, want[rid].outputs
        assert [c.token_ids for c in a] == [c.token_ids for c in b], rid
        for x, y in zip(a, b, strict=True):
            if y.logprobs is not None:  # the emitted tokens' logprobs are the plain ones
                assert [set(d) for d in x.logprobs] == [set(d) for d in y.logprobs]
                np.testing.assert_allclose(
                    [d[t].logprob for d, t in zip(x.logprobs, x.token_ids, strict=True)],
                    [d[t].logprob for d, t in zip(y.logprobs, y.token_ids, strict=True)],
                    rtol=0, atol=1e-5)
    return engine.stats()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_greedy_ngram_equals_plain_decoding_on_random_traces(plain_model, trace):
    _check_greedy_trace(plain_model, trace, NGRAM)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_greedy_self_speculation_equals_plain_decoding_on_random_traces(plain_model, trace):
    _check_greedy_trace(plain_model, trace, SELF)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_greedy_draft_model_equals_plain_decoding_on_random_traces(plain_model, tiny_config,
                                                                  trace):
    """With the target's own weights as the draft, every draft is accepted only if the draft's
    books hold through the traces' aborts, forks and shared prefixes."""
    copy = jaxkv.random_model(tiny_config, seed=0)
    stats = _check_greedy_trace(plain_model, trace, {**DRAFT, "quantization": None,
                                                     "model": copy})
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens


@pytest.mark.parametrize("spec", [NGRAM, SELF, DRAFT], ids=["ngram", "self", "draft"])
def test_speculation_accepts_drafts_under_preemption(plain_model, spec):
    """A fixed trace that does speculate, accept and preempt (so the random traces' property
    means something), with the counters in stats and in each request's metrics."""
    cycle = [11, 12, 13, 14, 15, 16]
    requests = [(f"r{i}", cycle * 3 + [20 + i], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True), 0) for i in range(4)]
    want, _ = _run(plain_model, requests, None, num_pages=24)
    got, engine = _run(plain_model, requests, spec, num_pages=24)
    stats = engine.stats()
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == \
        {k: v.outputs[0].token_ids for k, v in want.items()}
    assert stats.preemptions > 0
    assert stats.spec_verifications > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_draft_tokens == sum(o.metrics.num_draft_tokens for o in got.values())
    assert stats.spec_accepted_tokens == sum(o.metrics.num_accepted_tokens
                                             for o in got.values())
    assert all(o.metrics.num_draft_tokens > 0 for o in got.values())  # each speculated


def test_opt_out_and_processors_do_not_speculate(plain_model):
    cycle = [11, 12, 13, 14, 15, 16]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculate=False)
    penal = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                           repetition_penalty=1.3)
    got, engine = _run(plain_model, [("a", cycle * 3, plain, 0), ("b", cycle * 3, penal, 0)],
                       NGRAM)
    assert engine.stats().spec_verifications == 0
    assert all(o.metrics.num_draft_tokens == 0 for o in got.values())


def _trust_first_draft(drawn, draft, num_draft):
    """A wrong rule: the first draft is kept unchecked (a proposer trusted for one token), the
    rest while they match the draws; drafts are over-weighted."""
    k = draft.shape[1]
    pos = jnp.arange(k)[None]
    ok = ((drawn[:, :k] == draft) | (pos == 0)) & (pos < num_draft[:, None])
    kept = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    padded = jnp.concatenate([draft, jnp.zeros_like(draft[:, :1])], axis=1)
    at = jnp.take_along_axis(drawn, kept[:, None], axis=1)
    cols = jnp.arange(k + 1)[None]
    tokens = jnp.where(cols < kept[:, None], padded, jnp.where(cols == kept[:, None], at, -1))
    return tokens.astype(jnp.int32), kept + 1


def _tv(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[x] / na - b[x] / nb) for x in set(a) | set(b))


N_SAMPLES = 2000
TV_LIMIT = 0.08  # two samples of 2000 from the same 16-ish outcomes differ by ~0.04


def _continuations(model, prompt, spec):
    """(second, third) output tokens of N_SAMPLES seeded requests (the first comes from the
    prefill, which never speculates; the two after it from one verification of two drafts),
    the tokens by seed, and the engine's stats."""
    engine = Engine(model, page_size=4, num_pages=512, max_num_seqs=32, max_model_len=64,
                    max_num_batched_tokens=256, speculative_config=spec)
    sp = dict(temperature=0.05, top_k=4, max_tokens=4, ignore_eos=True)
    for i in range(N_SAMPLES):
        engine.add_request(str(i), prompt_token_ids=prompt,
                           sampling_params=SamplingParams(seed=i, **sp))
    seen, by_seed = Counter(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                seen[tuple(out.outputs[0].token_ids[1:3])] += 1
                by_seed[out.request_id] = out.outputs[0].token_ids
    return seen, by_seed, engine.stats()


@pytest.fixture
def cycling_prompt(plain_model):
    """A prompt ending in the model's own greedy cycle: n-gram lookup drafts its likely
    continuations, which a temperature of 0.05 keeps among several (not one) likely tokens."""
    base = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]
    done, _ = _run(plain_model, [("g", base, SamplingParams(temperature=0, max_tokens=12,
                                                             ignore_eos=True), 0)], None)
    return base + done["g"].outputs[0].token_ids


def test_sampled_continuations_are_distributed_as_without_speculation(plain_model,
                                                                     cycling_prompt,
                                                                     monkeypatch):
    plain, plain_tokens, _ = _continuations(plain_model, cycling_prompt, None)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 0.0,
            "disable_by_batch_size": None, "min_draft_tokens": 0}  # every row that can
    fast, fast_tokens, stats = _continuations(plain_model, cycling_prompt, spec)
    assert len(plain) >= 4  # several outcomes, none a sure winner
    assert max(plain.values()) < 0.8 * N_SAMPLES
    assert stats.spec_accepted_tokens > N_SAMPLES // 4  # drafts were kept, and rejected
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert _tv(fast, plain) < TV_LIMIT
    # More than the distribution: each seed's tokens are the ones it gets without speculation.
    assert fast_tokens == plain_tokens
    # The same statistic catches a biased rule through the same engine.
    monkeypatch.setattr(steps_module, "accept_drawn", _trust_first_draft)
    steps_module.make_steps.cache_clear()  # so the programs trace the rule again
    try:
        biased, _, _ = _continuations(plain_model, cycling_prompt, spec)
    finally:
        steps_module.make_steps.cache_clear()
    assert _tv(biased, plain) > 1.5 * TV_LIMIT


@pytest.mark.parametrize("spec", [NGRAM, SELF, DRAFT], ids=["ngram", "self", "draft"])
def test_warmup_compiles_every_speculative_program(plain_model, spec):
    from jaxkv.runtime.compiles import count_compiles

    engine = Engine(plain_model, **SHAPE, speculative_config=spec)
    assert any(kind == "verify" for kind, _ in engine.programs())
    engine.warmup()
    cycle = [11, 12, 13, 14, 15, 16]
    with count_compiles() as compiles:
        _run_on(engine, [(str(i), cycle * (i + 2), SamplingParams(
            temperature=0.5 * (i % 2), seed=i, max_tokens=20, ignore_eos=True,
            logprobs=1 if i == 2 else None), 0) for i in range(3)])
    assert engine.stats().spec_verifications > 0
    assert compiles.count == 0


@st.composite
def seeded_traces(draw):
    """A seeded sampled probe (prompt with repeats, so n-gram lookup drafts), a speculation
    method with a batch-size cut-off, and companions arriving around it."""
    cycle = draw(st.lists(st.integers(4, 96), min_size=2, max_size=5))
    probe = SamplingParams(
        n=draw(st.sampled_from([1, 2])), seed=draw(st.integers(0, 2**63)),
        temperature=draw(st.sampled_from([0.3, 0.8, 1.0])),
        top_k=draw(st.sampled_from([0, 5])), top_p=draw(st.sampled_from([1.0, 0.9])),
        max_tokens=draw(st.integers(6, 20)), ignore_eos=True,
        logprobs=draw(st.sampled_from([None, 1])))
    spec = draw(st.sampled_from([NGRAM, SELF, DRAFT]))
    spec = {**spec, "disable_by_batch_size": draw(st.sampled_from([None, 1, 2, 3]))}
    companions = []
    for i in range(draw(st.integers(1, 3))):
        prompt = draw(st.lists(st.integers(4, 96), min_size=2, max_size=5)) * 2
        sp = SamplingParams(temperature=draw(st.sampled_from([0, 0.9])),
                            max_tokens=draw(st.integers(2, 20)), ignore_eos=True)
        companions.append((f"c{i}", prompt, sp, draw(st.integers(0, 3))))
    return cycle * draw(st.integers(2, 4)), probe, spec, companions


def _check_seeded_probe(model, trace):
    prompt, probe, spec, companions = trace
    solo = [("probe", prompt, probe, 0)]
    want, _ = _run(model, solo, None)
    alone, _ = _run(model, solo, spec)
    crowd, _ = _run(model, solo + companions, spec)
    tokens = [c.token_ids for c in want["probe"].outputs]
    assert [c.token_ids for c in alone["probe"].outputs] == tokens
    assert [c.token_ids for c in crowd["probe"].outputs] == tokens


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=seeded_traces())
def test_a_seeded_request_samples_the_same_alone_or_in_company(plain_model, trace):
    """A seeded request's tokens depend only on its seed: the same without speculation, with
    it alone, and beside companions that switch speculation off (disable_by_batch_size) and
    on again as they come and go, for every method."""
    _check_seeded_probe(plain_model, trace)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=seeded_traces())
def test_a_seeded_request_samples_the_same_alone_or_in_company_sweep(plain_model, trace):
    _check_seeded_probe(plain_model, trace)


@pytest.mark.parametrize("spec", [NGRAM, SELF, DRAFT], ids=["ngram", "self", "draft"])
def test_seeded_sampling_with_the_default_cut_off(plain_model, cycling_prompt, spec):
    """The audit's case: temperature 0.8 (0.05 for n-gram lookup: the random model's flat
    logits leave hotter samples without matches), seed 1234, the default
    disable_by_batch_size (2), alone (speculating) and with two companions (not speculating
    while they run)."""
    temperature = 0.05 if spec["method"] == "ngram" else 0.8
    spec = {k: v for k, v in spec.items() if k != "disable_by_batch_size"}
    probe = [("probe", cycling_prompt, SamplingParams(temperature=temperature, seed=1234,
                                                      max_tokens=24, ignore_eos=True), 0)]
    company = [(f"c{i}", [30 + i, 31, 32], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True), 2) for i in range(2)]
    want, _ = _run(plain_model, probe, None)
    alone, engine = _run(plain_model, probe, spec)
    assert engine.stats().spec_verifications > 0
    crowd, _ = _run(plain_model, probe + company, spec)
    assert alone["probe"].outputs[0].token_ids == want["probe"].outputs[0].token_ids
    assert crowd["probe"].outputs[0].token_ids == want["probe"].outputs[0].token_ids


def _recording(draft):
    """Wraps ``draft.propose`` to record (context, drafts): each proposal's sequence up to
    its pending token, and the tokens drafted after it."""
    seen, propose = [], draft.propose

    def record(runner, rows):
        out = propose(runner, rows)
        got = np.asarray(out)
        for i, row in enumerate(rows):
            if not row.num_draft:
                continue
            context = tuple(row.request.token_ids[:row.start]) + (row.tokens[0],)
            seen.append((context, [int(t) for t in got[:row.num_draft, i]]))
        return out
    draft.propose = record
    return seen


@pytest.mark.parametrize("same", [True, False], ids=["copy", "other"])
def test_draft_model_proposes_its_own_greedy_continuation(plain_model, tiny_config, same):
    """The draft's pool is kept by its own books (which positions of each sequence it holds),
    through prefix-cache hits (pages it never wrote), prompts longer than a step (filled in
    chunks), decode loops it did not see (more running than disable_by_batch_size), rejected
    drafts (their K/V is stale) and preemption (new pages). Each proposal must be the draft
    model's own greedy continuation of the sequence, computed apart by a plain engine of the
    draft: stale or missing K/V changes it. A draft with the target's very weights has every
    draft accepted; a different one has most rejected (so the rollback is exercised)."""
    draft = jaxkv.random_model(tiny_config, seed=0 if same else 1)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "disable_by_batch_size": 2, "min_draft_tokens": 1, "min_acceptance_rate": 0.0}
    shared = [(7 * i) % 90 + 4 for i in range(40)]  # > max_num_batched_tokens: chunked fills
    crowd = [(f"r{i}", shared + [10 + i, 20 + i], SamplingParams(
        temperature=0, max_tokens=16 + 10 * i, ignore_eos=True), i % 2) for i in range(4)]
    # one long request speculating alone, and short ones arriving now and then: each runs
    # beside it in decode loops without speculation (after rejections of its drafts)
    spaced = [("long", shared[:20], SamplingParams(temperature=0, max_tokens=60,
                                                   ignore_eos=True), 0)]
    spaced += [(f"s{i}", [30 + i, 31, 32], SamplingParams(temperature=0, max_tokens=9,
                                                          ignore_eos=True), 3 + 7 * i)
               for i in range(4)]
    seen = []
    for requests, company in ((crowd, 2), (spaced, 1)):
        want, _ = _run(plain_model, requests, None, num_pages=30)
        engine = Engine(plain_model, **{**SHAPE, "num_pages": 30}, speculative_config={
            **spec, "disable_by_batch_size": company})
        proposals = _recording(engine.runner.draft_model)
        got, engine = _run_on(engine, requests)
        seen += proposals
        assert {k: v.outputs[0].token_ids for k, v in got.items()} == \
            {k: v.outputs[0].token_ids for k, v in want.items()}
        stats = engine.stats()
        assert stats.spec_draft_tokens > 30
        if same:
            assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        else:
            assert stats.spec_accepted_tokens < stats.spec_draft_tokens // 2
        if requests is crowd:
            assert stats.preemptions > 0 and stats.cached_prompt_tokens > 0
    assert len(seen) > 20
    apart = Engine(draft, **{**SHAPE, "num_pages": 60})
    for i, (context, drafts) in enumerate(seen):
        apart.add_request(str(i), prompt_token_ids=list(context), sampling_params=SamplingParams(
            temperature=0, max_tokens=len(drafts), ignore_eos=True))
    own = {}
    while apart.has_unfinished_requests():
        own.update({o.request_id: o.outputs[0].token_ids for o in apart.step() if o.finished})
    assert [own[str(i)] for i in range(len(seen))] == [d for _, d in seen]


class Sequence:  # what the books read of a sequence (hashable by identity, as Request is)
    num_preemptions, finish_reason = 0, None


def test_draft_books_forget_a_preempted_sequence(plain_model):
    """What the draft's pool holds of a sequence falls to its accepted tokens after a
    verification, and to nothing once it was preempted (its pages may be others now)."""
    draft = Engine(plain_model, **SHAPE, speculative_config=DRAFT).runner.draft_model
    seq = Sequence()
    draft.wrote(seq, 12)
    assert draft.held(seq) == 12
    draft.settle(seq, 9)
    assert draft.held(seq) == 9
    draft.settle(seq, 11)  # never more than it wrote
    assert draft.held(seq) == 9
    seq.num_preemptions = 1
    assert draft.held(seq) == 0
