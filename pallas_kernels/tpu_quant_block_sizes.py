"""Default blocks of the TPU (Pallas Mosaic) weight-only quantized matmul.

Axes: T tokens (rows of x), I inputs, O outputs, G groups along I (``group`` inputs each; G = 1
is per output channel). A grid step multiplies a ``[block_t, block_i]`` block of x by the
``[block_i, block_o]`` weight block it dequantizes in VMEM; ``block_q`` byte rows hold it
(``block_i`` for 8 bits, half for 4).

- Decode (T <= DECODE_ROWS): weight-bandwidth-bound, so each step streams about 1 MiB of
  weight bytes (a grid step costs ~0.35 us of fixed overhead; 1 MiB takes ~1.3 us of v5e HBM
  bandwidth) and x's block is all T rows (the whole axis: a legal block at any T).
- Prefill (T > DECODE_ROWS): an MXU tile of up to PREFILL_ROWS rows; a weight block is
  dequantized once per step and reused by every row, so more rows amortise the VPU work.

Mosaic's tiling rules shape the choice: the last two dims of a block must be multiples of
(sublane tile, 128) or the whole axis. ``block_i`` is x's lane dim (a multiple of 128) and the
weight's sublane dim (int8 and uint8 tiles are 32 rows); a scale block holds ``block_i / group``
rows, which Pallas wants to be a multiple of 8 (for bf16 scales too: it compiles) or all G.
These are starting points that fit v5e's 16 MiB of scoped VMEM, not numbers tuned on a chip.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

LANES = 128
DECODE_ROWS = 64  # T <= 64: the GEMV / skinny-GEMM path
PREFILL_ROWS = 512  # rows of x per step on the prefill path (MXU work per dequantized block)
WEIGHT_BLOCK_ELEMENTS = 1 << 20  # decode: block_i * block_o (1 MiB of int8)
PREFILL_BLOCK_ELEMENTS = 1 << 19
VMEM_BUDGET = 12 * 2**20  # under v5e's 16 MiB default scoped VMEM, with room for Mosaic's own
CHUNK_ROWS = 128  # byte rows dequantized at once: bounds the kernel's f32 temporaries
SCALE_ROWS = 8  # a scale block's rows: a multiple of this, or all G


@dataclasses.dataclass(frozen=True)
class QuantBlocks:
    block_t: int  # rows of x per step (all T on the decode path)
    block_o: int  # output columns per step, a multiple of 128
    block_i: int  # inputs per step (a divisor of I)


def sublane_tile(dtype) -> int:
    """Rows of one (sublane, 128) VMEM tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit data."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def block_i_error(block_i: int, inputs: int, group: int, groups: int) -> str | None:
    """Why ``block_i`` cannot tile I (a message naming the rule), or None when it can."""
    if inputs % block_i:
        return f"must divide I={inputs} (a partial block along I would add garbage)"
    if block_i != inputs and block_i % LANES:
        return f"must be a multiple of {LANES} (x's lane tile) or all of I={inputs}"
    if groups > 1 and block_i % group:
        return f"must be a multiple of the group size {group}"
    if groups > 1 and block_i != inputs and (block_i // group) % SCALE_ROWS:
        return (f"must hold a multiple of {SCALE_ROWS} groups of {group} (the rows of a scale "
                f"block) or all of I={inputs}")
    return None


def vmem_bytes(blocks: QuantBlocks, *, bits: int, groups: int, group: int, x_dtype,
               scale_dtype, out_dtype, has_offset: bool) -> int:
    """An estimate of the VMEM one step holds: double-buffered blocks of x, q, scales and the
    output, the f32 accumulator, the dequantized weight block and the f32 chunk temporaries."""
    bt, bo, bi = blocks.block_t, blocks.block_o, blocks.block_i
    xb, ob, sb = (jnp.dtype(d).itemsize for d in (x_dtype, out_dtype, scale_dtype))
    gb = 1 if groups == 1 else bi // group
    scale_rows = -(-gb // sublane_tile(scale_dtype)) * sublane_tile(scale_dtype)
    pad_t = -(-bt // sublane_tile(x_dtype)) * sublane_tile(x_dtype)
    buffered = (pad_t * bi * xb + bi * bits // 8 * bo
                + (1 + has_offset) * scale_rows * bo * sb + pad_t * bo * ob)
    # Fitted to Mosaic's reports (v5e): a scaled block costs about twice its scratch.
    weight = (1 if groups == 1 and not has_offset else 2) * bi * bo * xb
    return 2 * buffered + 2 * pad_t * bo * 4 + weight + 2 * CHUNK_ROWS * bo * 4


def _legal_block_i(want: int, inputs: int, group: int, groups: int) -> int:
    """The largest legal block_i <= want (all of I when no smaller one is legal)."""
    step = LANES if groups == 1 else math.lcm(LANES, group * SCALE_ROWS)
    for bi in range(want // step * step, 0, -step):
        if block_i_error(bi, inputs, group, groups) is None:
            return bi
    return inputs


def _prefill_rows(tokens: int) -> int:
    """Bt for T > PREFILL_ROWS: the least zero-row padding, larger blocks on a tie."""
    return min((PREFILL_ROWS, PREFILL_ROWS // 2, PREFILL_ROWS // 4),
               key=lambda bt: -(-tokens // bt) * bt)


def quant_blocks(tokens: int, inputs: int, outputs: int, *, bits: int, group: int, groups: int,
                 x_dtype, scale_dtype, out_dtype, has_offset: bool, block_t=None, block_o=None,
                 block_i=None) -> QuantBlocks:
    """The blocks for ``x[T, I] @ w[I, O]``: each knob as given, else the default for T."""
    decode = tokens <= DECODE_ROWS
    bt = block_t or (tokens if tokens <= PREFILL_ROWS else _prefill_rows(tokens))
    bo = block_o or min(512, -(-outputs // LANES) * LANES)
    elements = WEIGHT_BLOCK_ELEMENTS if decode else PREFILL_BLOCK_ELEMENTS
    want = elements // bo * 2 // jnp.dtype(x_dtype).itemsize  # the dequantized block's bytes
    want *= 8 // bits if decode else 1  # decode: int4 streams as many weight bytes as int8
    bi = block_i or _legal_block_i(max(want, LANES), inputs, group, groups)
    blocks = QuantBlocks(bt, bo, bi)
    # An I with no small legal block (all of I) gets narrower output blocks instead.
    size = dict(bits=bits, groups=groups, group=group, x_dtype=x_dtype, scale_dtype=scale_dtype,
                out_dtype=out_dtype, has_offset=has_offset)
    while (block_o is None and blocks.block_o > LANES
           and vmem_bytes(blocks, **size) > VMEM_BUDGET):
        blocks = dataclasses.replace(blocks, block_o=blocks.block_o // 2 // LANES * LANES
                                     or LANES)
    return blocks
