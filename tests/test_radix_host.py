"""The prefix cache's host tier: demotion instead of eviction, promotion on a hit, adoption on
insert, LRU across both tiers, salts, clear(); and a multi-turn workload through the real
Scheduler against the fake device of test_host_books, so every read is checked by content."""

import pytest
from test_host_books import EOS, FakeDevice, prefix_cache

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.host_radix import HostTieredRadixCache
from jaxkv.engine.request import Request, cache_namespace
from jaxkv.engine.scheduler import Scheduler
from jaxkv.sampling_params import SamplingParams

pytestmark = pytest.mark.host  # no engine: `make test-fast`


def _cache(device_pages=8, host_slots=8, page_size=4):
    alloc, host = PageAllocator(device_pages), PageAllocator(host_slots)
    return alloc, host, HostTieredRadixCache(alloc, page_size, host)


def _insert(alloc, radix, tokens, salt=None):
    pages = alloc.allocate(-(-len(tokens) // radix.page_size))
    radix.insert(tokens, pages, salt)
    alloc.free(pages)  # the cache keeps its own references
    return pages


def test_eviction_demotes_and_a_hit_promotes():
    alloc, host, radix = _cache()
    pages = _insert(alloc, radix, list(range(10, 20)))
    assert radix.evict(3) == 3 and alloc.num_free == 8
    [(kind, src, slots)] = radix.take_transfers()
    assert (kind, src) == ("save", pages) and host.num_used == 3
    assert radix.match_prefix(list(range(10, 20))).num_tokens == 0  # not on the device
    radix.check()
    assert radix.promote(list(range(10, 21))) == 10
    [(kind, src, back)] = radix.take_transfers()
    assert (kind, src) == ("load", slots) and host.num_free == 8
    m = radix.match_prefix(list(range(10, 21)))
    assert m.num_tokens == 10 and list(m.pages) == back
    stats = radix.stats()
    assert stats["host_saved_pages"] == 3 and stats["host_loaded_pages"] == 3
    assert stats["host_hit_tokens"] == 0 and stats["host_tokens"] == 0  # counted by `record`
    radix.record(m, 11, 10, from_host=10)
    assert radix.stats()["host_hit_tokens"] == 10
    radix.check()


def test_lru_runs_across_both_tiers():
    """The host pool holds one entry: demoting a second drops the older host entry."""
    alloc, host, radix = _cache(device_pages=4, host_slots=2)
    _insert(alloc, radix, [1, 2, 3, 4, 5])  # 2 pages
    _insert(alloc, radix, [7, 8, 9, 10, 11])
    radix.match_prefix([7, 8, 9, 10, 11])  # the second is more recent
    radix.evict(2)  # demotes the first (LRU)
    radix.evict(2)  # demotes the second: the first leaves the host
    assert radix.match_prefix([1, 2, 3, 4, 5]).num_tokens == 0
    assert radix.promote([1, 2, 3, 4, 5]) == 0  # gone from both tiers
    assert radix.promote([7, 8, 9, 10, 11]) == 5
    assert radix.stats()["host_evicted_tokens"] == 5
    radix.check()


def test_promotion_stops_when_the_device_is_full_and_changes_nothing_else():
    alloc, host, radix = _cache(device_pages=3)
    _insert(alloc, radix, [1, 2, 3, 4, 5, 6, 7, 8])
    radix.evict(2)
    radix.take_transfers()
    held = alloc.allocate(3)  # running requests hold the whole device pool
    assert radix.promote([1, 2, 3, 4, 5, 6, 7, 8]) == 0
    assert radix.take_transfers() == [] and host.num_used == 2
    alloc.free(held)
    radix.check()


def test_a_split_host_node_and_a_straddled_page():
    """Host entries split at a token inside a page share that slot; promoting the upper half
    and inserting below it keeps refcounts exact."""
    alloc, host, radix = _cache(page_size=4)
    _insert(alloc, radix, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    radix.evict(3)
    radix.take_transfers()
    assert radix.promote([1, 2, 3, 4, 5, 6]) == 6  # only the matched part comes back
    assert radix.cached_length([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 9  # the rest is still on host
    assert radix.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 6
    radix.check()
    radix.evict(3)
    radix.take_transfers()
    # An insert that diverges at position 6 splits the host node at a token inside page 1.
    _insert(alloc, radix, [1, 2, 3, 4, 5, 6, 99, 98])
    radix.check()
    assert radix.match_prefix([1, 2, 3, 4, 5, 6, 99, 98]).num_tokens == 8  # adopted: device
    assert radix.promote([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 3  # the other branch's tail
    radix.check()
    assert radix.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 9


def test_salts_keep_their_own_host_entries():
    alloc, host, radix = _cache()
    _insert(alloc, radix, [1, 2, 3, 4, 5], salt="alice")
    radix.evict(2)
    assert radix.promote([1, 2, 3, 4, 5]) == 0 and radix.promote([1, 2, 3, 4, 5], "bob") == 0
    assert radix.promote([1, 2, 3, 4, 5], "alice") == 5
    radix.check()


def test_clear_drops_device_entries_with_the_host_entries_below_them():
    alloc, host, radix = _cache()
    _insert(alloc, radix, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    _insert(alloc, radix, [1, 2, 3, 4, 5, 6, 7, 8, 11, 12])  # splits after 8: two leaves
    radix.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 11, 12])
    radix.evict(1)  # the older leaf moves to the host, below the device node [1..8]
    assert host.num_used == 1
    radix.clear()  # device contents lost: nothing is demoted, the host child goes too
    assert host.num_used == 0 and alloc.num_free == 8 and radix.num_cached_tokens == 0
    radix.check()


def _turn(i, prompt, max_tokens=4):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(f"c{i}", list(prompt), sp, i, 0.0)


def _multi_turn(host_slots: int):
    """8 conversations x 3 turns (each turn the whole history plus two new tokens, four
    tokens out) over a 16-page pool that holds about two conversations' history, through
    the real Scheduler and the fake device, which checks every position every row reads.
    Returns (prompt tokens computed, cache stats)."""
    s, pages = 4, 16
    alloc = PageAllocator(pages, track_freed=True)
    radix = prefix_cache(alloc, s, host_slots=host_slots)
    sched = Scheduler(alloc, radix, page_size=s, max_num_seqs=2, max_num_batched_tokens=16,
                      eos_token_ids=(EOS,))
    device = FakeDevice(pages, s, host_slots)
    history = {c: [100 + c, 2, 3, 4, 5, 6, 7] for c in range(8)}
    for turn in range(3):
        for c in range(8):
            req = _turn(c, history[c] + [8 + turn, 9])
            sched.add(req)
            while sched.has_unfinished():
                plan = sched.schedule()
                device.transfer(radix)
                device.run(plan, alloc, poison=True)
                sched.update(plan, [[2] * len(r.samples) if r.samples else None
                                    for r in plan.rows], now=0.0)
                alloc.check(holders=sched.holders())
                radix.check()
                device.check_radix(radix)
            history[c] = list(req.token_ids)
    return sched.counters.computed_prompt_tokens, radix.stats()


def test_multi_turn_conversations_come_back_from_the_host():
    computed_off, off = _multi_turn(0)
    computed_on, on = _multi_turn(64)
    assert off["host_loaded_pages"] == 0
    assert on["host_loaded_pages"] > 0 and on["host_hit_tokens"] > 0
    # Every later turn's history comes back from the host instead of being recomputed.
    assert computed_on < 0.6 * computed_off, (computed_on, computed_off)


def test_a_newer_entry_is_not_dropped_to_make_room_for_an_older_one():
    """One LRU order: demoting an entry older than everything on the host drops it instead."""
    alloc, host, radix = _cache(device_pages=4, host_slots=2)
    _insert(alloc, radix, [1, 2, 3, 4, 5])
    _insert(alloc, radix, [7, 8, 9, 10, 11])
    radix.match_prefix([1, 2, 3, 4, 5])  # [1..5] is now the more recent
    radix.evict(2)  # the LRU, [7..11], goes to the host
    radix.match_prefix([7, 8, 9, 10, 11], peek=True)  # a look changes no recency
    radix.match_prefix([1, 2, 3, 4, 5])
    radix.evict(2)  # [1..5] is newer than the host's entry: it takes the host's place
    assert radix.cached_length([7, 8, 9, 10, 11]) == 0 and radix.cached_length([1, 2, 3]) == 3
    _insert(alloc, radix, [20, 21, 22, 23, 24])  # newest
    radix.evict(2)  # demoting it would need an older host entry to drop: [1..5] is older
    assert radix.cached_length([1, 2, 3, 4, 5]) == 0
    old = _insert(alloc, radix, [30, 31, 32])  # the device has room again
    del old
    radix.check()


def test_scheduler_counts_host_hits_only_for_what_a_request_reuses():
    """A new prompt sharing 5 tokens of a 12-token host entry brings back (and counts) those
    5, not the whole entry."""
    alloc, host, radix = _cache(device_pages=8, host_slots=8)
    _insert(alloc, radix, list(range(10, 22)), cache_namespace(None, 0))  # the scheduler's
    radix.evict(3)
    radix.take_transfers()
    sched = Scheduler(alloc, radix, page_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                      eos_token_ids=(EOS,))
    sched.add(_turn(0, list(range(10, 15)) + [99, 98, 97]))
    plan = sched.schedule()
    [(kind, slots, pages)] = radix.take_transfers()
    assert kind == "load" and len(pages) == 2  # positions 0-4: two pages, not three
    stats = radix.stats()
    assert stats["hit_tokens"] == 5 and stats["host_hit_tokens"] == 5, stats
    assert plan.prefill_rows[0].start == 5
    radix.check()
