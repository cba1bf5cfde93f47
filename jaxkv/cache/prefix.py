"""The prefix cache's seam: what the scheduler and engine ask of a prefix cache, and a null one.

Plain Python (no jax). Three implementations, chosen by the engine's settings:

- `NullPrefixCache` (``enable_prefix_caching=False``): never matches, holds nothing, so a
  sequence's pages return to the free list as soon as it releases them;
- `jaxkv.cache.radix.RadixCache`: the token-exact radix tree over device pages;
- `jaxkv.cache.host_radix.HostTieredRadixCache` (``host_kv_cache_bytes > 0``): the radix tree
  with a host-memory tier behind it, which queues page copies (`Transfer`) for the engine.

Callers use only the `PrefixCache` methods, so prefix caching off needs no branch of its own.
A namespace (``salt``) is any hashable key, opaque to the cache (the engine's is (cache_salt,
weight version), `jaxkv.engine.request.cache_namespace`); None when the caller needs none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import ClassVar, NamedTuple, Protocol

# Counters every implementation reports in `PrefixCache.stats` (0 where it lacks the feature),
# so metrics read one set of keys whatever the cache.
COUNTERS = ("query_tokens", "hit_tokens", "inserted_tokens", "evicted_tokens", "evicted_pages",
            "host_hit_tokens", "host_saved_pages", "host_loaded_pages", "host_evicted_tokens")
SIZES = ("cached_tokens", "held_pages", "host_tokens", "host_held_pages", "nodes")


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a query."""

    num_tokens: int  # tokens matched, token-exact (may end inside a page)
    pages: tuple[int, ...]  # page ids for page indices 0 .. ceil(num_tokens / S) - 1; the last
    #                         is only partly valid when num_tokens % S != 0
    handle: object = dataclasses.field(compare=False, repr=False)  # opaque: lock()/unlock()


class Transfer(NamedTuple):
    """One page copy between the device pool and the host tier, for the engine to run before
    the step that reads or reuses those pages (`jaxkv.engine.host_tier.HostKVPool.run`)."""

    kind: str  # "save" (device pages -> host slots) or "load" (host slots -> device pages)
    src: list[int]  # device pages for a save, host slots for a load
    dst: list[int]  # host slots for a save, device pages for a load


class PrefixCache(Protocol):
    """What the scheduler and engine use of a prefix cache.

    The cache holds its own allocator references on the pages it keeps, so a page returns to
    the free list only once the cache and every running sequence have dropped theirs.
    """

    enabled: ClassVar[bool]  # False only for the null cache: work whose only point is a hit
    #                          (ordering the waiting queue by cached prefix) can be skipped
    version: int  # changes whenever entries are added or dropped: matches may differ since

    def match_prefix(self, tokens: Sequence[int], salt: Hashable = None, *,
                     peek: bool = False) -> PrefixMatch:
        """The longest prefix of ``tokens`` whose KV device pages hold, in namespace ``salt``:
        what admission reuses instead of computing. Changes no refcount; unless ``peek``,
        refreshes the match's recency and counts the query in `stats`."""
        ...

    def record(self, match: PrefixMatch, num_query_tokens: int, used: int | None = None,
               from_host: int = 0) -> None:
        """Counts a query answered by a peeked ``match``, of which ``used`` tokens were reused
        (``from_host`` of them brought back from a host tier), and refreshes its recency: for
        a caller that peeks first, so a query retried every step is counted once."""
        ...

    def cached_length(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """Leading tokens of ``tokens`` the cache holds in any tier, changing nothing: what a
        router or the admission order counts as a hit."""
        ...

    def promote(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """Brings the entries of ``tokens``'s cached path that are off the device back to
        device pages (queuing their copies), so a following `match_prefix` finds them. Returns
        the number of tokens brought back."""
        ...

    def lock(self, handle: object) -> None:
        """Protects a match's path from eviction while a sequence reads its pages (nestable)."""
        ...

    def unlock(self, handle: object) -> None:
        """Undoes one `lock` of the same handle."""
        ...

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               salt: Hashable = None) -> int:
        """Offers the KV of ``tokens`` (positions 0 .. len - 1), held in ``pages``, to the
        cache, which shares the pages it keeps (the caller still frees its own). Returns the
        number of tokens newly cached."""
        ...

    def evict(self, num_pages: int) -> int:
        """Gives up least-recently-used unlocked entries until ``num_pages`` pages have
        returned to the free list, or nothing more can: how the scheduler finds pages before
        it preempts. Returns the number of pages freed."""
        ...

    def clear(self) -> int:
        """Drops every entry no running sequence holds pages of, and anything off the device:
        for when the device pool's contents were lost. Returns the number of pages freed."""
        ...

    def drop_host_tier(self) -> None:
        """Drops every entry held off the device (when a copy to or from it may not have run)."""
        ...

    def take_transfers(self) -> list[Transfer]:
        """The page copies queued since the last call, in the order they must run."""
        ...

    def held_pages(self) -> list[int]:
        """Every device page the cache holds a reference on, one entry per reference: its part
        of the allocator's holders (`PageAllocator.check`) and of the engine's page usage."""
        ...

    def stats(self) -> dict:
        """Counters for metrics: `COUNTERS` since creation, ``hit_rate``, and the current
        `SIZES`."""
        ...

    def check(self) -> None:
        """Asserts the cache's invariants (refcounts it holds, its indexes, its lock counts)."""
        ...


class NullPrefixCache:
    """Prefix caching off: nothing is ever cached, matched or held."""

    enabled: ClassVar[bool] = False
    version = 0  # nothing is ever added or dropped

    def match_prefix(self, tokens: Sequence[int], salt: Hashable = None, *,
                     peek: bool = False) -> PrefixMatch:
        """No prefix is cached: an empty match (nothing to lock)."""
        return PrefixMatch(0, (), None)

    def record(self, match: PrefixMatch, num_query_tokens: int, used: int | None = None,
               from_host: int = 0) -> None:
        """Counts nothing: without a cache no query is made."""

    def cached_length(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """0: nothing is cached."""
        return 0

    def promote(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """0: there is no tier to bring entries back from."""
        return 0

    def lock(self, handle: object) -> None:
        """Refuses: an empty match is never locked."""
        raise ValueError("NullPrefixCache: nothing to lock (prefix caching is off)")

    def unlock(self, handle: object) -> None:
        """Refuses, as `lock`."""
        raise ValueError("NullPrefixCache: nothing to unlock (prefix caching is off)")

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               salt: Hashable = None) -> int:
        """Keeps nothing (takes no reference): the caller's free returns the pages at once."""
        return 0

    def evict(self, num_pages: int) -> int:
        """0: no page is held."""
        return 0

    def clear(self) -> int:
        """0: no page is held."""
        return 0

    def drop_host_tier(self) -> None:
        """Nothing is held off the device."""

    def take_transfers(self) -> list[Transfer]:
        """No copy is ever queued."""
        return []

    def held_pages(self) -> list[int]:
        """No page is held."""
        return []

    def stats(self) -> dict:
        """Every counter and size at 0."""
        return dict(dict.fromkeys(COUNTERS, 0), hit_rate=0.0, **dict.fromkeys(SIZES, 0))

    def check(self) -> None:
        """Nothing to check: the null cache has no state."""
