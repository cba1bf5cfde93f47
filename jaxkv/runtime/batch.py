"""Host-side builders of the device batch for one prefill or decode step.

Axes: T tokens (bucketed), B rows (bucketed), W page-table width (bucketed), Q the longest
row's tokens (static: it sizes the reference attention's padded work; a power of two).
Every dimension is rounded up to a bucket (powers of two and 1.5x powers of two), so a long
run compiles a small, bounded set of programs, which `step_shapes` enumerates; padding rows and
tokens are inert: their pages index P (dropped on write) and their slot index max_seqs
(dropped on update).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import struct


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest of {2^k, 3*2^(k-1)} that is >= max(n, minimum)."""
    n = max(n, minimum, 1)
    p = 1
    while p < n:
        if p >= 2 and p * 3 // 2 >= n:
            return p * 3 // 2
        p *= 2
    return p


def pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, n - 1).bit_length()


def step_shapes(max_tokens: int, max_rows: int, *, min_tokens: int = 1, min_rows: int = 1
                ) -> set[tuple[int, int, int]]:
    """Every (T, B, Q) that `build_batch` (bucketed) can produce for batches of at most
    ``max_rows`` rows and ``max_tokens`` tokens: the step programs a server can need."""
    shapes = set()
    for n in range(1, max_rows + 1):
        b = bucket(n, min_rows)
        shapes.add((bucket(n, min_tokens), b, 1))  # every row one token
        for total in range(n + 1, max_tokens + 1):
            t = bucket(total, min_tokens)
            q, longest = pow2(-(-total // n)), total - n + 1  # the longest row's range
            while True:
                shapes.add((t, b, min(q, t)))
                if q >= longest:
                    break
                q *= 2
    return shapes


@dataclasses.dataclass(frozen=True)
class Row:
    """One sequence's part of a step: its slot, new tokens, and the pages it owns."""

    slot: int
    tokens: Sequence[int]  # new tokens this step (a prompt chunk, or one decode token)
    start: int  # tokens of this sequence already cached (position of tokens[0])
    pages: Sequence[int]  # physical pages of the sequence, in order; enough for start+len


@struct.dataclass
class StepBatch:
    """The device inputs of one step (see the module docstring for the axes)."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    write_pages: jax.Array  # i32[T]  page each token's K/V goes to (P for padding)
    write_offsets: jax.Array  # i32[T]  slot inside that page
    slots: jax.Array  # i32[B]  state slot of each row (max_seqs for padding)
    page_table: jax.Array  # i32[B, W]
    kv_lens: jax.Array  # i32[B]  cached tokens after this step, including the new ones
    cu_q_lens: jax.Array  # i32[B + 1]
    num_seqs: jax.Array  # i32[]
    max_q_len: int = struct.field(pytree_node=False, default=1)


def build_batch(rows: Sequence[Row], *, page_size: int, num_pages: int, max_seqs: int,
                max_pages_per_seq: int, vocab_size: int | None = None,
                min_tokens: int = 1, min_rows: int = 1, bucketed: bool = True) -> StepBatch:
    """Packs rows into a StepBatch, validating every index it will write.

    ``bucketed=False`` pads only to a multiple of 16 tokens (rows and pages exact): for
    baselines whose timing should hold almost no padding, at one program per 16 tokens.
    """
    def fine(n, minimum=1):
        return max(n, minimum)

    def fine_tokens(n, minimum=1):
        return -(-max(n, minimum) // 16) * 16

    size = bucket if bucketed else fine
    size_t = bucket if bucketed else fine_tokens
    if not rows:
        raise ValueError("build_batch: rows is empty")
    n = len(rows)
    total = sum(len(r.tokens) for r in rows)
    longest = max(len(r.tokens) for r in rows)
    width = max(-(-(r.start + len(r.tokens)) // page_size) for r in rows)
    t_pad = size_t(total, min_tokens)
    b_pad = size(n, min_rows)
    w_pad = min(size(width), max_pages_per_seq)

    tokens = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    write_pages = np.full(t_pad, num_pages, np.int32)
    write_offsets = np.zeros(t_pad, np.int32)
    slots = np.full(b_pad, max_seqs, np.int32)
    page_table = np.zeros((b_pad, w_pad), np.int32)
    kv_lens = np.zeros(b_pad, np.int32)
    cu = np.full(b_pad + 1, total, np.int32)
    cu[0] = 0
    seen_slots = set()
    at = 0
    for i, r in enumerate(rows):
        q = len(r.tokens)
        end = r.start + q
        if q == 0:
            raise ValueError(f"build_batch: row {i} (slot {r.slot}) has no tokens")
        if not 0 <= r.slot < max_seqs or r.slot in seen_slots:
            raise ValueError(f"build_batch: slot {r.slot} is out of range [0, {max_seqs}) "
                             "or used twice")
        seen_slots.add(r.slot)
        if r.start < 0:
            raise ValueError(f"build_batch: start must be >= 0, got {r.start}")
        need = -(-end // page_size)
        if len(r.pages) < need or len(r.pages) > max_pages_per_seq:
            raise ValueError(f"build_batch: slot {r.slot} needs {need} pages for {end} tokens "
                             f"(at most {max_pages_per_seq}), got {len(r.pages)}")
        pages = np.asarray(r.pages[:need], np.int64)
        if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
            raise ValueError(f"build_batch: slot {r.slot} has a page id outside [0, {num_pages})")
        toks = np.asarray(r.tokens, np.int64)
        if vocab_size is not None and (toks.min() < 0 or toks.max() >= vocab_size):
            bad = int(toks[(toks < 0) | (toks >= vocab_size)][0])
            raise ValueError(f"build_batch: token id {bad} is outside the vocabulary "
                             f"[0, {vocab_size})")
        pos = np.arange(r.start, end)
        tokens[at:at + q] = toks
        positions[at:at + q] = pos
        write_pages[at:at + q] = pages[pos // page_size]
        write_offsets[at:at + q] = pos % page_size
        slots[i] = r.slot
        page_table[i, :need] = pages
        kv_lens[i] = end
        at += q
        cu[i + 1] = at
    return StepBatch(
        tokens=tokens, positions=positions, write_pages=write_pages,
        write_offsets=write_offsets, slots=slots, page_table=page_table, kv_lens=kv_lens,
        cu_q_lens=cu, num_seqs=np.int32(n),
        max_q_len=min(pow2(longest) if bucketed else fine_tokens(longest), t_pad),
    )


def padding_batch(t: int, b: int, q: int, *, num_pages: int, max_seqs: int,
                  max_pages_per_seq: int) -> StepBatch:
    """A batch of shape (T, B, Q) whose every token and row is padding: running it changes
    no page and no slot. For compiling a step program ahead of serving."""
    return StepBatch(
        tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
        write_pages=np.full(t, num_pages, np.int32), write_offsets=np.zeros(t, np.int32),
        slots=np.full(b, max_seqs, np.int32),
        page_table=np.zeros((b, max_pages_per_seq), np.int32), kv_lens=np.zeros(b, np.int32),
        cu_q_lens=np.zeros(b + 1, np.int32), num_seqs=np.int32(0), max_q_len=q)
