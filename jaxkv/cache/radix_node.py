"""The radix tree's node, its public view, and the helpers both radix caches use.

Plain Python (no jax); see `jaxkv.cache.radix` for the layout a node's pages follow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence


class Node:
    """One edge of the tree: tokens at positions [start, end) and their pages."""

    __slots__ = ("key", "start", "pages", "children", "parent", "lock", "holds", "last_access",
                 "id", "alive")

    def __init__(self, key: list[int], start: int, pages: list[int], parent: Node | None,
                 node_id: int):
        self.key = key  # edge label: the tokens at positions start .. end - 1
        self.start = start
        self.pages = pages  # page ids for page indices start // S .. (end - 1) // S
        self.children: dict[int, Node] = {}  # keyed by the child's first token
        self.parent = parent
        self.lock = 0  # locks held on this node's handle or below it: not evictable if > 0
        self.holds = 0  # locks held on this very node's handle
        self.last_access = 0
        self.id = node_id  # breaks LRU ties deterministically
        self.alive = True  # False once evicted: a stale handle is an error

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclasses.dataclass(frozen=True)
class RadixEntry:
    """One node of the tree as `RadixCache.entries` reports it (for checks and debugging)."""

    salt: Hashable  # its namespace
    tokens: tuple[int, ...]  # its whole path's tokens: positions 0 .. end - 1
    start: int  # the first position its own edge covers
    pages: tuple[int, ...]  # for page indices start // S .. (end - 1) // S
    on_device: bool  # device pages; else host slots (`HostTieredRadixCache`)


def path_to_root(node: Node | None) -> Iterator[Node]:
    """The node and its ancestors, up to and including the root."""
    while node is not None:
        yield node
        node = node.parent


def common_len(key: list[int], tokens: Sequence[int], pos: int) -> int:
    """Length of the common prefix of `key` and tokens[pos:] (whole runs compared as slices,
    in C, then the first differing run token by token)."""
    limit = min(len(key), len(tokens) - pos)
    m, run = 0, 64
    while m + run <= limit and key[m:m + run] == list(tokens[pos + m:pos + m + run]):
        m += run
    while m < limit and key[m] == tokens[pos + m]:
        m += 1
    return m
