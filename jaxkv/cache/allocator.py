"""PageAllocator: which physical KV pages are free, and how many holders each used page has.

Plain Python (no jax): the host owns the page bookkeeping; the device only holds contents.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable


class OutOfPagesError(RuntimeError):
    """Not enough free pages for an allocation."""


class PageAllocator:
    """A free list plus a refcount per page. A page is free xor referenced."""

    def __init__(self, num_pages: int, *, track_freed: bool = False):
        # Called with each page whose last holder let go (`jaxkv.cache.window` frees the
        # page's local-layer slot with it).
        self.on_free: Callable[[int], None] | None = None
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"PageAllocator: num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        # Pages that became free since the last drain_freed() (for the NaN-fill debug option).
        self._freed: list[int] | None = [] if track_freed else None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with refcount 1; raises OutOfPagesError if fewer are free."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Adds a holder to each (already used) page; all or nothing."""
        pages = list(pages)
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"share: page {p} is free")
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one holder from each page; pages with no holder left return to the free list.

        All or nothing: a double free raises before any refcount changes.
        """
        drops = Counter(pages)
        for p, n in drops.items():
            if self._refs[p] < n:
                raise ValueError(f"free: page {p} is already free (double free)")
        for p, n in drops.items():
            self._refs[p] -= n
            if self._refs[p] == 0:
                self._free.append(p)
                if self.on_free is not None:
                    self.on_free(p)
                if self._freed is not None:
                    self._freed.append(p)

    def drain_freed(self) -> list[int]:
        """Pages freed since the last call that are still free (needs ``track_freed=True``)."""
        if self._freed is None:
            raise ValueError("drain_freed needs PageAllocator(track_freed=True)")
        pages, self._freed = sorted({p for p in self._freed if self._refs[p] == 0}), []
        return pages

    def copy_on_write(self, page: int) -> tuple[int, bool]:
        """A page the caller may write: `page` itself if the caller is its only holder, else a
        fresh page that replaces the caller's reference to the shared one.

        Returns (page, copied). When copied is True the caller must copy the old page's contents
        into the new one on device before writing. Raises OutOfPagesError (changing nothing) if
        no page is free.
        """
        if self._refs[page] <= 0:
            raise ValueError(f"copy_on_write: page {page} is free")
        if self._refs[page] == 1:
            return page, False
        (fresh,) = self.allocate(1)
        self._refs[page] -= 1  # > 1 before, so the shared page stays used
        return fresh, True

    def check(self, holders: Iterable[Iterable[int]] | None = None) -> None:
        """Asserts the invariants: free pages have refcount 0, used ones > 0, no duplicates.

        With `holders` (one page list per holder: each running sequence, each reference the
        prefix cache holds), also asserts that every page's refcount equals the number of
        lists that contain it, so a leaked or missing reference is caught where it happens.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a page appears twice in the free list"
        for p, r in enumerate(self._refs):
            assert r >= 0, f"page {p} has negative refcount {r}"
            assert (r == 0) == (p in free), f"page {p}: refcount {r}, in free list: {p in free}"
        if holders is None:
            return
        counts: Counter[int] = Counter()
        for i, held in enumerate(holders):
            held = list(held)
            assert len(set(held)) == len(held), f"holder {i} lists a page twice: {held}"
            counts.update(held)
        for p, r in enumerate(self._refs):
            assert r == counts[p], f"page {p}: refcount {r}, but {counts[p]} holders"
        extra = sorted(p for p in counts if not 0 <= p < self.num_pages)
        assert not extra, f"holders list pages out of range: {extra}"
