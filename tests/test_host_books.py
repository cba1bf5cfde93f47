"""The host books against what every page would hold: the real Scheduler, prefix cache
(`NullPrefixCache`, `RadixCache` or `HostTieredRadixCache`) and PageAllocator drive a fake
device that records, for every (page, offset), which sequence prefix's KV it holds (the salt
and the tokens up to that position).

After every step: every row reads, at each cached position, exactly its own prefix; every
radix entry's pages (device pages, or host slots for entries moved to the host tier) hold its
tokens; the host tier's copies run in the order the cache queued them; page copies read their
sources before anything is poisoned (the NaN debug mode: freed pages hold POISON); `check()`
balances. Traces: page sizes
1-16, n up to 3, forks, aborts of waiting, running and forking requests, salts, EOS and
min_tokens, and pools small enough to force eviction and preemption.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.host_radix import HostTieredRadixCache
from jaxkv.cache.prefix import NullPrefixCache
from jaxkv.cache.radix import RadixCache
from jaxkv.engine.request import Request, RequestStatus
from jaxkv.engine.scheduler import Scheduler
from jaxkv.sampling_params import SamplingParams

pytestmark = pytest.mark.host  # no engine: `make test-fast`

EOS = 1
POISON = ("poison",)


class FakeDevice:
    """What the device's pages hold: contents[page][offset] = (namespace, tokens[:pos + 1])."""

    def __init__(self, num_pages: int, page_size: int, host_slots: int = 0):
        self.s = page_size
        self.pages = [[None] * page_size for _ in range(num_pages)]
        self.host = [[None] * page_size for _ in range(host_slots)]

    def transfer(self, radix):
        """As Engine._transfer: the host tier's saves and loads, in the order queued."""
        for kind, src, dst in radix.take_transfers():
            for a, b in zip(src, dst, strict=True):
                if kind == "save":
                    self.host[b] = list(self.pages[a])
                else:
                    self.pages[b] = list(self.host[a])

    def run(self, plan, allocator, poison: bool):
        # As Engine._launch: copies (all sources read first), then the poisoning, then rows.
        moved = [list(self.pages[src]) for src, _ in plan.copies]
        for (_, dst), data in zip(plan.copies, moved, strict=True):
            self.pages[dst] = data
        if poison:
            for p in allocator.drain_freed():
                self.pages[p] = [POISON] * self.s
        for row in plan.rows:
            req = row.request
            for pos in range(row.start):  # the cached context this row attends to
                got = self.pages[row.pages[pos // self.s]][pos % self.s]
                want = (req.cache_namespace, tuple(req.token_ids[:pos + 1]))
                assert got == want, (f"{req.request_id}/{req.sample_index} position {pos} of "
                                     f"{row.start}: reads {got}")
            for i in range(len(row.tokens)):  # then writes the K/V of its new tokens
                pos = row.start + i
                assert req.token_ids[pos] == row.tokens[i]
                self.pages[row.pages[pos // self.s]][pos % self.s] = (
                    req.cache_namespace, tuple(req.token_ids[:pos + 1]))

    def check_radix(self, radix: RadixCache):
        """Every entry's pages hold the KV of its path's tokens (from its first page's start)."""
        s = self.s
        for e in radix.entries():
            first = e.start // s
            for pos in range(first * s, len(e.tokens)):
                page = e.pages[pos // s - first]
                got = (self.pages if e.on_device else self.host)[page][pos % s]
                assert got == (e.salt, e.tokens[:pos + 1]), (
                    f"radix entry {e.tokens} from {e.start}, position {pos}: page {page} holds "
                    f"{got}")


def prefix_cache(alloc: PageAllocator, page_size: int, cache: bool = True, host_slots: int = 0):
    """The prefix cache an Engine builds for these settings."""
    if not cache:
        return NullPrefixCache()
    if host_slots:
        return HostTieredRadixCache(alloc, page_size, PageAllocator(host_slots))
    return RadixCache(alloc, page_size)


@st.composite
def traces(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    vocab = draw(st.integers(4, 12))  # few ids: prompts share prefixes, EOS (1) comes up
    prefixes = [draw(st.lists(st.integers(2, vocab), min_size=1, max_size=20)) for _ in range(2)]
    requests, heads = [], [[], *prefixes]
    for _ in range(draw(st.integers(3, 8))):
        head = draw(st.sampled_from(heads))  # may be an earlier prompt: a next chat turn
        heads.append(head + draw(st.lists(st.integers(2, vocab), min_size=1, max_size=12)))
        requests.append(dict(
            prompt=heads[-1],
            n=draw(st.integers(1, 3)), max_tokens=draw(st.integers(1, 12)),
            min_tokens=draw(st.sampled_from([0, 0, 2])), ignore_eos=draw(st.booleans()),
            salt=draw(st.sampled_from([None, None, "a", "b"])),
            arrive=draw(st.integers(0, 12)),
            abort=draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 10))),
        ))
    # Each request fits alone (all its samples' pages); together they must evict and preempt.
    need = max(r["n"] * -(-(len(r["prompt"]) + r["max_tokens"]) // page_size) + 1
               for r in requests)
    num_pages = draw(st.integers(need, need + 2))
    return dict(page_size=page_size, vocab=vocab, num_pages=num_pages, requests=requests,
                budget=draw(st.sampled_from([3, 8, 32])), max_seqs=draw(st.integers(3, 6)),
                cache=draw(st.sampled_from([True, True, False])), poison=draw(st.booleans()),
                host=draw(st.sampled_from([0, 0, 2, need, 4 * need])),
                seed=draw(st.integers(0, 2**16)))


def _run(trace):
    import random

    rng = random.Random(trace["seed"])
    s = trace["page_size"]
    alloc = PageAllocator(trace["num_pages"], track_freed=trace["poison"])
    radix = prefix_cache(alloc, s, trace["cache"], trace.get("host", 0))
    sched = Scheduler(alloc, radix, page_size=s, max_num_seqs=trace["max_seqs"],
                      max_num_batched_tokens=trace["budget"], eos_token_ids=(EOS,))
    device = FakeDevice(trace["num_pages"], s, trace.get("host", 0))
    added, samples = {}, {}
    for step in range(600):
        for i, r in enumerate(trace["requests"]):
            if r["arrive"] == step and r["n"] <= trace["max_seqs"]:
                sp = SamplingParams(n=r["n"], temperature=0, max_tokens=r["max_tokens"],
                                    min_tokens=min(r["min_tokens"], r["max_tokens"]),
                                    ignore_eos=r["ignore_eos"])
                group = [Request(f"r{i}", list(r["prompt"]), sp, i, 0.0, sample_index=j,
                                 cache_salt=r["salt"]) for j in range(r["n"])]
                group[0].forks = group[1:]
                sched.add(group[0])
                added[i], samples[i] = step, group
            if r["abort"] is not None and added.get(i) is not None and \
                    step == added[i] + r["abort"]:
                for q in samples[i]:  # the parent first: it holds its forks' slots
                    if not q.is_done:
                        sched.finish(q, "abort", 1.0)
        plan = sched.schedule()
        device.transfer(radix)
        device.run(plan, alloc, trace["poison"])
        sampled = []
        for row in plan.rows:
            if not row.samples:
                sampled.append(None)
                continue
            out = []
            for q in row.samples:  # a stop token only once min_tokens are out (masked before)
                banned = q.sampling_params.banned_ids(q.num_output_tokens, (EOS,))
                choices = [t for t in range(1, trace["vocab"] + 1) if t not in banned]
                out.append(rng.choice(choices))
            sampled.append(out)
        sched.update(plan, sampled, now=1.0)
        alloc.check(holders=sched.holders())
        radix.check()
        if trace["cache"]:
            device.check_radix(radix)
        if len(added) == len(trace["requests"]) and not sched.has_unfinished():
            break
    else:
        raise AssertionError("the trace did not finish")
    assert sched.page_usage()[0] == 0  # only the prefix cache may hold pages now
    for group in samples.values():
        for q in group:
            assert q.is_done and not q.pages and q.slot is None
            sp = q.sampling_params
            if q.finish_reason == "stop":
                assert q.token_ids[-1] == EOS and not sp.ignore_eos
                assert q.num_output_tokens > sp.min_tokens
            elif q.status is RequestStatus.FINISHED:
                assert q.finish_reason == "length"
                assert q.num_output_tokens == sp.max_tokens
    return samples, trace


def _check_trace(trace):
    """Runs a trace (its every step checked inside `_run`); every request was added and ended."""
    samples, trace = _run(trace)
    fits = [i for i, r in enumerate(trace["requests"]) if r["n"] <= trace["max_seqs"]]
    assert sorted(samples) == fits
    assert all(q.is_done for group in samples.values() for q in group)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_every_read_sees_its_own_prefix(trace):
    _check_trace(trace)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_every_read_sees_its_own_prefix_long(trace):
    _check_trace(trace)


def test_the_fake_device_catches_a_wrong_read():
    """The checker itself: a page table pointing at another sequence's page fails."""
    device = FakeDevice(4, 2)
    alloc = PageAllocator(4)
    sp = SamplingParams(temperature=0, max_tokens=2)
    a = Request("a", [5, 6, 7], sp, 0, 0.0)
    b = Request("b", [5, 9, 7], sp, 1, 0.0)

    class Row:
        def __init__(self, req, start, n, pages):
            self.request, self.start, self.pages = req, start, pages
            self.tokens = req.token_ids[start:start + n]

    class Plan:
        copies = []

        def __init__(self, rows):
            self.rows = rows

    device.run(Plan([Row(a, 0, 3, [0, 1])]), alloc, False)
    with pytest.raises(AssertionError, match="position 1"):
        device.run(Plan([Row(b, 2, 1, [0, 1])]), alloc, False)  # b reusing a's page 0
