"""Host-side builders of the device batch of one ragged step, from persistent buffers.

Axes: T tokens (a bucket of a short power-of-two ladder), B rows = state slots (fixed: row b is
slot b, a slot with nothing to run has no tokens), W page-table width (fixed: the longest
sequence's pages). Neither the longest row nor the batch's real width is a shape: the kernels
and the jnp reference stop at each row's length, so a step program is one per T.

The page table lives in a persistent per-slot numpy buffer: a row rewrites only the pages
that changed since its last step (from the page it writes into on), and a slot taken by a new
sequence rewrites its pages once. Padding tokens write to page P (dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import struct

from jaxkv.config import cdiv

MIN_TOKENS = 16  # the smallest token bucket


def pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, n - 1).bit_length()


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest of {2^k, 3*2^(k-1)} that is >= max(n, minimum) (for page-copy batches)."""
    n = max(n, minimum, 1)
    p = 1
    while p < n:
        if p >= 2 and p * 3 // 2 >= n:
            return p * 3 // 2
        p *= 2
    return p


def ladder(largest: int, smallest: int = MIN_TOKENS) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to the first >= ``largest``: the token buckets."""
    out = [pow2(smallest)]
    while out[-1] < largest:
        out.append(out[-1] * 2)
    return tuple(out)


def fit(n: int, sizes: Sequence[int]) -> int:
    """The smallest size in the ladder ``sizes`` that holds n."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


@dataclasses.dataclass(frozen=True)
class Row:
    """One sequence's part of a step: its slot, new tokens, and the pages it owns.

    ``owner`` identifies the sequence holding the slot's pages since it last got them (compared
    with ``==``; None: unknown, rewrite the slot's whole page-table row)."""

    slot: int
    tokens: Sequence[int]  # new tokens this step (a prompt chunk, or one decode token)
    start: int  # tokens of this sequence already cached (position of tokens[0])
    pages: Sequence[int]  # physical pages of the sequence, in order; enough for start+len
    owner: object = None


@struct.dataclass
class StepBatch:
    """The device inputs of one ragged step (see the module docstring for the axes)."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    write_pages: jax.Array  # i32[T]  page each token's K/V goes to (P for padding)
    write_offsets: jax.Array  # i32[T]  slot inside that page
    page_table: jax.Array  # i32[B, W]
    kv_lens: jax.Array  # i32[B]  cached tokens after this step, including the new ones (0: idle)
    cu_q_lens: jax.Array  # i32[B + 1]
    num_seqs: jax.Array  # i32[]  B: every slot is a row (idle ones have no tokens)
    # Window-only KV (`jaxkv.cache.window`): the local layers' slots, like the two above.
    window_write_pages: jax.Array | None = None  # i32[T]  (the null slot + 1 for padding)
    window_page_table: jax.Array | None = None  # i32[B, W]


class PageTable:
    """The per-slot page table, kept on the host between steps and rewritten by deltas."""

    def __init__(self, max_seqs: int, width: int, num_pages: int, page_size: int):
        self.table = np.zeros((max_seqs, width), np.int32)
        self.num_pages, self.page_size = num_pages, page_size
        self._owner: list[object] = [None] * max_seqs
        self._written = np.zeros(max_seqs, np.int64)  # pages written for the owner

    def update(self, slot: int, pages: Sequence[int], start: int, owner) -> None:
        """Makes row ``slot`` hold ``pages``; pages before the one position ``start`` falls in
        are unchanged for the same ``owner`` (a sequence only appends, or copies-on-write the
        page it writes into), so only the rest is rewritten."""
        width = self.table.shape[1]
        if len(pages) > width:
            raise ValueError(f"slot {slot} has {len(pages)} pages; the page table holds "
                             f"{width} per sequence")
        same = owner is not None and self._owner[slot] == owner
        lo = min(start // self.page_size, int(self._written[slot])) if same else 0
        new = np.asarray(pages[lo:], np.int64)
        if new.size and (new.min() < 0 or new.max() >= self.num_pages):
            raise ValueError(f"slot {slot} has a page id outside [0, {self.num_pages})")
        self.table[slot, lo:len(pages)] = new
        self._owner[slot], self._written[slot] = owner, len(pages)

    def forget(self, slot: int) -> None:
        self._owner[slot], self._written[slot] = None, 0


class WindowTable:
    """The per-slot table of the local layers' slots (window-only KV, `jaxkv.cache.window`):
    entry i of a row is the slot of the row's page i from the first page its query sees on,
    and the null slot before (the kernels mask those positions; the null slot is zeros).

    Kept between steps like `PageTable`: a pinned page keeps its slot, so only the entries
    from the page the row writes into on are rewritten, and those its window has left are
    pointed at the null slot."""

    def __init__(self, max_seqs: int, width: int, slots):
        self.slots = slots  # the host's `WindowSlots`: slot_of, null, first_page
        self.table = np.full((max_seqs, width), slots.null, np.int32)
        self._owner: list[object] = [None] * max_seqs
        self._first = np.zeros(max_seqs, np.int64)
        self._written = np.zeros(max_seqs, np.int64)

    def update(self, slot: int, pages: Sequence[int], start: int, owner) -> None:
        """Makes row ``slot`` hold the slots of ``pages`` for a query at ``start``."""
        w, s = self.slots, self.slots.page_size
        first = w.first_page(start)
        if owner is not None and self._owner[slot] == owner:
            self.table[slot, self._first[slot]:first] = w.null
            lo = max(first, min(start // s, int(self._written[slot])))
        else:
            self.table[slot] = w.null
            lo = first
        try:
            self.table[slot, lo:len(pages)] = [w.slot_of[p] for p in pages[lo:]]
        except KeyError as e:
            raise ValueError(f"slot {slot}: page {e.args[0]} has no window slot") from None
        self._owner[slot], self._first[slot], self._written[slot] = owner, first, len(pages)


def build_batch(rows: Sequence[Row], table: PageTable, *, tokens_bucket: int,
                vocab_size: int | None = None, window: WindowTable | None = None
                ) -> StepBatch:
    """Packs rows (at most one per slot) into a StepBatch of ``tokens_bucket`` tokens,
    validating every index it will write (``window``: and the local layers' slots)."""
    if not rows:
        raise ValueError("build_batch: rows is empty")
    b, s = table.table.shape[0], table.page_size
    q_lens = np.zeros(b, np.int32)
    kv_lens = np.zeros(b, np.int32)
    by_slot: dict[int, Row] = {}
    for i, r in enumerate(rows):
        if not isinstance(r.slot, (int, np.integer)) or not 0 <= r.slot < b or r.slot in by_slot:
            raise ValueError(f"build_batch: slot {r.slot} is out of range [0, {b}) or used "
                             "twice")
        if len(r.tokens) == 0:
            raise ValueError(f"build_batch: row {i} (slot {r.slot}) has no tokens")
        if r.start < 0:
            raise ValueError(f"build_batch: start must be >= 0, got {r.start}")
        end = r.start + len(r.tokens)
        need = cdiv(end, s)
        if len(r.pages) < need:
            raise ValueError(f"build_batch: slot {r.slot} needs {need} pages for {end} tokens, "
                             f"got {len(r.pages)}")
        table.update(r.slot, r.pages, r.start, r.owner)
        if window is not None:
            window.update(r.slot, r.pages, r.start, r.owner)
        by_slot[r.slot] = r
        q_lens[r.slot], kv_lens[r.slot] = len(r.tokens), end
    cu = np.zeros(b + 1, np.int32)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    if total > tokens_bucket:
        raise ValueError(f"build_batch: {total} tokens exceed the bucket of {tokens_bucket}")
    tokens = np.zeros(tokens_bucket, np.int32)
    positions = np.zeros(tokens_bucket, np.int32)
    write_pages = np.full(tokens_bucket, table.num_pages, np.int32)
    window_write = None if window is None else \
        np.full(tokens_bucket, window.slots.null + 1, np.int32)
    for slot, r in by_slot.items():
        at, q = int(cu[slot]), len(r.tokens)
        tokens[at:at + q] = r.tokens
        positions[at:at + q] = np.arange(r.start, r.start + q)
        write_pages[at:at + q] = table.table[slot, positions[at:at + q] // s]
        if window is not None:
            window_write[at:at + q] = window.table[slot, positions[at:at + q] // s]
    if vocab_size is not None:
        real = tokens[:total]
        bad = real[(real < 0) | (real >= vocab_size)]
        if bad.size:
            raise ValueError(f"build_batch: token id {int(bad[0])} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return StepBatch(tokens=tokens, positions=positions, write_pages=write_pages,
                     write_offsets=positions % s, page_table=table.table.copy(),
                     kv_lens=kv_lens, cu_q_lens=cu, num_seqs=np.int32(b),
                     window_write_pages=window_write,
                     window_page_table=None if window is None else window.table.copy())


def padding_batch(t: int, table: PageTable, window: WindowTable | None = None) -> StepBatch:
    """A batch of T tokens whose every token and row is padding: running it changes no page.
    For compiling a step program ahead of serving."""
    b = table.table.shape[0]
    windowed = window is not None
    return StepBatch(
        tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
        write_pages=np.full(t, table.num_pages, np.int32), write_offsets=np.zeros(t, np.int32),
        page_table=np.zeros_like(table.table), kv_lens=np.zeros(b, np.int32),
        cu_q_lens=np.zeros(b + 1, np.int32), num_seqs=np.int32(b),
        window_write_pages=np.full(t, window.slots.null + 1, np.int32) if windowed else None,
        window_page_table=np.full_like(window.table, window.slots.null) if windowed else None)
