"""Determinism: a request's tokens do not depend on how the engine happened to serve it.

Greedy tokens are identical whatever the batch composition, prefill chunk size, page size,
prefix hit or miss, or preemption; sampled tokens (temperature > 0) depend only on the
request's own seed. Logits are bitwise identical only for identical step shapes (see
docs/RELIABILITY.md); across shapes they differ in the last bits, which these tests show does
not change a token.
"""

import numpy as np
import pytest
from serving import assert_same_up_to_near_ties, drive

import jaxkv
from jaxkv import Engine, SamplingParams
from jaxkv.kv import init_state
from jaxkv.runtime.batch import PageTable, Row, build_batch, pow2
from jaxkv.runtime.sampling import SamplingArrays
from jaxkv.runtime.steps import make_steps

RNG = np.random.default_rng(21)
SHARED = RNG.integers(4, 97, 24).tolist()
PROBES = [SHARED + RNG.integers(4, 97, 9).tolist(), SHARED + RNG.integers(4, 97, 3).tolist(),
          RNG.integers(4, 97, 50).tolist(), RNG.integers(4, 97, 2).tolist()]
FILLER = [RNG.integers(4, 97, int(n)).tolist() for n in RNG.integers(5, 40, 6)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=20, seed=7, max_tokens=12,
                         ignore_eos=True)


@pytest.fixture(scope="module")
def alone(plain_model):
    """Each greedy probe served by itself, with its top-2 logprobs (for the near-tie rule),
    and the sampled probe through `jaxkv.generate`."""
    engine = Engine(plain_model, num_pages=128, max_num_seqs=8, max_model_len=128,
                    enable_prefix_caching=False)
    greedy = []
    for i, p in enumerate(PROBES):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=2))
        out = drive(engine)[str(i)].outputs[0]
        greedy.append((out.token_ids, out.logprobs))
    sampled = jaxkv.generate(plain_model, [PROBES[2]], SAMPLED)
    return greedy, sampled


SERVINGS = {
    # name: (Engine kwargs, companions, warm the prefix cache first, reverse arrival order)
    "one step per prompt": (dict(page_size=16, max_num_batched_tokens=512,
                                 enable_prefix_caching=False), False, False, False),
    "chunks of 8, page 4, busy": (dict(page_size=4, max_num_batched_tokens=8), True, False,
                                  False),
    "page 64, prefix hit": (dict(page_size=64, max_num_batched_tokens=64), True, True, False),
    "chunks of 5, reversed": (dict(page_size=8, max_num_batched_tokens=5), True, True, True),
    "preemption": (dict(page_size=4, num_pages=24, max_num_batched_tokens=32), True, False,
                   False),
}


@pytest.mark.parametrize("name", list(SERVINGS))
def test_tokens_do_not_depend_on_how_a_request_is_served(plain_model, alone, name):
    kwargs, companions, warm, reverse = SERVINGS[name]
    engine = Engine(plain_model, **{"num_pages": 128, "max_num_seqs": 8, "max_model_len": 128,
                                   **kwargs})
    if warm:  # served before the probes arrive: their shared prefix is then a cache hit
        engine.add_request("warm", prompt_token_ids=SHARED + [5], sampling_params=GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    work = [(f"p{i}", p, GREEDY) for i, p in enumerate(PROBES)] + [("s", PROBES[2], SAMPLED)]
    if companions:
        work += [(f"f{i}", f, GREEDY) for i, f in enumerate(FILLER)]
        work = work[::2] + work[1::2]  # interleave companions with the probes
    if reverse:
        work.reverse()
    final = {}
    for i, (rid, prompt, sp) in enumerate(work):
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=sp)
        if i % 3 == 2:  # arrivals spread over steps, so batches keep changing
            for out in engine.step():
                final[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
        engine.check()
    greedy, sampled = alone
    for i, ref in enumerate(greedy):
        assert_same_up_to_near_ties(final[f"p{i}"].outputs[0].token_ids, ref)
    assert [c.token_ids for c in final["s"].outputs] == sampled
    stats = engine.stats()
    if name == "preemption":
        assert stats.preemptions > 0
    if warm:
        assert final["p0"].num_cached_tokens == final["p1"].num_cached_tokens == len(SHARED)


def test_logits_are_bitwise_identical_for_identical_steps(plain_model):
    """Same state, same batch, same program: the same bits, run after run."""
    c = plain_model.config
    steps = make_steps(plain_model.graphdef, "reference")
    rows = [Row(0, PROBES[0], 0, [0, 1, 2]), Row(1, PROBES[2], 0, [3, 4, 5, 6])]
    total = sum(len(r.tokens) for r in rows)
    batch = build_batch(rows, PageTable(4, 8, 8, 16), tokens_bucket=pow2(max(total, 16)))
    results = []
    for _ in range(2):
        state = init_state(c, 8, 16)
        _, logits, _, state = steps.step(plain_model.params, state, batch,
                                         np.zeros((4, 2), np.uint32), SamplingArrays.greedy(4))
        results.append((np.asarray(logits), np.asarray(state.kv_pages)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
