"""Default tiles for the GPU (Pallas, Triton lowering) paged-attention kernels.

Axes: G query heads per kv head, R rows of a query block, N = ppb * S keys per tile (ppb pages
per block, S page_size), D head_dim.

A Triton program keeps its tiles in registers: a thread of a ``num_warps``-warp program holds
about ``elements / (32 * num_warps)`` values of every live tensor. sm_90 gives a thread at most
255 registers; beyond that ptxas spills to local memory (slow, and counted by ``make test-aot``).
The budgets below were chosen with ptxas on sm_90 (``tests/aot``; ``make test-aot-full``
compiles bf16 and f32 at head_dim 64 and 128, group 1/4/8, page 16/32, plus pages of 8 and 64):
the largest tiles found there to compile with no spills.

- Broadcast path (decode, G <= 4): scores and P @ V are multiply-reduces over an f32
  ``[R, N, D]`` product, so ``R * N * D`` is what must fit.
- MMA path (decode G >= 5, and prefill): ``tl.dot`` tiles; the f32 accumulator ``[R, D]`` plus
  the K and V tiles ``[N, D]`` and the scores ``[R, N]`` must fit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.gpu_paged_common import MMA_MIN, next_pow2

MMA_MIN_GROUP = 8  # padded G at which tl.dot (padded to 16 rows) beats the broadcast path
TARGET_PROGRAMS = 256  # decode: ~2 programs per SM on an H100/H200 (132 SMs)
TARGET_ROWS = 64  # prefill: query rows per program (Q * Gp)
MAX_KEYS = {False: 128, True: 64}  # keys per tile, broadcast / MMA path
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a block may opt into on sm_90

# Estimated f32 values a thread holds, calibrated against ptxas -v on sm_90 (bf16, head_dim 64
# and 128): at these budgets the kernels use <= ~200 of the 255 registers and never spill.
#   broadcast: the [R, N, D] product plus the K and V tiles in f32: (R + 2) * N * D / threads
#   MMA: the f32 accumulator and q ([R, D], ~1.5 R*D) and ~2 live [R, N] score tiles
BROADCAST_BUDGET = 96
MMA_BUDGET = 112


@dataclasses.dataclass(frozen=True)
class Tile:
    rows: int  # R: query rows of a program (padded group, times query tokens for prefill)
    pages_per_block: int  # pages of one K/V tile
    num_warps: int
    num_stages: int
    mma: bool  # tl.dot (True) or broadcast multiply-reduce (False)


def registers_estimate(rows: int, keys: int, head_dim: int, mma: bool, num_warps: int) -> float:
    """f32 values per thread of a tile (the quantity the budgets bound)."""
    threads = 32 * num_warps
    if mma:
        return (1.5 * rows * head_dim + 2 * rows * keys) / threads
    return (rows + 2) * keys * head_dim / threads


def smem_estimate(rows: int, keys: int, head_dim: int, itemsize: int, mma: bool,
                  num_stages: int) -> int:
    """Shared memory of the MMA path: double-buffered K and V tiles plus the q tile."""
    if not mma:
        return 0
    return num_stages * 2 * keys * head_dim * itemsize + rows * head_dim * itemsize


def _fits(rows, keys, head_dim, itemsize, mma, num_warps, num_stages) -> bool:
    budget = MMA_BUDGET if mma else BROADCAST_BUDGET
    return (registers_estimate(rows, keys, head_dim, mma, num_warps) <= budget
            and smem_estimate(rows, keys, head_dim, itemsize, mma, num_stages) <= SMEM_LIMIT)


def _search(rows, head_dim, page_size, width, itemsize, mma, warps_options, num_stages):
    """The tile with the most keys within budget (then the fewest warps), or None."""
    min_pages = -(-MMA_MIN // page_size) if mma else 1
    ppb = min(max(1, MAX_KEYS[mma] // page_size), max(next_pow2(width), min_pages))
    while ppb >= min_pages:
        for warps in warps_options:
            if _fits(rows, ppb * page_size, head_dim, itemsize, mma, warps, num_stages):
                return Tile(rows, ppb, warps, num_stages, mma)
        ppb //= 2
    return None


def _pick(rows: int, head_dim: int, page_size: int, width: int, dtype, mma: bool, *,
          pages_per_block, num_warps, num_stages) -> Tile | None:
    itemsize = np.dtype(dtype).itemsize
    stages = num_stages or 2
    if pages_per_block is None:
        warps = (num_warps,) if num_warps else (4, 8)
        return _search(rows, head_dim, page_size, width, itemsize, mma, warps, stages)
    warps = num_warps or 4
    keys = pages_per_block * page_size
    if mma and keys < MMA_MIN:
        raise ValueError(f"pages_per_block * page_size must be >= {MMA_MIN} (tl.dot), "
                         f"got {pages_per_block} * {page_size}")
    if not _fits(rows, keys, head_dim, itemsize, mma, warps, stages):
        raise ValueError(
            f"pages_per_block={pages_per_block} (x page_size {page_size} = {keys} keys per tile) "
            f"does not fit a {warps}-warp program at {rows} query rows and head_dim "
            f"{head_dim}: sm_90 would spill registers or run out of shared memory; use fewer "
            "pages per block or more num_warps")
    return Tile(rows, pages_per_block, warps, stages, mma)


def decode_tile(group: int, head_dim: int, page_size: int, width: int, dtype, *,
                pages_per_block=None, num_warps=None, num_stages=None) -> Tile:
    """The decode kernel's tile: all G heads of a kv head as one block of rows.

    Small groups use the broadcast path; when no broadcast tile fits (a large page at
    head_dim 128), the MMA path with its rows padded to 16 takes over."""
    knobs = dict(pages_per_block=pages_per_block, num_warps=num_warps, num_stages=num_stages)
    gp = next_pow2(group)
    if gp < MMA_MIN_GROUP:
        tile = _pick(gp, head_dim, page_size, width, dtype, False, **knobs)
        if tile is not None:
            return tile
    tile = _pick(max(gp, MMA_MIN), head_dim, page_size, width, dtype, True, **knobs)
    if tile is None:
        raise ValueError(f"no decode tile fits sm_90 at group {group}, head_dim {head_dim}, "
                         f"page_size {page_size}, {np.dtype(dtype)}")
    return tile


def prefill_block_q(group: int, num_tokens: int) -> int:
    """Query tokens per prefill program: about TARGET_ROWS rows, at least the MMA minimum."""
    gp = next_pow2(group)
    return max(-(-MMA_MIN // gp), min(max(1, TARGET_ROWS // gp), next_pow2(num_tokens)))


def prefill_tile(block_q: int, group: int, head_dim: int, page_size: int, width: int, dtype, *,
                 pages_per_block=None, num_warps=None, num_stages=None) -> Tile:
    """The ragged prefill kernel's tile: block_q tokens x all G heads of a kv head."""
    rows = block_q * next_pow2(group)
    if rows < MMA_MIN:
        raise ValueError(f"block_q * padded group ({block_q} * {next_pow2(group)}) must be "
                         f">= {MMA_MIN} (tl.dot)")
    tile = _pick(rows, head_dim, page_size, width, dtype, True, pages_per_block=pages_per_block,
                 num_warps=num_warps, num_stages=num_stages)
    if tile is None:
        raise ValueError(f"no prefill tile fits sm_90 at {rows} rows, head_dim {head_dim}, "
                         f"page_size {page_size}, {np.dtype(dtype)}: lower block_q")
    return tile
