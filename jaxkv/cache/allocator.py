"""PageAllocator: which physical KV pages are free, and how many holders each used page has.

Plain Python (no jax): the host owns the page bookkeeping; the device only holds contents.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """Not enough free pages for an allocation."""


class PageAllocator:
    """A free list plus a refcount per page. A page is free xor referenced."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"PageAllocator: num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

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
        """Adds a holder to each (already used) page."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"share: page {p} is free")
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one holder from each page; pages with no holder left return to the free list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"free: page {p} is already free (double free)")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def check(self) -> None:
        """Asserts the invariants: free pages have refcount 0, used ones > 0, no duplicates."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page appears twice in the free list"
        for p, r in enumerate(self._refs):
            assert r >= 0, f"page {p} has negative refcount {r}"
            assert (r == 0) == (p in free), f"page {p}: refcount {r}, in free list: {p in free}"
