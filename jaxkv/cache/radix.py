"""RadixCache: token-exact prefix caching over paged KV (in the spirit of SGLang's RadixAttention).

Plain Python (no jax). A radix tree per namespace maps token prefixes to the pages that hold
their KV. A namespace (``salt``) is any hashable key, opaque here: the engine uses (cache_salt,
weight version), so neither another tenant nor other weights ever reuse an entry
(`jaxkv.engine.request.cache_namespace`); None when the caller needs no namespaces. Token
position i of every sequence lives at offset i % S of the sequence's page i // S, so pages line
up by absolute position and a prefix's pages are reusable as they are.

Node layout: a node's edge label covers absolute positions [start, end) and the node holds one
reference on the page of each page index start // S .. (end - 1) // S. When a boundary falls
inside a page, the parent and the child each hold a page for that index; the child's page has
valid KV for the whole page up to its own end (it was copied from the parent's filled part, then
extended), so a match takes each page index from the deepest matched node covering it. Unlike
full-block caching (vLLM), a match may end anywhere, even mid-edge and mid-page.

Host tier (optional, ``host_allocator``): when the device pool must evict, an LRU leaf whose
pages only the cache holds is *demoted* instead of dropped: its pages are copied to slots of a
host-memory pool and the node keeps the slots. A later query whose prefix runs into host nodes
*promotes* them (`promote`): fresh device pages, contents copied back, no recomputation. Host
nodes only ever hang below device nodes or other host nodes, never above a device node, so a
device match is always a plain path from the root. The cache records each copy it needs in
`transfers` (("save", device pages, host slots) or ("load", host slots, device pages)), in
order; the engine carries them out before the step that reads or reuses those pages. When the
host pool is full, its own LRU leaves are dropped: one LRU order across both tiers.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: this file runs on the standard library alone
    from jaxkv.cache.allocator import PageAllocator


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a query."""

    num_tokens: int  # tokens matched, token-exact (may end inside a page)
    pages: tuple[int, ...]  # page ids for page indices 0 .. ceil(num_tokens / S) - 1; the last
    #                         is only partly valid when num_tokens % S != 0
    handle: object = dataclasses.field(compare=False, repr=False)  # opaque: lock()/unlock()


class _Node:
    """One edge of the tree: tokens at positions [start, end) and their pages."""

    __slots__ = ("key", "start", "pages", "children", "parent", "lock", "holds", "last_access",
                 "id", "alive", "host")

    def __init__(self, key: list[int], start: int, pages: list[int], parent: _Node | None,
                 node_id: int):
        self.key = key  # edge label: the tokens at positions start .. end - 1
        self.start = start
        self.pages = pages  # page ids for page indices start // S .. (end - 1) // S
        self.children: dict[int, _Node] = {}  # keyed by the child's first token
        self.parent = parent
        self.lock = 0  # locks held on this node's handle or below it: not evictable if > 0
        self.holds = 0  # locks held on this very node's handle
        self.last_access = 0
        self.id = node_id  # breaks LRU ties deterministically
        self.alive = True  # False once evicted: a stale handle is an error
        self.host = False  # pages are host-pool slots (demoted), not device pages

    @property
    def end(self) -> int:
        return self.start + len(self.key)


class RadixCache:
    """Prefix cache: match_prefix / insert / lock / unlock / LRU evict, with its own page refs.

    The cache holds one allocator reference per (node, page) it stores; a page returns to the
    free list only when the cache and every running request have dropped theirs. With a
    ``host_allocator`` (slots of a host-memory pool), evicted entries move to the host tier.
    """

    def __init__(self, allocator: PageAllocator, page_size: int,
                 host_allocator: PageAllocator | None = None):
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"RadixCache: page_size must be a positive int, got {page_size!r}")
        self.allocator = allocator
        self.host = host_allocator
        self.transfers: list[tuple[str, list[int], list[int]]] = []  # see the module docstring
        self.page_size = page_size
        self._roots: dict[Hashable, _Node] = {}  # a tree per namespace
        self._ids = itertools.count()
        self._clock = 0
        self._cached_tokens = 0
        self._held_pages = 0
        self._host_held = 0  # host-slot references held by host nodes
        self._host_tokens = 0
        self._stats = dict(query_tokens=0, hit_tokens=0, inserted_tokens=0, evicted_tokens=0,
                           evicted_pages=0, host_hit_tokens=0, host_saved_pages=0,
                           host_loaded_pages=0, host_evicted_tokens=0)
        self.version = 0  # changes whenever entries are added or dropped: matches may differ
        # Device nodes none of whose children is on the device (without a host tier: every
        # non-root node without children), and host nodes without children, by id.
        self._leaves: dict[int, _Node] = {}
        self._host_leaves: dict[int, _Node] = {}

    def match_prefix(self, tokens: Sequence[int], salt: Hashable = None, *,
                     peek: bool = False) -> PrefixMatch:
        """The longest cached prefix of `tokens` in namespace `salt`.

        Changes no refcount (the caller shares the pages it keeps, and locks the handle before
        anything can evict); refreshes the LRU recency of the matched path and counts the
        query in `stats`, unless ``peek`` (a router's look, which changes nothing).
        """
        root = self._roots.get(salt) if peek else self._root(salt)
        node, matched, pages = self._walk(tokens, root) if root else (None, 0, [])
        if not peek:
            if node is not None:
                self._touch(node)
            self._stats["query_tokens"] += len(tokens)
            self._stats["hit_tokens"] += matched
        return PrefixMatch(matched, tuple(pages), node)

    def record(self, match: PrefixMatch, num_query_tokens: int, used: int | None = None,
               from_host: int = 0) -> None:
        """Counts a query of ``num_query_tokens`` answered by ``match`` (from a ``peek``), of
        which ``used`` tokens were reused (default: all matched), ``from_host`` of them brought
        back from the host tier for it, and refreshes its path's recency: for a caller that
        peeks first and uses the match only if it can, so a query retried every step is
        counted once."""
        if isinstance(match.handle, _Node) and match.handle.alive:
            self._touch(match.handle)
        self._stats["query_tokens"] += num_query_tokens
        self._stats["hit_tokens"] += match.num_tokens if used is None else used
        self._stats["host_hit_tokens"] += from_host

    def _walk(self, tokens: Sequence[int], node: _Node) -> tuple[_Node, int, list[int]]:
        """(deepest matched node, tokens matched, page per page index)."""
        s, pos, pages = self.page_size, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or child.host:  # host nodes serve a match once promoted
                break
            m = _common_len(child.key, tokens, pos)
            first, last = child.start // s, (child.start + m - 1) // s
            del pages[first:]  # the deeper node's page supersedes a straddled one
            pages.extend(child.pages[: last - first + 1])
            node, pos = child, pos + m
            if m < len(child.key):
                break
        return node, pos, pages

    def lock(self, handle: object) -> None:
        """Protects the handle's path from eviction until the matching unlock (nestable)."""
        node = self._live(handle)
        node.holds += 1
        for n in _path(node):
            n.lock += 1

    def unlock(self, handle: object) -> None:
        """Undoes one lock() of the same handle."""
        node = self._live(handle)
        if node.holds <= 0:
            raise ValueError("unlock: handle is not locked")
        node.holds -= 1
        for n in _path(node):
            n.lock -= 1

    def _live(self, handle: object) -> _Node:
        if not isinstance(handle, _Node):
            raise TypeError(f"not a RadixCache handle: {handle!r}")
        if not handle.alive:
            raise ValueError("stale handle: its node was evicted (lock right after matching)")
        return handle

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               salt: Hashable = None) -> int:
        """Caches the KV of `tokens` (positions 0 .. len - 1), stored in `pages`, in
        namespace `salt`.

        The cache shares (takes its own reference on) every page it newly stores, so the caller
        still frees its own. Already-cached positions keep the cache's pages. Returns the number
        of tokens newly cached.
        """
        s, n = self.page_size, len(tokens)
        if len(pages) < -(-n // s):
            raise ValueError(f"insert: {n} tokens need {-(-n // s)} pages, got {len(pages)}")
        node, pos, added = self._root(salt), 0, 0
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                added = n - pos
                node = self._add_leaf(node, [int(t) for t in tokens[pos:]],
                                      [int(p) for p in pages[pos // s:(n - 1) // s + 1]])
                break
            m = _common_len(child.key, tokens, pos)
            if m < len(child.key):
                if pos + m == n:  # a prefix of an existing edge: nothing new to cache
                    node = child
                    break
                child = self._split(child, m)
            if child.host:  # the caller computed the same KV again: keep its device pages
                self._adopt(child, pages)
            node, pos = child, pos + m
        self._touch(node)
        self._stats["inserted_tokens"] += added
        return added

    def _add_leaf(self, parent: _Node, key: list[int], pages: list[int]) -> _Node:
        self.allocator.share(pages)  # all or nothing: a bad page id changes no state
        self.version += 1
        leaf = _Node(key, parent.end, pages, parent, next(self._ids))
        parent.children[key[0]] = leaf
        self._reindex(parent)
        self._reindex(leaf)
        self._cached_tokens += len(key)
        self._held_pages += len(pages)
        return leaf

    def _split(self, node: _Node, m: int) -> _Node:
        """Cuts `node` after its first m tokens; returns the new upper half.

        The node object stays the lower half (keeping its children, handles and holds); the
        upper half inherits its lock count, since every lock through the node passes through
        it. A page index straddling the cut is held by both halves, hence the extra share.
        """
        s, mid = self.page_size, node.start + m
        first = node.start // s
        upper = _Node(node.key[:m], node.start, node.pages[: (mid - 1) // s - first + 1],
                      node.parent, next(self._ids))
        upper.lock, upper.last_access, upper.host = node.lock, node.last_access, node.host
        if mid % s:
            self._tier(node).share([node.pages[mid // s - first]])
            if node.host:
                self._host_held += 1
            else:
                self._held_pages += 1
        node.pages = node.pages[mid // s - first:]
        node.key, node.start, node.parent = node.key[m:], mid, upper
        upper.children[node.key[0]] = node
        upper.parent.children[upper.key[0]] = upper
        return upper

    def evict(self, num_pages: int, *, demote: bool = True) -> int:
        """Drops least-recently-used unlocked leaves (or just their tails) until at least
        `num_pages` pages have returned to the free list, or nothing is evictable.

        A leaf (or the part of it) whose pages a running sequence still holds stays cached:
        evicting it would free nothing and lose the entry. (A leaf whose only page its parent
        also holds is dropped, freeing nothing yet: its parent then becomes evictable.)
        With a host tier (and ``demote``), a whole leaf moves to host slots instead of being
        dropped, while the host pool has (or can free) room. Returns the number of device pages
        that became free.
        """
        free_before = self.allocator.num_free
        heap = [(n.last_access, n.id, n) for n in self._leaves.values()
                if n.lock == 0 and self._frees(n, len(n.pages) - 1)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            if not leaf.alive or leaf.host or leaf.id not in self._leaves:
                continue  # dropped or demoted as a host subtree meanwhile
            parent = leaf.parent
            if not (demote and self.host is not None and self._demote(leaf)):
                self._evict_leaf(leaf, num_pages - freed)
            freed = self.allocator.num_free - free_before
            if (parent.parent is not None and parent.id in self._leaves and parent.lock == 0
                    and self._frees(parent, len(parent.pages) - 1)):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self._stats["evicted_pages"] += freed
        # Drop namespaces left empty, so per-request salts (and past weight versions) do not
        # accumulate roots.
        self._roots = {k: r for k, r in self._roots.items()
                       if r.children or r.lock or k is None}
        return freed

    def clear(self) -> int:
        """Evicts every unlocked entry no running sequence holds pages of (the whole cache once
        nothing runs): for when the pages' contents were lost, after the running sequences
        were sent back to wait. Nothing is demoted (the device contents are lost); host entries
        below a dropped device entry go with it, and so does the rest of the host tier (a copy
        to it may not have run). Returns the number of pages that became free."""
        freed = self.evict(self.allocator.num_pages, demote=False)
        self.drop_host_tier()
        self.transfers = []
        return freed

    def drop_host_tier(self) -> None:
        """Drops every host entry (when a copy to or from the host pool may not have run)."""
        if self.host is None:
            return
        for node in list(self._nodes()):
            if node.alive and not node.host:
                for child in [c for c in node.children.values() if c.host]:
                    self._drop_host_subtree(child)

    def _evict_leaf(self, leaf: _Node, need: int) -> None:
        """Drops the leaf's pages from the tail until `need` pages are free; if that is not
        enough, drops the whole leaf. A tail cut keeps the leaf ending on a page boundary."""
        s, free_before = self.page_size, self.allocator.num_free
        self.version += 1
        first = leaf.start // s
        while (len(leaf.pages) > 1 and not leaf.children  # host children start at its end
               and self.allocator.num_free - free_before < need
               and self._frees(leaf, len(leaf.pages) - 1)):
            self.allocator.free([leaf.pages.pop()])
            self._held_pages -= 1
            cut = (first + len(leaf.pages)) * s - leaf.start  # > 0: the first page is kept
            self._stats["evicted_tokens"] += len(leaf.key) - cut
            self._cached_tokens -= len(leaf.key) - cut
            del leaf.key[cut:]
        if self.allocator.num_free - free_before >= need or not all(
                self._frees(leaf, i) for i in range(len(leaf.pages))):
            return  # enough, or the rest is still held by a running sequence: keep the entry
        for child in list(leaf.children.values()):  # host entries below: unreachable now
            self._drop_host_subtree(child)
        self.allocator.free(leaf.pages)
        self._held_pages -= len(leaf.pages)
        self._cached_tokens -= len(leaf.key)
        self._stats["evicted_tokens"] += len(leaf.key)
        del leaf.parent.children[leaf.key[0]]
        leaf.alive = False
        del self._leaves[leaf.id]
        self._reindex(leaf.parent)

    def _tier(self, node: _Node) -> PageAllocator:
        return self.host if node.host else self.allocator

    def _reindex(self, node: _Node) -> None:
        """Files a node under the device or host leaves after its children or tier changed."""
        if node.parent is None or not node.alive:
            return
        if node.host:
            self._leaves.pop(node.id, None)
            if node.children:
                self._host_leaves.pop(node.id, None)
            else:
                self._host_leaves[node.id] = node
            return
        self._host_leaves.pop(node.id, None)
        if any(not c.host for c in node.children.values()):
            self._leaves.pop(node.id, None)
        else:
            self._leaves[node.id] = node

    # ---- the host tier -------------------------------------------------------------------

    def _demote(self, leaf: _Node) -> bool:
        """Moves a device leaf (whose pages only the cache holds) to host slots, making room
        there by dropping host LRU leaves; False (nothing changed) if it cannot."""
        n = len(leaf.pages)
        if not all(self._frees(leaf, i) for i in range(n)):
            return False
        if self.host.num_free < n:  # one LRU order: only host entries older than this one go
            self._drop_host(n - self.host.num_free, older_than=leaf.last_access)
        if self.host.num_free < n:
            return False
        slots = self.host.allocate(n)
        self.transfers.append(("save", list(leaf.pages), slots))
        self.allocator.free(leaf.pages)
        self._held_pages -= n
        self._host_held += n
        self._host_tokens += len(leaf.key)
        leaf.pages, leaf.host = slots, True
        self.version += 1
        self._stats["host_saved_pages"] += n
        self._reindex(leaf)
        self._reindex(leaf.parent)
        return True

    def _drop_host(self, need: int, older_than: int) -> None:
        """Drops LRU unlocked host leaves used before ``older_than`` until ``need`` slots are
        free (or none is left)."""
        free_before = self.host.num_free
        heap = [(n.last_access, n.id, n) for n in self._host_leaves.values()
                if n.lock == 0 and n.last_access <= older_than]
        heapq.heapify(heap)
        while heap and self.host.num_free - free_before < need:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._drop_host_subtree(leaf)
            if (parent.host and parent.id in self._host_leaves and parent.lock == 0
                    and parent.last_access <= older_than):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def _drop_host_subtree(self, node: _Node) -> None:
        for child in list(node.children.values()):
            self._drop_host_subtree(child)
        self.host.free(node.pages)
        self._host_held -= len(node.pages)
        self._host_tokens -= len(node.key)
        self._cached_tokens -= len(node.key)
        self._stats["host_evicted_tokens"] += len(node.key)
        del node.parent.children[node.key[0]]
        node.alive = False
        self._host_leaves.pop(node.id, None)
        self.version += 1
        self._reindex(node.parent)

    def _to_device(self, node: _Node, pages: list[int]) -> None:
        """Gives a host node the device pages ``pages`` (already referenced for it)."""
        self.host.free(node.pages)
        self._host_held -= len(node.pages)
        self._held_pages += len(pages)
        self._host_tokens -= len(node.key)
        node.pages, node.host = pages, False
        self.version += 1
        self._reindex(node)
        self._reindex(node.parent)

    def _adopt(self, node: _Node, pages: Sequence[int]) -> None:
        """A host node on an inserted path takes the inserter's device pages (same KV)."""
        s = self.page_size
        own = [int(p) for p in pages[node.start // s:(node.end - 1) // s + 1]]
        self.allocator.share(own)
        self._to_device(node, own)

    def promote(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """Brings the host nodes on the longest cached path of ``tokens`` back to the device,
        top-down, while device pages can be had (evicting other LRU entries); each one's copy
        is queued in `transfers`. A node the query matches only partly is split first: only
        the matched part moves. Returns the number of tokens promoted (the caller counts the
        ones it reuses, with `record`)."""
        root = self._roots.get(salt)
        if self.host is None or root is None:
            return 0
        node, on_host = self._walk_nodes(tokens, root)
        if not on_host:
            return 0
        matched = node.start + _common_len(node.key, tokens, node.start)
        if matched < node.end:  # the query ends inside the deepest (host) node: split it
            node = self._split(node, matched - node.start)
            on_host[-1] = node
        self.lock(node)  # neither the device path nor these host nodes may go meanwhile
        promoted = 0
        try:
            for n in on_host:
                need = len(n.pages)
                if self.allocator.num_free < need:
                    self.evict(need - self.allocator.num_free)
                if self.allocator.num_free < need:
                    break
                pages = self.allocator.allocate(need)
                self.transfers.append(("load", list(n.pages), pages))
                self._stats["host_loaded_pages"] += need
                promoted += len(n.key)
                self._to_device(n, pages)
        finally:
            self.unlock(node)
        return promoted

    def cached_length(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """How many leading tokens of ``tokens`` either tier holds (a look: no recency change,
        no stats): what a router or the admission order should count as a hit."""
        root = self._roots.get(salt)
        if root is None:
            return 0
        node, _ = self._walk_nodes(tokens, root)
        if node.parent is None:
            return 0
        return node.start + _common_len(node.key, tokens, node.start)

    def take_transfers(self) -> list[tuple[str, list[int], list[int]]]:
        """The copies queued since the last call, in the order they must run."""
        out, self.transfers = self.transfers, []
        return out

    def _frees(self, node: _Node, i: int) -> bool:
        """Whether dropping the cache's references on page ``node.pages[i]`` frees it: only the
        cache holds it (this node, and the ancestors that hold the same page for a page index
        their edges share), so no running sequence still reads it. Evicting an entry that
        frees nothing would lose it while its pages stay in memory."""
        page, refs, index = node.pages[i], 1, node.start // self.page_size + i
        up = node.parent
        while up is not None and up.parent is not None and up.pages and \
                (up.end - 1) // self.page_size == index and up.pages[-1] == page:
            refs, up = refs + 1, up.parent
        return self.allocator.refcount(page) == refs

    def _walk_nodes(self, tokens: Sequence[int], node: _Node) -> tuple[_Node, list[_Node]]:
        """(deepest node matching a prefix of ``tokens`` through both tiers, the host nodes on
        the way)."""
        pos, on_host = 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            m = _common_len(child.key, tokens, pos)
            if child.host:
                on_host.append(child)
            node, pos = child, pos + m
            if m < len(child.key):
                break
        return node, on_host

    def held_pages(self) -> list[int]:
        """Every device page the cache holds a reference on, one entry per reference."""
        return [p for n in self._nodes() if not n.host for p in n.pages]

    def host_held_pages(self) -> list[int]:
        """Every host slot the cache holds a reference on, one entry per reference."""
        return [p for n in self._nodes() if n.host for p in n.pages]

    @property
    def num_cached_tokens(self) -> int:
        """Tokens stored in the tree (a shared prefix counts once)."""
        return self._cached_tokens

    @property
    def num_held_pages(self) -> int:
        """References the cache holds (a page held by two nodes counts twice)."""
        return self._held_pages

    def stats(self) -> dict:
        """Counters for metrics: query/hit tokens since creation, and the current size."""
        q = self._stats["query_tokens"]
        return dict(self._stats, hit_rate=self._stats["hit_tokens"] / q if q else 0.0,
                    cached_tokens=self._cached_tokens, held_pages=self._held_pages,
                    host_tokens=self._host_tokens, host_held_pages=self._host_held,
                    nodes=sum(1 for n in self._nodes() if n.parent is not None))

    def check(self) -> None:
        """Asserts the tree invariants (see the module docstring)."""
        s, tokens, held = self.page_size, 0, []
        for salt, root in self._roots.items():
            assert root.parent is None and not root.key and not root.pages, f"root {salt!r}"
        nodes = [n for n in self._nodes() if n.parent is not None]
        leaves = {n.id for n in nodes if not n.host
                  and all(c.host for c in n.children.values())}
        assert leaves == set(self._leaves), "the leaf index disagrees with the tree"
        host_leaves = {n.id for n in nodes if n.host and not n.children}
        assert host_leaves == set(self._host_leaves), "the host leaf index disagrees"
        host_held, host_tokens = [], 0
        for n in self._nodes():
            assert n.alive, "an evicted node is still in the tree"
            below = sum(c.lock for c in n.children.values())
            assert n.holds >= 0 and n.lock == n.holds + below, f"node {n.id}: lock count {n.lock}"
            for first, child in n.children.items():
                assert child.parent is n, f"node {child.id}: wrong parent"
                assert child.key and child.key[0] == first, f"node {child.id}: keyed by {first}"
                assert child.start == n.end, f"node {child.id}: starts at {child.start} != {n.end}"
                assert n.last_access >= child.last_access, f"node {n.id}: older than its child"
            if n.parent is None:
                continue
            covers = (n.end - 1) // s - n.start // s + 1
            assert len(n.pages) == covers, f"node {n.id}: {len(n.pages)} pages for {covers}"
            if n.host:
                assert self.host is not None, f"node {n.id}: on the host without a host tier"
                assert all(c.host for c in n.children.values()), f"node {n.id}: a device " \
                    "node below a host node"
                tokens, host_held = tokens + len(n.key), host_held + n.pages
                host_tokens += len(n.key)
                continue
            tokens, held = tokens + len(n.key), held + n.pages
        assert tokens == self._cached_tokens, f"cached tokens {self._cached_tokens} != {tokens}"
        assert len(held) == self._held_pages, f"held pages {self._held_pages} != {len(held)}"
        assert len(host_held) == self._host_held, f"host refs {self._host_held} != {len(host_held)}"
        assert host_tokens == self._host_tokens, f"host tokens {self._host_tokens} != {host_tokens}"
        for p, refs in Counter(held).items():
            assert self.allocator.refcount(p) >= refs, (
                f"cache holds {refs} refs on page {p}, allocator counts only "
                f"{self.allocator.refcount(p)}")
        if self.host is not None:  # only the cache holds host slots: counts must be exact
            self.host.check([[p] for p in host_held])

    def _root(self, salt: Hashable) -> _Node:
        if salt not in self._roots:
            self._roots[salt] = _Node([], 0, [], None, next(self._ids))
        return self._roots[salt]

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        for n in _path(node):
            n.last_access = self._clock

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._roots.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def _path(node: _Node) -> Iterator[_Node]:
    """The node and its ancestors, up to and including the root."""
    while node is not None:
        yield node
        node = node.parent


def _common_len(key: list[int], tokens: Sequence[int], pos: int) -> int:
    """Length of the common prefix of `key` and tokens[pos:] (whole runs compared as slices,
    in C, then the first differing run token by token)."""
    limit = min(len(key), len(tokens) - pos)
    m, run = 0, 64
    while m + run <= limit and key[m:m + run] == list(tokens[pos + m:pos + m + run]):
        m += run
    while m < limit and key[m] == tokens[pos + m]:
        m += 1
    return m
