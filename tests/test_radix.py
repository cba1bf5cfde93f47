"""RadixCache: token-exact prefix matching, splits, namespaces, locking, LRU eviction, and a
stateful simulation of requests that proves every match reads back exactly the matched tokens."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jaxkv.cache.allocator import OutOfPagesError, PageAllocator
from jaxkv.cache.host_radix import HostTieredRadixCache
from jaxkv.cache.prefix import COUNTERS, SIZES, NullPrefixCache, PrefixCache
from jaxkv.cache.radix import PrefixMatch, RadixCache

pytestmark = pytest.mark.host  # no engine: `make test-fast`


def make(num_pages=16, page_size=4):
    a = PageAllocator(num_pages)
    return a, RadixCache(a, page_size)


def cache_sequence(a, r, tokens, salt=None):
    """A request that computed `tokens` on its own pages, cached them, and finished."""
    pages = a.allocate(math.ceil(len(tokens) / r.page_size))
    added = r.insert(tokens, pages, salt)
    a.free(pages)
    return pages, added


def assert_consistent(a, r, *requests):
    a.check(holders=[*requests, *([p] for p in r.held_pages())])
    r.check()


def test_match_is_token_exact_and_changes_no_refcount():
    a, r = make()
    seq = list(range(10))
    pages, added = cache_sequence(a, r, seq)
    assert added == 10 and r.num_cached_tokens == 10 and r.num_held_pages == 3
    before = [a.refcount(p) for p in range(a.num_pages)]
    assert r.match_prefix(seq) == PrefixMatch(10, tuple(pages), None)
    m = r.match_prefix(seq[:6] + [99, 7])  # ends inside page 1
    assert (m.num_tokens, m.pages) == (6, tuple(pages[:2]))
    assert r.match_prefix(seq + [10, 11]).num_tokens == 10
    assert r.match_prefix([5, 1]) == PrefixMatch(0, (), None)
    assert [a.refcount(p) for p in range(a.num_pages)] == before
    assert_consistent(a, r)


def test_split_mid_page_uses_deepest_page():
    a, r = make()
    A = list(range(10))
    pa, _ = cache_sequence(a, r, A)
    # B shares A's first 6 tokens: it reuses page 0, copies page 1's filled part, then extends.
    B = A[:6] + [50, 51, 52]
    m = r.match_prefix(B)
    assert m.num_tokens == 6
    pb = [pa[0], *a.allocate(2)]
    a.share(pb[:1])
    assert r.insert(B, pb, None) == 3
    a.free(pb)
    assert r.stats()["nodes"] == 3  # [0, 6) -> {[6, 10), [6, 9)}
    assert a.refcount(pa[1]) == 2  # the straddled page is held by both halves of A's edge
    assert r.match_prefix(A).pages == tuple(pa)
    assert r.match_prefix(B).pages == tuple(pb)
    assert r.match_prefix(A[:6] + [77]).pages == tuple(pa[:2])
    assert r.match_prefix(A[:7]).pages == tuple(pa[:2])  # mid-edge in the lower half
    assert_consistent(a, r)


def test_split_on_page_boundary_takes_no_extra_ref():
    a, r = make()
    A = list(range(10))
    pa, _ = cache_sequence(a, r, A)
    pb, _ = cache_sequence(a, r, A[:8] + [40, 41])
    assert [a.refcount(p) for p in pa] == [1, 1, 1]
    assert r.match_prefix(A[:8] + [40]).pages == (pa[0], pa[1], pb[2])
    assert_consistent(a, r)


def test_insert_of_cached_prefix_adds_nothing():
    a, r = make()
    cache_sequence(a, r, list(range(8)))
    pages = a.allocate(2)
    assert r.insert(list(range(5)), pages) == 0  # ends inside an edge: no split
    assert r.insert(list(range(8)), pages) == 0
    assert r.stats()["nodes"] == 1 and r.num_held_pages == 2
    a.free(pages)
    with pytest.raises(ValueError, match="need 3 pages, got 2"):
        r.insert(list(range(9)), pages)
    assert_consistent(a, r)


def test_salts_are_isolated():
    a, r = make()
    seq = [1, 2, 3, 4, 5]
    pa, _ = cache_sequence(a, r, seq, salt="alice")
    assert r.match_prefix(seq).num_tokens == 0
    assert r.match_prefix(seq, salt="bob").num_tokens == 0
    pn, added = cache_sequence(a, r, seq)
    assert added == 5 and not set(pn) & set(pa)
    assert r.match_prefix(seq, salt="alice").pages == tuple(pa)
    assert r.match_prefix(seq).pages == tuple(pn)
    assert_consistent(a, r)


def test_lock_prevents_eviction_and_nests():
    a, r = make(num_pages=4)
    pages, _ = cache_sequence(a, r, list(range(8)))
    m = r.match_prefix(list(range(5)))
    r.lock(m.handle)
    r.lock(m.handle)
    assert r.evict(4) == 0 and r.num_held_pages == 2
    r.unlock(m.handle)
    assert r.evict(4) == 0
    r.unlock(m.handle)
    with pytest.raises(ValueError, match="not locked"):
        r.unlock(m.handle)
    assert r.evict(4) == 2 and a.num_free == 4 and r.num_cached_tokens == 0
    with pytest.raises(ValueError, match="stale handle"):
        r.lock(m.handle)
    with pytest.raises(TypeError):
        r.lock(object())
    assert_consistent(a, r)


def test_locked_child_protects_its_ancestors():
    a, r = make()
    cache_sequence(a, r, [1, 2, 3, 4, 5, 6])
    cache_sequence(a, r, [1, 2, 3, 4, 9, 9])  # splits at 4: parent [0,4) + two leaves
    m = r.match_prefix([1, 2, 3, 4, 9])
    r.lock(m.handle)
    with pytest.raises(ValueError, match="not locked"):
        r.unlock(r.match_prefix([1, 2]).handle)  # the shared parent: locked only through m
    assert r.evict(10) == 1  # only the unlocked leaf [4, 6) of the first sequence
    assert r.match_prefix([1, 2, 3, 4, 9, 9]).num_tokens == 6
    r.unlock(m.handle)
    assert r.evict(10) == 2 and r.num_held_pages == 0  # leaf, then its parent
    assert_consistent(a, r)


def test_lru_order_and_parent_becomes_evictable():
    a, r = make(page_size=1)
    cache_sequence(a, r, [1, 1])
    cache_sequence(a, r, [2, 2])
    cache_sequence(a, r, [3, 3])
    r.match_prefix([1, 1])  # now [2, 2] is the least recently used
    assert r.evict(2) == 2
    assert r.match_prefix([2]).num_tokens == 0
    assert r.match_prefix([1, 1]).num_tokens == r.match_prefix([3, 3]).num_tokens == 2
    cache_sequence(a, r, [5, 6])
    cache_sequence(a, r, [5, 7])  # [5] -> {[6], [7]}
    r.match_prefix([1, 1])
    r.match_prefix([3, 3])  # [5]'s subtree is now the oldest
    assert r.evict(3) == 3  # both leaves, then [5], which became a leaf
    assert r.match_prefix([5]).num_tokens == 0 and r.num_cached_tokens == 4
    assert_consistent(a, r)


def test_tail_eviction_frees_only_what_is_needed():
    a, r = make()
    seq = list(range(14))
    cache_sequence(a, r, seq)
    assert r.evict(2) == 2
    assert r.match_prefix(seq).num_tokens == 8 and r.num_cached_tokens == 8
    assert r.stats()["evicted_tokens"] == 6 and r.stats()["evicted_pages"] == 2
    assert_consistent(a, r)


def test_eviction_keeps_entries_whose_pages_a_running_sequence_holds():
    a, r = make(num_pages=8)
    held = a.allocate(2)  # a running request still holds these
    r.insert(list(range(8)), held)
    cache_sequence(a, r, [9, 9, 9, 9])
    # Only the finished sequence's page can be freed; dropping the running one's entry would
    # free nothing and lose it while its pages stay in memory.
    assert r.evict(8) == 1
    assert r.match_prefix(list(range(8))).num_tokens == 8 and r.num_held_pages == 2
    assert a.num_free == 6
    assert_consistent(a, r, held)
    a.free(held)  # the request finished: now its entry frees pages
    assert r.evict(8) == 2 and r.num_held_pages == 0 and a.num_free == 8


def test_eviction_frees_a_leaf_whose_first_page_its_parent_shares():
    a, r = make(num_pages=8)
    cache_sequence(a, r, [1, 2, 3, 4, 5, 6])  # pages for [1..4], [5, 6]
    cache_sequence(a, r, [1, 2, 3, 4, 5, 7])  # splits after 5: both halves hold page index 1
    assert r.evict(8) == 3  # the cache alone holds them all, a page two nodes share included
    assert r.num_held_pages == 0 and a.num_free == 8
    assert_consistent(a, r)


def test_stats_count_query_and_hit_tokens():
    a, r = make()
    cache_sequence(a, r, [1, 2, 3])
    r.match_prefix([1, 2, 3, 4])
    r.match_prefix([1, 2, 9, 9])
    s = r.stats()
    assert (s["query_tokens"], s["hit_tokens"], s["hit_rate"]) == (8, 5, 5 / 8)
    assert (s["cached_tokens"], s["held_pages"], s["inserted_tokens"]) == (3, 1, 3)


def test_check_catches_corruption():
    a, r = make()
    cache_sequence(a, r, list(range(6)))
    cache_sequence(a, r, [0, 1, 2, 3, 4, 9])
    leaf = r.match_prefix([0, 1, 2, 3, 4, 9]).handle
    leaf.pages.append(leaf.pages[0])
    with pytest.raises(AssertionError, match="2 pages for 1"):
        r.check()
    leaf.pages.pop()
    leaf.holds = 1  # a lock that skipped the path to the root
    with pytest.raises(AssertionError, match="lock count 0"):
        r.check()


def test_host_bookkeeping_runs_without_jax():
    """The allocator and the prefix caches import on the standard library alone (empty
    packages stand in for jaxkv and jaxkv.cache, whose __init__ would import the engine)."""
    root = Path(__file__).parents[1] / "jaxkv"
    code = (
        "import sys, types\n"
        f"for name, path in (('jaxkv', {str(root)!r}), ('jaxkv.cache', {str(root / 'cache')!r})):\n"
        "    sys.modules[name] = types.ModuleType(name)\n"
        "    sys.modules[name].__path__ = [path]\n"
        "import jaxkv.cache.allocator, jaxkv.cache.host_radix, jaxkv.cache.prefix\n"
        "assert not {'jax', 'numpy'} & set(sys.modules), sorted(sys.modules)\n"
        "ours = sorted(m for m in sys.modules if m.startswith('jaxkv.'))\n"
        "assert ours == ['jaxkv.cache', 'jaxkv.cache.allocator', 'jaxkv.cache.host_radix',\n"
        "    'jaxkv.cache.prefix', 'jaxkv.cache.radix', 'jaxkv.cache.radix_node',\n"
        "    'jaxkv.config', 'jaxkv.config_checks', 'jaxkv.config_speculative', 'jaxkv.spec',\n"
        "    'jaxkv.spec.methods'], ours\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_prefix_cache_has_the_protocols_methods_and_stats_keys():
    """The null, radix and host-tiered caches answer every `PrefixCache` method, and report
    the same stats keys, so callers need no branch per implementation."""
    alloc = PageAllocator(4)
    caches = [NullPrefixCache(), RadixCache(alloc, 2),
              HostTieredRadixCache(alloc, 2, PageAllocator(2))]
    wanted = [n for n in (*vars(PrefixCache), *PrefixCache.__annotations__)
              if not n.startswith("_")]
    assert {"match_prefix", "promote", "take_transfers", "enabled", "version"} <= set(wanted)
    for cache in caches:
        missing = [n for n in wanted if not hasattr(cache, n)]
        assert not missing, (type(cache).__name__, missing)
        cache.check()
    keys = [list(c.stats()) for c in caches]
    assert keys[0] == keys[1] == keys[2] == [*COUNTERS, "hit_rate", *SIZES], keys
    assert [c.enabled for c in caches] == [False, True, True]


def test_the_null_cache_keeps_nothing():
    """Prefix caching off: an insert takes no page reference, so the caller's free returns
    the pages at once, and nothing ever matches."""
    alloc, null = PageAllocator(4), NullPrefixCache()
    pages = alloc.allocate(2)
    assert null.insert([1, 2, 3], pages) == 0
    alloc.free(pages)
    assert alloc.num_free == 4 and null.held_pages() == []
    m = null.match_prefix([1, 2, 3])
    assert (m.num_tokens, m.pages) == (0, ()) and null.cached_length([1, 2, 3]) == 0
    assert null.evict(4) == null.clear() == null.promote([1, 2, 3]) == 0
    assert null.take_transfers() == [] and null.stats()["hit_tokens"] == 0


# ---- stateful simulation ----------------------------------------------------------------

ALPHABET = st.integers(0, 2)
MAX_LEN = {1: 12, 4: 24, 16: 40}


class Request:
    """A running sequence: the tokens whose KV it has, its page table, its lock on the cache."""

    def __init__(self, tokens, pages, salt, handle):
        self.tokens, self.pages, self.salt, self.handle = tokens, pages, salt, handle


class RadixMachine(RuleBasedStateMachine):
    """Requests match, lock, copy-on-write the partial page, compute the rest on their own pages
    (writing (salt, position, token) into a fake device), insert on finish, release, unlock;
    eviction runs under page pressure. Every match must read back exactly its tokens."""

    @initialize(page_size=st.sampled_from(sorted(MAX_LEN)))
    def setup(self, page_size):
        self.page_size, self.max_len = page_size, MAX_LEN[page_size]
        self.alloc = PageAllocator(3 * math.ceil(self.max_len / page_size) + 1)
        self.radix = RadixCache(self.alloc, page_size)
        self.device = {}  # page id -> [(salt, position, token) or garbage] * page_size
        self.live, self.seen, self.next_id = {}, [], 0

    def draw_tokens(self, data, min_size=1):
        tokens = data.draw(st.lists(ALPHABET, min_size=min_size, max_size=self.max_len))
        if self.seen and data.draw(st.booleans()):  # share a prefix with an earlier sequence
            base = data.draw(st.sampled_from(self.seen))
            cut = data.draw(st.integers(0, len(base)))
            tokens = (base[:cut] + tokens)[: self.max_len]
        return tokens

    def verify(self, m, tokens, salt):
        S = self.page_size
        assert 0 <= m.num_tokens <= len(tokens)
        assert len(m.pages) == math.ceil(m.num_tokens / S)
        for i in range(m.num_tokens):
            assert self.device[m.pages[i // S]][i % S] == (salt, i, tokens[i]), (i, m)

    def reserve(self, n):
        """n free pages, evicting cached ones if needed; False if even that is not enough."""
        if self.alloc.num_free < n:
            self.radix.evict(n - self.alloc.num_free)
        return self.alloc.num_free >= n

    def allocate(self, n):
        pages = self.alloc.allocate(n)
        for p in pages:  # fresh pages hold garbage, never a previous owner's KV
            self.device[p] = [("garbage",)] * self.page_size
        return pages

    def write(self, req, tokens):
        S = self.page_size
        for tok in tokens:
            pos = len(req.tokens)
            if pos // S == len(req.pages):
                req.pages += self.allocate(1)
            page = req.pages[pos // S]
            assert self.alloc.refcount(page) == 1, "a request writes only pages it owns alone"
            self.device[page][pos % S] = (req.salt, pos, tok)
            req.tokens.append(tok)

    @rule(data=st.data(), salt=st.sampled_from([None, "a"]))
    def start(self, data, salt):
        tokens = self.draw_tokens(data)
        self.seen.append(tokens)
        m = self.radix.match_prefix(tokens, salt)
        self.verify(m, tokens, salt)
        self.radix.lock(m.handle)  # before anything can evict
        partial = m.num_tokens % self.page_size != 0
        need = partial + math.ceil(len(tokens) / self.page_size) - len(m.pages)
        if not self.reserve(need):
            self.radix.unlock(m.handle)
            return
        req = Request(list(tokens[: m.num_tokens]), list(m.pages), salt, m.handle)
        self.alloc.share(req.pages)
        if partial:
            new, copied = self.alloc.copy_on_write(req.pages[-1])
            assert copied  # the cache still holds the original
            self.device[new] = list(self.device[req.pages[-1]])
            req.pages[-1] = new
        self.write(req, tokens[m.num_tokens:])
        self.live[self.next_id], self.next_id = req, self.next_id + 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        room = self.max_len - len(req.tokens)
        new = data.draw(st.lists(ALPHABET, max_size=min(room, 6)))
        extra = math.ceil((len(req.tokens) + len(new)) / self.page_size) - len(req.pages)
        if self.reserve(extra):
            self.write(req, new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), abort=st.integers(0, 3))
    def finish(self, data, abort):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        if abort != 0:  # 1 in 4 requests aborts: its pages are released, not cached
            before = self.radix.num_cached_tokens
            added = self.radix.insert(req.tokens, req.pages, req.salt)
            assert self.radix.num_cached_tokens == before + added
            m = self.radix.match_prefix(req.tokens, req.salt)
            assert m.num_tokens == len(req.tokens)
            self.verify(m, req.tokens, req.salt)
            self.seen.append(req.tokens)
        self.alloc.free(req.pages)
        self.radix.unlock(req.handle)

    @rule(data=st.data(), salt=st.sampled_from([None, "a", "b"]))
    def match_only(self, data, salt):
        tokens = self.draw_tokens(data)
        self.verify(self.radix.match_prefix(tokens, salt), tokens, salt)

    @rule(n=st.integers(1, 8))
    def evict(self, n):
        free_before = self.alloc.num_free
        freed = self.radix.evict(n)
        assert freed == self.alloc.num_free - free_before
        if freed < n:  # nothing evictable is left
            held = self.radix.num_held_pages
            assert self.radix.evict(1) == 0 and self.radix.num_held_pages == held

    @invariant()
    def consistent(self):
        holders = [r.pages for r in self.live.values()]
        self.alloc.check(holders=holders + [[p] for p in self.radix.held_pages()])
        self.radix.check()
        assert self.radix.num_held_pages == len(self.radix.held_pages())


RadixMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_radix_simulation = RadixMachine.TestCase


def test_out_of_pages_is_the_allocators_error():
    a, r = make(num_pages=1)
    cache_sequence(a, r, [1])
    with pytest.raises(OutOfPagesError):
        a.allocate(1)
    assert r.evict(1) == 1 and a.allocate(1)
