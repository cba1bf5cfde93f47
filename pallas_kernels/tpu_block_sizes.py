"""Default block sizes for the TPU ragged paged attention kernel.

Axes: T query tokens, G query heads per kv head, S page_size, W pages per page-table row,
Tq tokens per q block, R = Tq * G rows of a q block, N pages per kv block.

Mosaic wants the last two dims of every VMEM block to be multiples of the (sublane, lane) tile
(8 x 128 for 32-bit data, 16 x 128 for 16-bit) unless they equal the whole array dim. The q/out
block is [R, D]: R is chosen as a multiple of the sublane tile, or as the whole (padded) token
axis when everything fits in one block. These are starting points, not tuned numbers: measure on
the target chip and override through the kernel's keyword-only knobs.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

TARGET_ROWS = 128  # R: fills the MXU's 128-row systolic input on every TPU generation
TARGET_KEYS = 512  # N * S: keys per kv block; double-buffered [512, 2D] bf16, D = 128: 512 KiB
LANES = 128
SMEM_BUDGET = 512 * 1024  # of the 1 MiB SMEM of v5e/v6e, leaving room for Mosaic's own use


def q_lanes(head_dim: int) -> int:
    """E, the lanes of a q row: D when K and V are lane-aligned halves of a page row (D a
    multiple of 128), else 2D with q zero-padded (the kernel docstring explains)."""
    return head_dim if head_dim % LANES == 0 else 2 * head_dim


def smem_bytes(max_seqs: int, table_window: int) -> int:
    """SMEM the kernel asks for: meta, kv_lens, cu_q_lens (scalar prefetch) and two page-table
    windows of ``table_window`` entries; each array rounded up to 512 bytes (an estimate on the
    safe side). It grows with the batch, not with the page table's width."""
    words = [2, max_seqs, max_seqs + 1, 2 * table_window]
    return sum(-(-4 * n // 512) * 512 for n in words)


def sublane_tile(dtype) -> int:
    """Rows of one (sublane, 128) VMEM tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit data."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def default_pages_per_block(page_size: int, pages_per_row: int) -> int:
    """N: enough pages for ~TARGET_KEYS keys, never more than a page-table row holds."""
    return max(1, min(pages_per_row, TARGET_KEYS // page_size, 128))


def _min_tokens_per_block(group: int, dtype) -> int:
    """Smallest Tq with R = Tq * G a multiple of the sublane tile."""
    tile = sublane_tile(dtype)
    return tile // math.gcd(group, tile)


def default_num_q_per_block(num_tokens: int, group: int, dtype) -> int:
    """Tq for mixed prefill/decode batches: about TARGET_ROWS rows per q block."""
    if num_tokens * group <= TARGET_ROWS:
        return num_tokens  # a single block spans the whole token axis: always a legal tiling
    step = _min_tokens_per_block(group, dtype)
    return max(step, TARGET_ROWS // group // step * step)


def default_decode_num_q_per_block(batch: int, group: int, dtype) -> int:
    """Tq for decode (one token per sequence): the fewest sequences a legal q block can hold.

    Every sequence in a q block is computed against all R rows, so decode wants R small; decode
    is bandwidth-bound, and the wasted MXU rows cost nothing next to the page reads.
    """
    return min(batch, _min_tokens_per_block(group, dtype))
