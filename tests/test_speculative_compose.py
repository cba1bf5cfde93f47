"""Speculative decoding composed with the rest of the engine (issue 29): int8 KV pages, the host
KV tier, `update_params` and prefill/decode disaggregation (the decode side speculates). Each
serves the greedy tokens of the same engine without speculation, and does speculate and
accept; tensor parallelism is in tests/multidevice/test_tensor_parallel.py.
"""

import jax
import numpy as np
import pytest
from serving import drive
from test_speculative import DRAFT, NGRAM, SHAPE, _run

import jaxkv
from jaxkv import Engine, SamplingParams
from jaxkv.disagg import DisaggregatedEngine, kv_transfer

CYCLE = [11, 12, 13, 14, 15, 16]


def _cycles(n=4, max_tokens=30):
    """Prompts that repeat (n-gram lookup finds drafts), each with its own last token."""
    return [(f"r{i}", CYCLE * 3 + [20 + i], SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True), 0) for i in range(n)]


def _tokens(done):
    return {k: [c.token_ids for c in v.outputs] for k, v in done.items()}


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_speculation_composes_with_int8_kv(plain_model, spec):
    """Over int8 pages (drafts' K/V quantized as they are written, rejected ones rolled back;
    a draft model's own pool int8 too): the same engine's greedy tokens without speculation."""
    shape = dict(num_pages=24, kv_cache_dtype="int8")  # preempts too
    want, _ = _run(plain_model, _cycles(), None, **shape)
    got, engine = _run(plain_model, _cycles(), spec, **shape)
    assert _tokens(got) == _tokens(want)
    assert engine.stats().spec_accepted_tokens > 0


def _turns(engine, turns=3, convs=5):
    """Multi-turn conversations on a pool that keeps about two: later turns' histories come
    back from the host tier (when there is one) or are recomputed."""
    rng = np.random.default_rng(0)
    history = {c: (CYCLE * 2 + rng.integers(20, 96, 6).tolist()) for c in range(convs)}
    outs = {}
    for turn in range(turns):
        for c in range(convs):
            prompt = history[c] + CYCLE[:3]
            engine.add_request(f"{c}-{turn}", prompt_token_ids=prompt, sampling_params=(
                SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
            outs[f"{c}-{turn}"] = drive(engine)[f"{c}-{turn}"].outputs[0].token_ids
            history[c] = prompt + outs[f"{c}-{turn}"]
    return outs


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_speculation_composes_with_the_host_tier(plain_model, spec):
    """Prefixes loaded back from host memory (the draft's pool holds nothing of them: it
    fills them as for any prefix hit), every freed page poisoned with NaN."""
    shape = dict(SHAPE, num_pages=24, max_num_seqs=2, host_kv_cache_bytes=2**20,
                 debug_nan_freed_pages=True)
    want = _turns(Engine(plain_model, **shape))
    engine = Engine(plain_model, **shape, speculative_config=spec)
    assert _turns(engine) == want
    stats = engine.stats()
    assert stats.host_hit_tokens > 0 and stats.spec_accepted_tokens > 0


def _serve(engine, prompts, tag, max_tokens=16):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True))
    done = drive(engine)
    return [done[f"{tag}{i}"].outputs[0].token_ids for i in range(len(prompts))]


def _spec_counts(engine):
    s = engine.stats()
    return s.spec_verifications, s.spec_draft_tokens, s.spec_accepted_tokens


def test_update_params_requantizes_a_draft_that_copies_the_target(plain_model, tiny_config):
    """With ``quantization`` alone the draft is the target quantized: new weights are
    quantized for it too, so after the update the engine drafts, accepts and emits exactly
    what a fresh engine of the new weights does. A draft of its own keeps its weights."""
    new = jaxkv.random_model(tiny_config, seed=5)
    prompts = [CYCLE * 2 + [20 + i] for i in range(3)]
    copy = {**DRAFT, "quantization": "int4-g32"}
    engine = Engine(plain_model, **SHAPE, speculative_config=copy)
    _serve(engine, prompts, "a")
    before = _spec_counts(engine)
    engine.update_params(new)
    got = _serve(engine, prompts, "b")
    after = [x - y for x, y in zip(_spec_counts(engine), before, strict=True)]
    fresh = Engine(new, **SHAPE, speculative_config=copy)
    assert got == _serve(fresh, prompts, "b") == _serve(Engine(new, **SHAPE), prompts, "c")
    assert after == list(_spec_counts(fresh)) and after[2] > 0
    drafter = engine.runner.draft_model
    want = jaxkv.quantize(new, "int4-g32").params
    for a, b in zip(jax.tree.leaves(drafter.model.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    own = Engine(plain_model, **SHAPE, speculative_config={
        **DRAFT, "quantization": None, "model": jaxkv.random_model(tiny_config, seed=0)})
    kept = jax.tree.leaves(own.runner.draft_model.model.params)
    own.update_params(new)
    assert all(a is b for a, b in zip(kept, jax.tree.leaves(own.runner.draft_model.model.params),
                                      strict=True))
    assert _serve(own, prompts, "d") == got  # exact: drafts only propose


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_the_decode_side_of_disaggregation_speculates(plain_model, spec):
    """Prompts prefilled on one engine, their pages moved to a decode engine that speculates
    (a draft model fills its own pool from the handed-off sequence's tokens)."""
    shape = dict(page_size=4, max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32)

    def pair(decode_spec):
        return DisaggregatedEngine(
            Engine(plain_model, **shape, num_pages=40),
            Engine(plain_model, **shape, num_pages=40, speculative_config=decode_spec),
            lockstep=True, transport=kv_transfer.PageMover)

    prompts = [CYCLE * 3 + [20 + i] for i in range(4)]
    plain, speculating = pair(None), pair(spec)
    assert _serve(speculating, prompts, "s", 60) == _serve(plain, prompts, "s", 60)
    assert _spec_counts(speculating.decode)[2] > 0
