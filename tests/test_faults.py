"""Faults: a preemption storm, abort in every phase of a request, and a step that raises.

Throughout: the page invariants hold after every step (`Engine.check`), every request that was
not aborted or failed gets the greedy tokens it gets alone, and nothing leaks.
"""

import collections

import jax
import numpy as np
import pytest
from serving import drive

import jaxkv
from jaxkv import Engine, SamplingParams
from jaxkv.runtime.steps import Steps


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def pages_needed(prompt_len, max_tokens, page_size):
    return -(-(prompt_len + max_tokens - 1) // page_size)


def test_preemption_storm_completes_everything_exactly(tiny_model, tiny_config):
    rng = np.random.default_rng(0)
    page_size, new = 8, 24
    prompts = [rng.integers(4, tiny_config.vocab_size, int(n)).tolist()
               for n in rng.integers(8, 41, 64)]
    demand = sum(pages_needed(len(p), new, page_size) for p in prompts)
    num_pages = max(demand // 10, max(pages_needed(len(p), new, page_size) for p in prompts))
    engine = Engine(tiny_model, page_size=page_size, num_pages=num_pages, max_num_seqs=64,
                    max_model_len=128, max_num_batched_tokens=256)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=greedy(new))
    final = drive(engine)
    expected = jaxkv.generate(tiny_model, prompts, greedy(new), page_size=page_size)
    stats = engine.stats()
    assert num_pages <= demand // 10 + 1 and stats.preemptions >= 16  # a storm, not a breeze
    assert [final[str(i)].outputs[0].token_ids for i in range(64)] == expected
    assert stats.kv_pages_used == 0
    assert engine.radix.clear() >= 0 and engine.allocator.num_free == num_pages


# ---- abort in every phase ------------------------------------------------------------------

PHASES = ["waiting", "mid-prefill", "decoding", "forked", "preempted"]


def _reach(engine, phase, vocab):
    """Adds request "x" and steps until it is in `phase`; other requests keep it company."""
    rng = np.random.default_rng(3)
    other = rng.integers(4, vocab, 20).tolist()
    engine.add_request("other", prompt_token_ids=other, sampling_params=greedy(60))
    prompt = rng.integers(4, vocab, 40).tolist()
    n = 3 if phase == "forked" else 1
    sp = SamplingParams(n=n, seed=5, max_tokens=12) if n > 1 else greedy(12)
    engine.add_request("x", prompt_token_ids=prompt, sampling_params=sp)
    x = engine.get_request("x").samples
    if phase == "waiting":
        return x
    while True:
        engine.step()
        engine.check()
        head = x[0]
        if phase == "mid-prefill" and 0 < head.num_computed_tokens < len(prompt):
            return x
        if phase == "decoding" and head.num_output_tokens >= 2:
            return x
        if phase == "forked" and all(s.pages for s in x) and head.num_output_tokens >= 2:
            return x
        if phase == "preempted" and head.num_output_tokens >= 2:
            engine.scheduler.preempt_all()
            assert not head.pages and head in engine.scheduler.waiting
            return x


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("phase", PHASES)
def test_abort_in_every_phase_frees_exactly_its_pages(tiny_model, tiny_config, phase, caching):
    engine = Engine(tiny_model, page_size=8, num_pages=32, max_num_seqs=8, max_model_len=128,
                    max_num_batched_tokens=16, enable_prefix_caching=caching)
    samples = _reach(engine, phase, tiny_config.vocab_size)
    held = collections.Counter(p for s in samples for p in s.pages)
    if phase == "forked":  # the samples share the prompt's pages
        assert max(held.values()) == len(samples)
    before = [engine.allocator.refcount(p) for p in range(engine.num_pages)]
    cached_before = engine.radix.num_held_pages if caching else 0
    engine.abort("x")
    engine.check()
    after = [engine.allocator.refcount(p) for p in range(engine.num_pages)]
    cached_gain = (engine.radix.num_held_pages - cached_before) if caching else 0
    # Every reference the request held is dropped; with caching, its computed KV may stay
    # in the prefix cache (new references, each checked by Engine.check against the tree).
    assert sum(before) - sum(after) == sum(held.values()) - cached_gain
    for p in range(engine.num_pages):
        assert after[p] <= before[p] - held[p] + (1 if caching else 0)
    if not caching:
        assert after == [b - held[p] for p, b in enumerate(before)]
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "x"]
    assert len(aborted) == 1 and {c.finish_reason for c in aborted[0].outputs} == {"abort"}
    final = drive(engine)
    assert final["other"].outputs[0].finish_reason == "length"
    assert engine.stats().kv_pages_used == 0
    if caching:
        engine.radix.clear()
    assert engine.allocator.num_free == engine.num_pages


# ---- a step that raises --------------------------------------------------------------------

class InjectedFault(RuntimeError):
    pass


def faulty(steps: Steps, fail_at: int, mode: str) -> Steps:
    """The engine's steps, with call number `fail_at` failing the way `mode` says:
    "raise": raises InjectedFault, the donated state intact;
    "consume": deletes the donated state's buffers, then raises (a failure after donation);
    "late": returns, but with its outputs' buffers gone, so the failure surfaces only when the
    engine reads the logits (an asynchronous device error)."""
    calls = [0]

    def wrap(fn):
        def run(params, state, *batch):
            calls[0] += 1
            if calls[0] != fail_at:
                return fn(params, state, *batch)
            if mode == "late":
                out = fn(params, state, *batch)
                for leaf in jax.tree.leaves(out):
                    leaf.delete()
                return out
            if mode == "consume":
                for leaf in jax.tree.leaves(state):
                    leaf.delete()
            raise InjectedFault("injected device fault")
        return run

    return steps._replace(step=wrap(steps.step), decode_loop=wrap(steps.decode_loop))


@pytest.mark.parametrize("mode", ["raise", "consume", "late"])
def test_exception_in_a_step_fails_its_requests_and_the_engine_goes_on(
        tiny_model, tiny_config, mode):
    rng = np.random.default_rng(11)
    p, q, late = (rng.integers(4, tiny_config.vocab_size, n).tolist() for n in (2, 5, 12))
    # Budget 3: step 1 prefills p and q's first token; then p's three samples fill the
    # budget, so q is running but outside step 2, which fails.
    engine = Engine(tiny_model, page_size=8, num_pages=32, max_num_seqs=8, max_model_len=64,
                    max_num_batched_tokens=3)
    engine.steps = faulty(engine.steps, fail_at=2, mode=mode)
    engine.add_request("p", prompt_token_ids=p,
                       sampling_params=SamplingParams(n=3, temperature=0, max_tokens=10))
    engine.add_request("q", prompt_token_ids=q, sampling_params=greedy(10))
    final = {}
    for step in range(200):
        if step == 4:
            engine.add_request("late", prompt_token_ids=late, sampling_params=greedy(10))
        if not engine.has_unfinished_requests():
            break
        if step == 1:
            assert {r.request_id for r in engine.scheduler.running} == {"p", "q"}
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check()
    assert sorted(final) == ["late", "p", "q"]
    assert [c.finish_reason for c in final["p"].outputs] == ["error"] * 3
    assert final["p"].error.startswith("InjectedFault: injected device fault" if mode != "late"
                                       else "RuntimeError")  # reading a deleted array
    want = jaxkv.generate(tiny_model, [q, late], greedy(10), page_size=8)
    assert [final[r].outputs[0].token_ids for r in ("q", "late")] == want
    # A lost state sends q back to recompute; a kept one lets it go on where it was.
    assert engine.stats().preemptions == (0 if mode == "raise" else 1)
    assert engine.stats().kv_pages_used == 0
