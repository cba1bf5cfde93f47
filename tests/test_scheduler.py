"""Scheduler host logic, with no device: budgets, chunking, lazy pages, preemption, prefix reuse,
forks with copy-on-write, and the page invariants after every step."""

import ast
from pathlib import Path

import pytest

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.prefix import NullPrefixCache
from jaxkv.cache.radix import RadixCache
from jaxkv.engine.request import Request, RequestStatus
from jaxkv.engine.scheduler import FCFS_QUEUE_LEN, MAX_SKIPS, Scheduler
from jaxkv.sampling_params import SamplingParams

pytestmark = pytest.mark.host  # no engine: `make test-fast`

TOKEN = 7  # every "sampled" token


def make(num_pages=16, page_size=4, max_num_seqs=4, budget=16, cache=True):
    alloc = PageAllocator(num_pages)
    radix = RadixCache(alloc, page_size) if cache else NullPrefixCache()
    return Scheduler(alloc, radix, page_size=page_size, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, eos_token_ids=(0,))


_index = iter(range(10**6))


def add(sched, prompt, max_tokens=4, n=1, salt=None):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)
    i = next(_index)
    samples = [Request(f"r{i}", list(prompt), sp, i, 0.0, sample_index=j, cache_salt=salt)
               for j in range(n)]
    samples[0].forks = samples[1:]
    sched.add(samples[0])
    return samples[0] if n == 1 else samples


def step(sched):
    """Plans a step, "runs" it (every sample draws TOKEN), applies it, checks invariants."""
    plan = sched.schedule()
    sampled = [[TOKEN] * len(r.samples) if r.samples else None for r in plan.rows]
    sched.update(plan, sampled, now=1.0)
    sched.allocator.check(holders=sched.holders())
    sched.radix.check()
    used, cached = sched.page_usage()
    assert used + cached + sched.allocator.num_free == sched.allocator.num_pages
    return plan


def drain(sched, limit=200):
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("scheduler did not finish")


def shape(plan):
    return ([(r.start, len(r.tokens)) for r in plan.decode_rows],
            [(r.start, len(r.tokens)) for r in plan.prefill_rows])


def test_host_bookkeeping_imports_no_jax():
    root = Path(__file__).resolve().parent.parent / "jaxkv"
    for rel in ("engine/scheduler.py", "engine/request.py", "engine/detokenizer.py",
                "cache/allocator.py", "cache/prefix.py", "cache/radix_node.py", "cache/radix.py",
                "cache/host_radix.py", "sampling_params.py"):
        tree = ast.parse((root / rel).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in names if m.split(".")[0] in ("jax", "jaxlib", "flax")], rel


def test_chunked_prefill_lazy_pages_and_decodes_first():
    s = make(page_size=4, budget=8)
    a = add(s, range(1, 21), max_tokens=4)
    assert shape(step(s)) == ([], [(0, 8)])
    assert len(a.pages) == 2  # only the chunk's pages, not the whole prompt's
    assert shape(step(s)) == ([], [(8, 8)])
    b = add(s, range(30, 36), max_tokens=2)
    plan = step(s)  # a's last chunk samples; b is admitted with the rest of the budget
    assert shape(plan) == ([], [(16, 4), (0, 4)])
    assert plan.prefill_rows[0].samples == (a,) and not plan.prefill_rows[1].samples
    assert a.output_token_ids == [TOKEN] and len(a.pages) == 5
    assert shape(step(s)) == ([(20, 1)], [(4, 2)])  # decodes first
    assert len(a.pages) == 6  # position 20 starts page 5
    step(s)
    assert len(a.pages) == 6 and a.num_computed_tokens == 22  # position 21 fits in page 5
    step(s)
    assert a.status is RequestStatus.FINISHED and a.finish_reason == "length" and not a.pages
    drain(s)
    assert b.output_token_ids == [TOKEN, TOKEN] and s.page_usage()[0] == 0
    assert s.counters.computed_prompt_tokens == 26 and s.counters.generated_tokens == 6


def test_budget_and_max_num_seqs_bound_a_step():
    s = make(num_pages=64, max_num_seqs=2, budget=5)
    reqs = [add(s, range(10 * i + 1, 10 * i + 4), max_tokens=2) for i in range(3)]
    plan = step(s)
    assert shape(plan) == ([], [(0, 3), (0, 2)])  # budget 5 splits the second prompt
    assert reqs[2].status is RequestStatus.WAITING  # two slots only
    drain(s)
    assert all(r.output_token_ids == [TOKEN, TOKEN] for r in reqs)


def test_admission_waits_for_pages():
    s = make(num_pages=4, page_size=4, budget=64, cache=False)
    a = add(s, range(1, 13), max_tokens=3)  # 3 pages
    b = add(s, range(20, 28), max_tokens=2)  # 2 pages: does not fit beside a
    step(s)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    drain(s)
    assert b.finish_reason == "length" and s.counters.preemptions == 0


def test_preemption_recomputes_newest_and_reuses_its_cache():
    s = make(num_pages=6, page_size=2, budget=64)
    a = add(s, [1, 2, 3], max_tokens=6)
    b = add(s, [4, 5, 6], max_tokens=6)
    step(s)  # both prefill: 2 pages each
    assert a.status is b.status is RequestStatus.RUNNING
    for _ in range(6):  # pages run out when both reach position 6
        plan = step(s)
        if plan.preempted:
            break
    assert plan.preempted == [b] and b.status is RequestStatus.WAITING
    assert s.waiting[0] is b and s.counters.preemptions == 1
    kept = b.output_token_ids
    assert kept and b.token_ids == [4, 5, 6] + kept and not b.pages
    drain(s)
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 6
    assert b.num_preemptions >= 1 and b.num_cached_tokens == 0
    assert s.counters.cached_prompt_tokens > 0  # b's re-admission hit its own cached KV


def test_longest_cached_prefix_first_then_fcfs_for_long_queues():
    s = make(num_pages=64, max_num_seqs=1, budget=64)
    shared = list(range(1, 14))
    add(s, shared, max_tokens=1)
    drain(s)
    cold = add(s, range(40, 50), max_tokens=2)
    warm = add(s, shared + [99], max_tokens=2)
    step(s)
    assert warm.status is RequestStatus.RUNNING and cold.status is RequestStatus.WAITING
    assert warm.num_cached_tokens == 13
    drain(s)

    s = make(num_pages=64, max_num_seqs=1, budget=64)
    add(s, shared, max_tokens=1)
    drain(s)
    queue = [add(s, range(40, 50), max_tokens=2) for _ in range(FCFS_QUEUE_LEN)]
    add(s, shared + [99], max_tokens=2)
    step(s)
    assert queue[0].status is RequestStatus.RUNNING  # arrival order


def test_partial_page_match_is_copied_and_full_pages_shared():
    s = make(num_pages=32, page_size=4, budget=64)
    prompt = list(range(1, 12))  # 11 tokens
    a = add(s, prompt, max_tokens=2)
    drain(s)  # caches 12 computed tokens: 3 pages
    b = add(s, prompt[:10] + [50, 51], max_tokens=2)
    plan = step(s)
    cached = s.radix.match_prefix(prompt[:10], b.cache_namespace).pages
    assert b.num_cached_tokens == 10 and plan.prefill_rows[0].start == 10
    assert b.pages[:2] == list(cached[:2])  # whole pages shared
    assert plan.copies == [(cached[2], b.pages[2])]  # the partly matched page is copied
    assert a.finish_reason == "length"
    drain(s)


def test_whole_prompt_cached_still_computes_its_last_token():
    s = make(num_pages=32, page_size=4, budget=64)
    add(s, range(1, 9), max_tokens=1)
    drain(s)
    b = add(s, range(1, 9), max_tokens=1)
    plan = step(s)
    assert b.num_cached_tokens == 7 and shape(plan) == ([], [(7, 1)])
    assert plan.prefill_rows[0].samples == (b,)


def test_fork_shares_prompt_pages_and_copies_on_write():
    s = make(num_pages=32, page_size=4, budget=64)
    samples = add(s, range(1, 7), max_tokens=3, n=3)  # 6 tokens: 1 full page + 2 tokens
    plan = step(s)
    assert len(plan.prefill_rows) == 1 and plan.prefill_rows[0].samples == tuple(samples)
    assert all(r.status is RequestStatus.RUNNING for r in samples)
    assert all(r.pages == samples[0].pages for r in samples)
    assert s.page_usage()[0] == 2  # not 3 x 2
    shared_last = samples[0].pages[1]
    plan = step(s)  # each writes position 6 into the shared page: two copy, the last owns it
    assert [src for src, _ in plan.copies] == [shared_last, shared_last]
    assert len({r.pages[1] for r in samples}) == 3 and samples[2].pages[1] == shared_last
    assert all(r.pages[0] == samples[0].pages[0] for r in samples)
    drain(s)
    assert all(r.output_token_ids == [TOKEN] * 3 for r in samples)


def test_fork_needs_free_slots_for_all_samples():
    s = make(num_pages=32, max_num_seqs=3, budget=64)
    a = add(s, range(1, 5), max_tokens=2)
    samples = add(s, range(10, 15), max_tokens=2, n=3)
    step(s)
    assert a.status is RequestStatus.RUNNING and samples[0].status is RequestStatus.WAITING
    drain(s)
    assert all(r.finish_reason == "length" for r in samples)


def test_abort_frees_pages_at_once():
    s = make(num_pages=16, budget=64)
    a = add(s, range(1, 10), max_tokens=8)
    b = add(s, range(20, 30), max_tokens=8)
    step(s)
    before = s.page_usage()[0]
    s.finish(a, "abort", now=2.0)
    assert a.status is RequestStatus.ABORTED and not a.pages
    assert s.page_usage()[0] == before - 3
    s.allocator.check(holders=s.holders())
    drain(s)
    assert b.finish_reason == "length"


@pytest.mark.parametrize("cache", [True, False])
def test_stress_invariants_under_pressure(cache):
    s = make(num_pages=10, page_size=2, max_num_seqs=4, budget=6, cache=cache)
    prefix = [1, 2, 3, 4, 5]
    reqs = []
    for i in range(12):
        out = add(s, prefix[: i % 5 + 1] + [10 + i] * (i % 3 + 1), max_tokens=i % 4 + 2,
                  n=1 + (i % 5 == 0))
        reqs += out if isinstance(out, list) else [out]
    drain(s, limit=500)
    assert all(r.finish_reason == "length" for r in reqs)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs)
    assert s.page_usage()[0] == 0 and s.allocator.num_free + s.page_usage()[1] == 10


def test_admission_falls_back_to_whole_pages_when_the_partial_page_is_the_one_missing():
    s = make(num_pages=3, page_size=4, budget=64)
    a = add(s, range(1, 10), max_tokens=2)
    drain(s)  # the cache holds a's 10 computed tokens in all 3 pages
    assert s.allocator.num_free == 0
    b = add(s, a.token_ids[:10] + [50, 51], max_tokens=1)  # needs 3 pages alone: it fits
    plan = step(s)
    # Reusing 10 tokens would lock the partly matched page that b's copy needs room beside.
    assert b.num_cached_tokens == 8 and not plan.copies
    assert shape(plan) == ([], [(8, 4)]) and b.finish_reason == "length"


def test_decodes_take_turns_when_they_outnumber_the_budget():
    """4 decoding sequences (the samples of one n=4 request) and a budget of 2 tokens a step:
    every one gets a token at least every ceil(4 / 2) = 2 steps (without turns the newest two
    waited for the oldest to end)."""
    s = make(num_pages=64, page_size=4, max_num_seqs=4, budget=2)
    reqs = add(s, [5, 6], max_tokens=12, n=4)
    last, worst, t = {}, 0, 0
    while s.has_unfinished():
        t += 1
        step(s)
        for r in reqs:
            if r.num_output_tokens and r.status is RequestStatus.RUNNING:
                if last.get(r, (0, 0))[0] != r.num_output_tokens:
                    last[r] = (r.num_output_tokens, t)
                worst = max(worst, t - last[r][1])
        assert t < 200
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert worst <= 1  # at most one step without a token in between


def test_aging_admits_a_cold_request_among_cache_hits():
    """Cache-hitting arrivals at the service rate must not starve a request with no hit: it
    goes first once MAX_SKIPS later arrivals have been admitted ahead of it."""
    s = make(num_pages=64, page_size=4, max_num_seqs=1, budget=64)
    prefix = list(range(1, 13))
    add(s, prefix + [50], max_tokens=1)
    drain(s)  # the prefix is cached
    cold = add(s, [90, 91, 92, 93, 94], max_tokens=1)
    for i in range(3 * MAX_SKIPS):
        add(s, prefix + [60 + i, 61], max_tokens=1)  # one hit arrives per step, served at once
        step(s)
        if cold.status is not RequestStatus.WAITING:
            break
    assert cold.status is not RequestStatus.WAITING, cold.skipped
    assert i >= MAX_SKIPS - 1  # the hits did go first until then


def test_a_retried_admission_counts_its_prefix_query_once():
    """A request that cannot be admitted for several steps (no free page) must not count its
    prefix match again each step: hit statistics would inflate under memory pressure."""
    s = make(num_pages=6, page_size=4, max_num_seqs=2, budget=64)
    prefix = list(range(1, 9))
    add(s, prefix + [40], max_tokens=1)
    drain(s)  # 2 pages cached
    a = add(s, list(range(20, 32)), max_tokens=4)  # 3 pages, then a 4th: none left
    step(s)
    step(s)
    before = dict(s.radix.stats())
    b = add(s, prefix + [9] * 5, max_tokens=1)  # needs 2 fresh pages beside its 2 cached
    blocked = 0
    while s.has_unfinished():
        step(s)
        blocked += b.status is RequestStatus.WAITING
    assert blocked >= 2 and a.finish_reason == b.finish_reason == "length"
    stats = s.radix.stats()
    assert stats["query_tokens"] - before["query_tokens"] == len(b.token_ids[:13]) - 1
    assert stats["hit_tokens"] - before["hit_tokens"] == b.num_cached_tokens == 8
