"""WindowSlots: where local (sliding-window) layers keep a page's KV, and for how long.

Plain Python (no jax). A model whose local layers see only the last ``window`` tokens (Gemma 2
and 3, Mistral) needs their KV only while some query can still see it. With window-only KV
those layers get a pool of their own, of far fewer slots than the pool has pages: page p's
local-layer KV lives in slot ``slot_of[p]`` while it has one. The full-attention layers keep
using page p itself, so the page ids, the allocator, the prefix cache and every page table stay
as they are; a second table maps a row's pages to slots for the local layers.

A slot is **pinned** while a running sequence may read or write its page: from the first page
the sequence's next query can see (`first_page`) to its last page. Pins are counted per holder
(forks share pages). An unpinned slot keeps its contents, **idle**, for as long as its page
lives (the prefix cache holds it): a later request that hits the cache there reuses it. Idle
slots are taken back oldest first when a pin needs one; a page that leaves the pool (`dropped`)
frees its slot at once. `usable_prefix` caps a cache hit to a prefix whose window still has
every slot.

The pool is sized so that pins never run out: `slots_needed` is what ``max_num_seqs``
sequences pin at most, so the only thing that competes for slots is the cache's idle ones.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from jaxkv.config import cdiv


class OutOfSlotsError(RuntimeError):
    """Every window slot is pinned (the pool is smaller than `slots_needed`)."""


def first_page(start: int, window: int, page_size: int) -> int:
    """Index of the first page a query at position ``start`` sees: keys from
    ``start - window + 1`` on (the kernels' window)."""
    return max(0, start - window + 1) // page_size


def slots_needed(window: int, page_size: int, *, max_num_seqs: int,
                 max_num_batched_tokens: int, decode_steps: int) -> int:
    """Slots that ``max_num_seqs`` running sequences can pin at once, at most.

    Each pins the pages its window spans (``cdiv(window - 1, S) + 1``), one more when its next
    token starts a page, the pages two chained decode loops reserve ahead (``2 * decode_steps``
    tokens) and, while a plan is built, the source of one page copy; one step's prefill chunks
    add ``max_num_batched_tokens / S`` pages over all of them."""
    per_seq = cdiv(window - 1, page_size) + 3 + cdiv(2 * decode_steps, page_size)
    return max_num_seqs * per_seq + cdiv(max_num_batched_tokens, page_size)


class WindowSlots:
    """Which slot of the local layers' pool holds each page, and who still needs it."""

    def __init__(self, num_slots: int, window: int, page_size: int):
        for name, v in (("num_slots", num_slots), ("window", window), ("page_size", page_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"WindowSlots: {name} must be an int >= 1, got {v!r}")
        self.num_slots, self.window, self.page_size = num_slots, window, page_size
        self.slot_of: dict[int, int] = {}  # page -> slot
        self._page = [-1] * num_slots  # slot -> page (-1: free)
        self._pins = [0] * num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._idle: OrderedDict[int, None] = OrderedDict()  # mapped, unpinned; oldest first
        self.evictions = 0  # idle slots taken back for a pin

    @property
    def null(self) -> int:
        """The slot a table entry no query reads points at: past the last real slot, never
        written, zero (the device pool has ``num_slots + 1`` slots)."""
        return self.num_slots

    @property
    def num_pinned(self) -> int:
        return self.num_slots - len(self._free) - len(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def first_page(self, start: int) -> int:
        return first_page(start, self.window, self.page_size)

    def pin(self, page: int) -> int:
        """Adds a holder to ``page``'s slot, giving it one (free first, else the oldest idle
        one) if it has none; returns the slot."""
        slot = self.slot_of.get(page)
        if slot is None:
            slot = self._take()
            self.slot_of[page], self._page[slot] = slot, page
        elif self._pins[slot] == 0:
            del self._idle[slot]
        self._pins[slot] += 1
        return slot

    def pin_if_held(self, page: int) -> bool:
        """`pin` if ``page`` has a slot already; False (nothing pinned) if it has none."""
        if page not in self.slot_of:
            return False
        self.pin(page)
        return True

    def unpin(self, page: int) -> None:
        """Drops a holder of ``page``'s slot; the last one leaves it idle, contents kept."""
        slot = self.slot_of.get(page)
        if slot is None or self._pins[slot] == 0:
            raise ValueError(f"WindowSlots.unpin: page {page} has no pinned slot")
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._idle[slot] = None

    def dropped(self, page: int) -> None:
        """``page`` left the pool (no holder): its slot, if any, is free again."""
        slot = self.slot_of.get(page)
        if slot is None:
            return
        if self._pins[slot]:
            raise ValueError(f"WindowSlots.dropped: page {page} was freed while its slot "
                             f"{slot} had {self._pins[slot]} holders")
        del self.slot_of[page], self._idle[slot]
        self._page[slot] = -1
        self._free.append(slot)

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        if self._idle:
            slot, _ = self._idle.popitem(last=False)
            del self.slot_of[self._page[slot]]
            self.evictions += 1
            return slot
        raise OutOfSlotsError(f"all {self.num_slots} window slots are pinned")

    def usable_prefix(self, pages: Sequence[int], cached: int) -> int:
        """The longest prefix of at most ``cached`` tokens (``cached`` itself or whole pages)
        of a cache hit on ``pages`` whose window still has every slot: what a request may reuse
        of it, since its local layers read that window."""
        n, s = cached, self.page_size
        while n > 0:
            lo, hi = self.first_page(n), cdiv(n, s)
            missing = [i for i in range(lo, hi) if pages[i] not in self.slot_of]
            if not missing:
                return n
            n = min(missing[-1] * s, (n - 1) // s * s)  # end before the last missing page
        return 0

    def check(self, holders: Iterable[Iterable[int]] | None = None) -> None:
        """Asserts the books: each slot free, idle or pinned; the maps agree; with
        ``holders`` (one list of pinned pages per holder), every pin count matches."""
        free, idle = set(self._free), set(self._idle)
        assert len(free) == len(self._free), "a slot appears twice in the free list"
        assert not free & idle, f"slots both free and idle: {sorted(free & idle)}"
        for slot in range(self.num_slots):
            page, pins = self._page[slot], self._pins[slot]
            if slot in free:
                assert page == -1 and pins == 0, f"free slot {slot}: page {page}, pins {pins}"
            else:
                assert self.slot_of.get(page) == slot, f"slot {slot} maps page {page} one way"
                assert (pins == 0) == (slot in idle), f"slot {slot}: {pins} pins, idle: " \
                                                      f"{slot in idle}"
        assert len(self.slot_of) == self.num_slots - len(free), "pages map to free slots"
        if holders is None:
            return
        counts: dict[int, int] = {}
        for held in holders:
            for page in held:
                counts[page] = counts.get(page, 0) + 1
        for page, n in counts.items():
            slot = self.slot_of.get(page)
            assert slot is not None, f"a holder pins page {page}, which has no slot"
            assert self._pins[slot] == n, f"page {page}: {self._pins[slot]} pins, {n} holders"
        pinned = sum(1 for p in self._pins if p)
        assert pinned == len(counts), f"{pinned} slots pinned, {len(counts)} pages held"
