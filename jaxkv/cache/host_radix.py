"""HostTieredRadixCache: the radix prefix cache with a host-memory tier behind it (in the spirit
of SGLang's HiRadixCache over its RadixCache).

Plain Python (no jax). When the device pool must evict, an LRU leaf whose pages only the cache
holds is *demoted* instead of dropped: its pages are copied to slots of a host-memory pool (a
`PageAllocator` over `jaxkv.engine.host_tier.HostKVPool`'s slots) and the node keeps the slots.
A later query whose prefix runs into host nodes *promotes* them (`promote`): fresh device
pages, contents copied back, no recomputation. Host nodes only ever hang below device nodes or
other host nodes, never above a device node, so a device match is always a plain path from the
root. The cache queues each copy it needs as a `Transfer` (("save", device pages, host slots)
or ("load", host slots, device pages)), in order; the engine takes them (`take_transfers`) and
carries them out before the step that reads or reuses those pages, so a node is on the device
only once its pages hold its tokens. When the host pool is full, its own LRU leaves are
dropped: one LRU order across both tiers.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, ClassVar

from jaxkv.cache.prefix import Transfer
from jaxkv.cache.radix import RadixCache
from jaxkv.cache.radix_node import Node, common_len

if TYPE_CHECKING:  # only for annotations: this file runs on the standard library alone
    from jaxkv.cache.allocator import PageAllocator


class _TierNode(Node):
    """A node that knows its tier: device pages, or host slots once demoted."""

    __slots__ = ("host",)

    def __init__(self, key: list[int], start: int, pages: list[int], parent: Node | None,
                 node_id: int):
        super().__init__(key, start, pages, parent, node_id)
        self.host = False  # pages are host-pool slots (demoted), not device pages


class HostTieredRadixCache(RadixCache):
    """A `RadixCache` whose evicted entries move to ``host_allocator``'s slots, and come back
    to the device on a hit (`promote`)."""

    _node_type: ClassVar[type[Node]] = _TierNode

    def __init__(self, allocator: PageAllocator, page_size: int, host_allocator: PageAllocator):
        super().__init__(allocator, page_size)
        self.host = host_allocator
        self._transfers: list[Transfer] = []  # queued copies, see the module docstring
        self._host_held = 0  # host-slot references held by host nodes
        self._host_tokens = 0
        self._host_leaves: dict[int, _TierNode] = {}  # host nodes without children, by id

    # ---- the tier: what it changes in the tree's moves -----------------------------------

    def _on_device(self, node: _TierNode) -> bool:
        return not node.host

    def _recomputed(self, node: _TierNode, pages: Sequence[int]) -> None:
        if node.host:  # the caller computed the same KV again: keep its device pages
            self._adopt(node, pages)

    def _split(self, node: _TierNode, m: int) -> _TierNode:
        upper = super()._split(node, m)
        upper.host = node.host
        return upper

    def _share_cut_page(self, node: _TierNode, page: int) -> None:
        if not node.host:
            super()._share_cut_page(node, page)
            return
        self.host.share([page])
        self._host_held += 1

    def _retire(self, leaf: _TierNode, need: int, keep: bool) -> None:
        """Moves a whole leaf to host slots while the host pool has (or can free) room (and
        ``keep``: `clear` keeps nothing, the device contents are lost); else drops it."""
        if not (keep and self._demote(leaf)):
            self._evict_leaf(leaf, need)

    def _drop_children(self, leaf: _TierNode) -> None:
        for child in list(leaf.children.values()):  # host entries below: unreachable now
            self._drop_host_subtree(child)

    def _reindex(self, node: _TierNode) -> None:
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

    def _is_leaf(self, node: _TierNode) -> bool:
        return not node.host and all(c.host for c in node.children.values())

    # ---- moving between tiers ------------------------------------------------------------

    def _demote(self, leaf: _TierNode) -> bool:
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
        self._transfers.append(Transfer("save", list(leaf.pages), slots))
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

    def _drop_host_subtree(self, node: _TierNode) -> None:
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

    def _to_device(self, node: _TierNode, pages: list[int]) -> None:
        """Gives a host node the device pages ``pages`` (already referenced for it)."""
        self.host.free(node.pages)
        self._host_held -= len(node.pages)
        self._held_pages += len(pages)
        self._host_tokens -= len(node.key)
        node.pages, node.host = pages, False
        self.version += 1
        self._reindex(node)
        self._reindex(node.parent)

    def _adopt(self, node: _TierNode, pages: Sequence[int]) -> None:
        """A host node on an inserted path takes the inserter's device pages (same KV)."""
        s = self.page_size
        own = [int(p) for p in pages[node.start // s:(node.end - 1) // s + 1]]
        self.allocator.share(own)
        self._to_device(node, own)

    def promote(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """Brings the host nodes on the longest cached path of ``tokens`` back to the device,
        top-down, while device pages can be had (evicting other LRU entries); each one's copy
        is queued for `take_transfers`. A node the query matches only partly is split first:
        only the matched part moves. Returns the number of tokens promoted (the caller counts
        the ones it reuses, with `record`)."""
        root = self._roots.get(salt)
        if root is None:
            return 0
        path = self._descend(tokens, root)
        on_host = [n for n in path if n.host]
        if not on_host:
            return 0
        node = path[-1]  # on the host: nothing on the device hangs below a host node
        matched = node.start + common_len(node.key, tokens, node.start)
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
                # (its own lists: an eviction may cut the node's pages before the copy runs)
                self._transfers.append(Transfer("load", list(n.pages), list(pages)))
                self._stats["host_loaded_pages"] += need
                promoted += len(n.key)
                self._to_device(n, pages)
        finally:
            self.unlock(node)
        return promoted

    def clear(self) -> int:
        """Evicts as `RadixCache.clear`, demoting nothing (the device contents are lost); host
        entries below a dropped device entry go with it, and so does the rest of the host tier
        (a copy to it may not have run)."""
        freed = super().clear()
        self.drop_host_tier()
        self._transfers = []
        return freed

    def drop_host_tier(self) -> None:
        """Drops every host entry (when a copy to or from the host pool may not have run)."""
        for node in list(self._nodes()):
            if node.alive and not node.host:
                for child in [c for c in node.children.values() if c.host]:
                    self._drop_host_subtree(child)

    def take_transfers(self) -> list[Transfer]:
        """The copies queued since the last call, in the order they must run."""
        out, self._transfers = self._transfers, []
        return out

    # ---- accounting ----------------------------------------------------------------------

    def host_held_pages(self) -> list[int]:
        """Every host slot the cache holds a reference on, one entry per reference."""
        return [p for n in self._nodes() if n.host for p in n.pages]

    def stats(self) -> dict:
        """`RadixCache.stats`, with the host tier's tokens and slot references."""
        return dict(super().stats(), host_tokens=self._host_tokens,
                    host_held_pages=self._host_held)

    def check(self) -> None:
        """Asserts the tree invariants (`RadixCache.check`) and the host tier's: its leaf
        index, no device node below a host node, its counts, and exact slot refcounts."""
        super().check()
        nodes = [n for n in self._nodes() if n.parent is not None]
        host_leaves = {n.id for n in nodes if n.host and not n.children}
        assert host_leaves == set(self._host_leaves), "the host leaf index disagrees"
        host_held, host_tokens = [], 0
        for n in nodes:
            if n.host:
                assert all(c.host for c in n.children.values()), f"node {n.id}: a device " \
                    "node below a host node"
                host_held, host_tokens = host_held + n.pages, host_tokens + len(n.key)
        assert len(host_held) == self._host_held, f"host refs {self._host_held} != {len(host_held)}"
        assert host_tokens == self._host_tokens, f"host tokens {self._host_tokens} != {host_tokens}"
        self.host.check([[p] for p in host_held])  # only the cache holds host slots: exact
