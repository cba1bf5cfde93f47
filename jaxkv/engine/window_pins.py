"""The scheduler's side of window-only KV (`jaxkv.cache.window`): which local-layer slots each
running sequence pins, and the slots of a plan's page copies.

Plain Python (no jax). A running sequence pins the slots of its pages from the first one its
next query sees to its last (``Request.window_pins``, a page index range); the range slides
forward as it computes and is dropped when it stops running. Without window-only KV (no
`WindowSlots`) every method does nothing.
"""

from __future__ import annotations

import itertools

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.window import WindowSlots
from jaxkv.engine.plan import SchedulerOutput
from jaxkv.engine.request import Request


class WindowPins:
    """Pins of the running sequences, and of the sources of the plan being built."""

    def __init__(self, window: WindowSlots | None, allocator: PageAllocator):
        self.window, self.allocator = window, allocator
        if window is not None:
            allocator.on_free = window.dropped
        self._copy_sources: list[int] = []  # held while a plan is built

    def hold(self, req: Request) -> None:
        """Pins the slots of ``req``'s pages from the first its next query sees to its last,
        and unpins those before."""
        w = self.window
        if w is None:
            return
        lo, hi = req.window_pins
        new_lo = w.first_page(req.num_computed_tokens)
        new_lo, new_hi = (max(lo, new_lo) if hi > lo else new_lo), len(req.pages)
        for i in _outside(lo, hi, new_lo, new_hi):
            w.unpin(req.pages[i])
        for i in _outside(new_lo, new_hi, lo, hi):
            w.pin(req.pages[i])
        req.window_pins = (new_lo, new_hi)

    def drop(self, req: Request) -> None:
        """Unpins everything ``req`` pins (before its pages are freed)."""
        if self.window is not None:
            lo, hi = req.window_pins
            for i in range(lo, hi):
                self.window.unpin(req.pages[i])
        req.window_pins = (0, 0)

    def trim(self, req: Request, keep: int) -> None:
        """Unpins ``req``'s pages from index ``keep`` on (before they are freed: rejected
        speculative tokens' pages)."""
        lo, hi = req.window_pins
        if self.window is not None:
            for i in range(max(lo, keep), hi):
                self.window.unpin(req.pages[i])
        req.window_pins = (min(lo, keep), min(hi, keep))

    def fork(self, parent: Request, sibling: Request) -> None:
        """``sibling`` starts on ``parent``'s pages: it pins what the parent pins."""
        if self.window is not None:
            lo, hi = sibling.window_pins = parent.window_pins
            for page in parent.pages[lo:hi]:
                self.window.pin(page)

    def moved(self, req: Request, index: int, page: int) -> None:
        """``req``'s page ``index`` becomes ``page`` (its private copy): its pin moves too."""
        lo, hi = req.window_pins
        if self.window is not None and lo <= index < hi:
            self.window.unpin(req.pages[index])
            self.window.pin(page)

    def copy(self, src: int, dst: int, out: SchedulerOutput) -> None:
        """Plans a device copy of page ``src`` into ``dst``. ``src`` and its slot are held
        until the plan is built (a reference and a pin), so neither is freed or handed to
        another page before `plan_copies` reads where it is."""
        out.copies.append((src, dst))
        if self.window is not None and self.window.pin_if_held(src):
            self.allocator.share([src])
            self._copy_sources.append(src)

    def plan_copies(self, out: SchedulerOutput) -> None:
        """The plan's copies in the local layers' pool (slot pairs), where the source has one."""
        w = self.window
        if w is not None:
            out.window_copies = [(w.slot_of[s], w.slot_of[d]) for s, d in out.copies
                                 if s in w.slot_of and d in w.slot_of]

    def release_sources(self) -> None:
        """Lets go of what `copy` held (a page the plan freed meanwhile goes now: its contents
        stay for the copies, which run before anything reuses it)."""
        for page in self._copy_sources:
            self.window.unpin(page)
            self.allocator.free([page])
        self._copy_sources = []

    def usable_prefix(self, pages, cached: int) -> int:
        """How much of a cache hit a request may reuse (`WindowSlots.usable_prefix`)."""
        return cached if self.window is None else self.window.usable_prefix(pages, cached)

    def holders(self, running) -> list[list[int]]:
        """The pages each running sequence pins, for ``WindowSlots.check(holders=...)``."""
        return [r.pages[slice(*r.window_pins)] for r in running]


def _outside(lo: int, hi: int, other_lo: int, other_hi: int):
    """Indices of [lo, hi) outside [other_lo, other_hi)."""
    if other_hi <= other_lo:
        return range(lo, hi)
    return itertools.chain(range(lo, min(hi, other_lo)), range(max(lo, other_hi), hi))
