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
full-block caching (vLLM), a match may end anywhere, even mid-edge and mid-page. Callers insert
tokens only once their pages hold the tokens' KV (the scheduler offers computed pages), so a
node is on the device only once its pages hold its tokens, and a match reads what it matched.

This class keeps every entry on the device and drops evicted ones; the host-memory tier that
keeps them instead is its subclass, `jaxkv.cache.host_radix.HostTieredRadixCache`, through the
hooks marked below.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

from jaxkv.cache.prefix import COUNTERS, PrefixMatch, Transfer
from jaxkv.cache.radix_node import Node, RadixEntry, common_len, path_to_root
from jaxkv.config import cdiv

if TYPE_CHECKING:  # only for annotations: this file runs on the standard library alone
    from jaxkv.cache.allocator import PageAllocator

__all__ = ["PrefixMatch", "RadixCache", "RadixEntry"]


class RadixCache:
    """Prefix cache on device pages: match_prefix / insert / lock / unlock / LRU evict, with
    its own page refs (a `jaxkv.cache.prefix.PrefixCache`).

    The cache holds one allocator reference per (node, page) it stores; a page returns to the
    free list only when the cache and every running request have dropped theirs.
    """

    enabled: ClassVar[bool] = True
    _node_type: ClassVar[type[Node]] = Node

    def __init__(self, allocator: PageAllocator, page_size: int):
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"{type(self).__name__}: page_size must be a positive int, got "
                             f"{page_size!r}")
        self.allocator = allocator
        self.page_size = page_size
        self._roots: dict[Hashable, Node] = {}  # a tree per namespace
        self._ids = itertools.count()
        self._clock = 0
        self._cached_tokens = 0
        self._held_pages = 0
        self._stats = dict.fromkeys(COUNTERS, 0)
        self.version = 0  # changes whenever entries are added or dropped: matches may differ
        # Device nodes none of whose children is on the device (here: every non-root node
        # without children), by id: the eviction candidates.
        self._leaves: dict[int, Node] = {}

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
        back from a host tier for it, and refreshes its path's recency: for a caller that
        peeks first and uses the match only if it can, so a query retried every step is
        counted once."""
        if isinstance(match.handle, Node) and match.handle.alive:
            self._touch(match.handle)
        self._stats["query_tokens"] += num_query_tokens
        self._stats["hit_tokens"] += match.num_tokens if used is None else used
        self._stats["host_hit_tokens"] += from_host

    def _walk(self, tokens: Sequence[int], node: Node) -> tuple[Node, int, list[int]]:
        """(deepest matched node, tokens matched, page per page index), on the device only."""
        s, pos, pages = self.page_size, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or not self._on_device(child):
                break
            m = common_len(child.key, tokens, pos)
            first, last = child.start // s, (child.start + m - 1) // s
            del pages[first:]  # the deeper node's page supersedes a straddled one
            pages.extend(child.pages[: last - first + 1])
            node, pos = child, pos + m
            if m < len(child.key):
                break
        return node, pos, pages

    def _descend(self, tokens: Sequence[int], node: Node) -> list[Node]:
        """The nodes below ``node`` that a prefix of ``tokens`` runs through, in any tier; the
        last one may match only partly."""
        pos, path = 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            m = common_len(child.key, tokens, pos)
            path.append(child)
            node, pos = child, pos + m
            if m < len(child.key):
                break
        return path

    def cached_length(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """How many leading tokens of ``tokens`` the cache holds in any tier (a look: no
        recency change, no stats): what a router or the admission order should count as a
        hit."""
        root = self._roots.get(salt)
        path = self._descend(tokens, root) if root is not None else []
        if not path:
            return 0
        node = path[-1]
        return node.start + common_len(node.key, tokens, node.start)

    def lock(self, handle: object) -> None:
        """Protects the handle's path from eviction until the matching unlock (nestable)."""
        node = self._live(handle)
        node.holds += 1
        for n in path_to_root(node):
            n.lock += 1

    def unlock(self, handle: object) -> None:
        """Undoes one lock() of the same handle."""
        node = self._live(handle)
        if node.holds <= 0:
            raise ValueError("unlock: handle is not locked")
        node.holds -= 1
        for n in path_to_root(node):
            n.lock -= 1

    def _live(self, handle: object) -> Node:
        if not isinstance(handle, Node):
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
        if len(pages) < cdiv(n, s):
            raise ValueError(f"insert: {n} tokens need {cdiv(n, s)} pages, got {len(pages)}")
        node, pos, added = self._root(salt), 0, 0
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                added = n - pos
                node = self._add_leaf(node, [int(t) for t in tokens[pos:]],
                                      [int(p) for p in pages[pos // s:(n - 1) // s + 1]])
                break
            m = common_len(child.key, tokens, pos)
            if m < len(child.key):
                if pos + m == n:  # a prefix of an existing edge: nothing new to cache
                    node = child
                    break
                child = self._split(child, m)
            self._recomputed(child, pages)
            node, pos = child, pos + m
        self._touch(node)
        self._stats["inserted_tokens"] += added
        return added

    def _add_leaf(self, parent: Node, key: list[int], pages: list[int]) -> Node:
        self.allocator.share(pages)  # all or nothing: a bad page id changes no state
        self.version += 1
        leaf = self._node_type(key, parent.end, pages, parent, next(self._ids))
        parent.children[key[0]] = leaf
        self._reindex(parent)
        self._reindex(leaf)
        self._cached_tokens += len(key)
        self._held_pages += len(pages)
        return leaf

    def _split(self, node: Node, m: int) -> Node:
        """Cuts `node` after its first m tokens; returns the new upper half.

        The node object stays the lower half (keeping its children, handles and holds); the
        upper half inherits its lock count, since every lock through the node passes through
        it. A page index straddling the cut is held by both halves, hence the extra share.
        """
        s, mid = self.page_size, node.start + m
        first = node.start // s
        upper = self._node_type(node.key[:m], node.start,
                                node.pages[: (mid - 1) // s - first + 1], node.parent,
                                next(self._ids))
        upper.lock, upper.last_access = node.lock, node.last_access
        if mid % s:
            self._share_cut_page(node, node.pages[mid // s - first])
        node.pages = node.pages[mid // s - first:]
        node.key, node.start, node.parent = node.key[m:], mid, upper
        upper.children[node.key[0]] = node
        upper.parent.children[upper.key[0]] = upper
        return upper

    def evict(self, num_pages: int) -> int:
        """Drops least-recently-used unlocked leaves (or just their tails) until at least
        `num_pages` pages have returned to the free list, or nothing is evictable.

        A leaf (or the part of it) whose pages a running sequence still holds stays cached:
        evicting it would free nothing and lose the entry. (A leaf whose only page its parent
        also holds is dropped, freeing nothing yet: its parent then becomes evictable.)
        Returns the number of device pages that became free.
        """
        return self._evict(num_pages, keep=True)

    def _evict(self, num_pages: int, *, keep: bool) -> int:
        """`evict`; ``keep``: a tier behind the device may keep what leaves it (`_retire`)."""
        free_before = self.allocator.num_free
        heap = [(n.last_access, n.id, n) for n in self._leaves.values()
                if n.lock == 0 and self._frees(n, len(n.pages) - 1)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            if not leaf.alive or leaf.id not in self._leaves:
                continue  # dropped, or moved off the device, meanwhile
            parent = leaf.parent
            self._retire(leaf, num_pages - freed, keep)
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
        were sent back to wait. Returns the number of pages that became free."""
        return self._evict(self.allocator.num_pages, keep=False)

    def promote(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """0: every entry is on the device (no tier to bring entries back from)."""
        return 0

    def drop_host_tier(self) -> None:
        """Nothing to drop: no entry is off the device."""

    def take_transfers(self) -> list[Transfer]:
        """No copy is ever queued: no entry leaves the device."""
        return []

    def _evict_leaf(self, leaf: Node, need: int) -> None:
        """Drops the leaf's pages from the tail until `need` pages are free; if that is not
        enough, drops the whole leaf. A tail cut keeps the leaf ending on a page boundary."""
        s, free_before = self.page_size, self.allocator.num_free
        self.version += 1
        first = leaf.start // s
        while (len(leaf.pages) > 1 and not leaf.children  # children start at its end
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
        self._drop_children(leaf)
        self.allocator.free(leaf.pages)
        self._held_pages -= len(leaf.pages)
        self._cached_tokens -= len(leaf.key)
        self._stats["evicted_tokens"] += len(leaf.key)
        del leaf.parent.children[leaf.key[0]]
        leaf.alive = False
        del self._leaves[leaf.id]
        self._reindex(leaf.parent)

    def _frees(self, node: Node, i: int) -> bool:
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

    # ---- hooks: what a tier behind the device changes ----------------------------------------

    def _on_device(self, node: Node) -> bool:
        """Whether the node's pages are device pages (only those serve a match)."""
        return True

    def _recomputed(self, node: Node, pages: Sequence[int]) -> None:
        """An insert ran through ``node``: the caller holds its KV again in ``pages``."""

    def _share_cut_page(self, node: Node, page: int) -> None:
        """A split gives both halves of ``node`` the page straddling the cut."""
        self.allocator.share([page])
        self._held_pages += 1

    def _retire(self, leaf: Node, need: int, keep: bool) -> None:
        """Eviction's move for one LRU leaf, toward ``need`` free pages: drop it (or its tail)."""
        self._evict_leaf(leaf, need)

    def _drop_children(self, leaf: Node) -> None:
        """A device leaf is dropped: so are its children (none here)."""

    def _reindex(self, node: Node) -> None:
        """Files a node under the leaves, or not, after its children changed."""
        if node.parent is None or not node.alive:
            return
        if node.children:
            self._leaves.pop(node.id, None)
        else:
            self._leaves[node.id] = node

    def _is_leaf(self, node: Node) -> bool:
        """Whether `_leaves` should hold the node (for `check`)."""
        return not node.children

    # ---- accounting ----------------------------------------------------------------------

    def held_pages(self) -> list[int]:
        """Every device page the cache holds a reference on, one entry per reference."""
        return [p for n in self._nodes() if self._on_device(n) for p in n.pages]

    def entries(self) -> Iterator[RadixEntry]:
        """Every node below the roots, parents before their children."""
        for salt, root in self._roots.items():
            stack = [(child, tuple(child.key)) for child in root.children.values()]
            while stack:
                node, path = stack.pop()
                yield RadixEntry(salt, path, node.start, tuple(node.pages), self._on_device(node))
                stack += [(c, path + tuple(c.key)) for c in node.children.values()]

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
                    host_tokens=0, host_held_pages=0,
                    nodes=sum(1 for n in self._nodes() if n.parent is not None))

    def check(self) -> None:
        """Asserts the tree invariants (see the module docstring)."""
        s, tokens, held = self.page_size, 0, []
        for salt, root in self._roots.items():
            assert root.parent is None and not root.key and not root.pages, f"root {salt!r}"
        leaves = {n.id for n in self._nodes() if n.parent is not None and self._is_leaf(n)}
        assert leaves == set(self._leaves), "the leaf index disagrees with the tree"
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
            tokens += len(n.key)
            if self._on_device(n):
                held += n.pages
        assert tokens == self._cached_tokens, f"cached tokens {self._cached_tokens} != {tokens}"
        assert len(held) == self._held_pages, f"held pages {self._held_pages} != {len(held)}"
        for p, refs in Counter(held).items():
            assert self.allocator.refcount(p) >= refs, (
                f"cache holds {refs} refs on page {p}, allocator counts only "
                f"{self.allocator.refcount(p)}")

    def _root(self, salt: Hashable) -> Node:
        if salt not in self._roots:
            self._roots[salt] = self._node_type([], 0, [], None, next(self._ids))
        return self._roots[salt]

    def _touch(self, node: Node) -> None:
        self._clock += 1
        for n in path_to_root(node):
            n.last_access = self._clock

    def _nodes(self) -> Iterator[Node]:
        stack = list(self._roots.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

