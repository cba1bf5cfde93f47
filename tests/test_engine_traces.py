"""Random serving traces (hypothesis): arrivals over time, aborts, shared prefixes, varied
prompt and output lengths, and a page pool small enough to force eviction and preemption.

After every step the page invariants hold (no page leaked or double-owned); every request that
was not aborted finishes; its tokens (greedy, seeded samples with n = 2, or greedy under
penalties and a logit bias) equal running that request alone; when the engine is idle, only
the prefix cache holds pages.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv import Engine, SamplingParams
from jaxkv.engine.plan import SchedulerOutput
from jaxkv.runtime.page_copy import fill_pages

# One engine shape for every example, so all examples share compiled programs.
SHAPE = dict(page_size=4, num_pages=24, max_num_seqs=4, max_model_len=64,
             max_num_batched_tokens=16)


_ALONE: dict = {}


def _alone(model, prompt: tuple, sp: SamplingParams) -> list:
    """Tokens of every sample of one request run by itself in an engine of the same shape
    (memoized across examples): greedy or seeded, they must not depend on the company."""
    key = (prompt, repr(sp))
    if key not in _ALONE:
        engine = Engine(model, **SHAPE)
        engine.add_request("alone", prompt_token_ids=list(prompt), sampling_params=sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    _ALONE[key] = [c.token_ids for c in out.outputs]
    return _ALONE[key]


def _params(kind: int, max_tokens: int, seed: int) -> SamplingParams:
    """Greedy; sampled with n = 2 (top-k, top-p); greedy under penalties and a bias."""
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if kind == 1:
        return SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, seed=seed,
                              max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          repetition_penalty=1.5, presence_penalty=0.5, logit_bias={7: 3.0})


@st.composite
def traces(draw):
    prefixes = [draw(st.lists(st.integers(4, 96), min_size=1, max_size=12)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(2, 6))):
        head = draw(st.sampled_from([[], *prefixes]))
        tail = draw(st.lists(st.integers(4, 96), min_size=1, max_size=10))
        requests.append(dict(
            rid=f"r{i}", prompt=head + tail, max_tokens=draw(st.integers(1, 10)),
            arrive=draw(st.integers(0, 6)),  # the step at which it is added
            abort=draw(st.one_of(st.none(), st.integers(0, 12))),  # steps after arrival
            kind=draw(st.integers(0, 2)),  # see _params
        ))
    return requests


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_random_traces_keep_invariants_and_outputs(tiny_model, trace):
    _check_trace(tiny_model, trace)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_random_traces_keep_invariants_and_outputs_long(tiny_model, trace):
    _check_trace(tiny_model, trace)


def _check_trace(tiny_model, trace):
    engine = Engine(tiny_model, **SHAPE)
    finished, aborted, added = {}, set(), {}
    for step in range(400):
        for r in trace:
            if r["arrive"] == step:
                engine.add_request(r["rid"], prompt_token_ids=r["prompt"],
                                   sampling_params=_params(r["kind"], r["max_tokens"], step))
                added[r["rid"]] = step
            abort_at = None if r["abort"] is None else r["arrive"] + r["abort"]
            if abort_at == step and r["rid"] in added and r["rid"] not in finished:
                engine.abort(r["rid"])
                aborted.add(r["rid"])
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                finished[out.request_id] = out
        engine.check()
        if len(added) == len(trace) and not engine.has_unfinished_requests():
            break
    else:
        raise AssertionError("the trace did not finish")

    stats = engine.stats()
    assert stats.kv_pages_used == 0  # only the prefix cache may still hold pages
    assert stats.kv_pages_cached + stats.kv_pages_free == stats.kv_pages_total
    for r in trace:
        if r["rid"] in aborted:
            continue
        out = finished[r["rid"]]
        assert all(c.finish_reason == "length" for c in out.outputs)
        want = _alone(tiny_model, tuple(r["prompt"]),
                      _params(r["kind"], r["max_tokens"], r["arrive"]))
        assert [c.token_ids for c in out.outputs] == want, r


def test_trace_strategy_reaches_preemption(tiny_model):
    # The shape above must actually force preemption for the property test to mean something.
    engine = Engine(tiny_model, **SHAPE)
    rng = np.random.default_rng(0)
    for i in range(4):
        engine.add_request(str(i), prompt_token_ids=rng.integers(4, 96, 20).tolist(),
                           sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                          ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
    assert engine.stats().preemptions > 0


def _run_heavy_recycling(model, **kw):
    engine = Engine(model, **SHAPE, **kw)
    rng = np.random.default_rng(1)
    shared = rng.integers(4, 96, 9).tolist()
    for i in range(6):
        prompt = (shared if i % 2 else []) + rng.integers(4, 96, 12).tolist()
        engine.add_request(str(i), prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True))
    outs, poisoned = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        engine.check()
        free = [p for p in range(engine.num_pages) if engine.allocator.refcount(p) == 0]
        k = np.asarray(engine.state.kv_pages)
        poisoned += int(np.isnan(k[:, :, free]).any()) if free else 0
    return outs, engine.stats(), poisoned


@pytest.mark.parametrize("caching", [False, True])
def test_nan_filled_freed_pages_change_nothing(tiny_model, caching):
    clean, stats, _ = _run_heavy_recycling(tiny_model, enable_prefix_caching=caching)
    dirty, _, poisoned = _run_heavy_recycling(tiny_model, enable_prefix_caching=caching,
                                              debug_nan_freed_pages=True)
    assert stats.preemptions > 0  # pages were recycled under pressure
    if not caching:  # with caching, finished requests' pages stay in the cache, not free
        assert poisoned > 0  # the option really wrote NaN into free pages
    assert dirty == clean


def _run_forks(model, seed, **kw):
    """Sampled requests with n = 1..3 forks, shared prefixes and a pool small enough that
    forks copy-on-write shared pages while siblings are preempted and the cache is evicted."""
    engine = Engine(model, **SHAPE, **kw)
    rng = np.random.default_rng(seed)
    shared = rng.integers(4, 96, 14).tolist()
    for i in range(5):
        prompt = (shared if i % 2 else []) + rng.integers(4, 96, int(rng.integers(5, 12))).tolist()
        engine.add_request(str(i), prompt_token_ids=prompt, sampling_params=SamplingParams(
            n=int(rng.integers(2, 4)), temperature=1.0, seed=i, max_tokens=20, ignore_eos=True))
    outs, poisoned = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [c.token_ids for c in out.outputs]
        engine.check()
        free = [p for p in range(engine.num_pages) if engine.allocator.refcount(p) == 0]
        poisoned += int(np.isnan(np.asarray(engine.state.kv_pages)[:, :, free]).any()) \
            if free else 0
    return outs, engine.stats(), poisoned


@pytest.mark.parametrize("seed", [0, 1])
def test_nan_filled_freed_pages_change_nothing_with_forks(tiny_model, seed):
    """Sampled forks (n = 2, 3) under preemption give the same tokens with freed pages
    poisoned; without the prefix cache freed pages stay free, so NaN is really written."""
    clean, stats, _ = _run_forks(tiny_model, seed, enable_prefix_caching=False)
    dirty, _, poisoned = _run_forks(tiny_model, seed, debug_nan_freed_pages=True,
                                    enable_prefix_caching=False)
    assert poisoned > 0 and stats.generated_tokens > 100
    assert dirty == clean


def test_poisoning_runs_after_the_copies_of_its_step(tiny_model, monkeypatch):
    """A copy-on-write source that this very plan freed (a preempted sibling held its last
    reference) is copied before freed pages are filled with NaN, so the copy holds its KV."""
    engine = Engine(tiny_model, page_size=4, num_pages=8, max_num_seqs=2, max_model_len=32,
                    max_num_batched_tokens=16, debug_nan_freed_pages=True,
                    enable_prefix_caching=False)
    src, dst = engine.allocator.allocate(2)
    engine.write_kv(lambda state: fill_pages(state, np.array([src], np.int32), 1.0))
    engine.allocator.free([src])
    monkeypatch.setattr(engine.scheduler, "schedule",
                        lambda *_: SchedulerOutput(copies=[(src, dst)]))
    d = engine.dispatch()
    assert d.error is None and d.read is None  # no rows to run
    kv = np.asarray(engine.state.kv_pages)
    assert (kv[:, :, dst] == 1.0).all()  # the KV it had when the plan was made
    assert np.isnan(kv[:, :, src]).all()  # and the freed page is poisoned
