"""Default tiles of the GPU (Pallas, Triton lowering) weight-only quantized matmul.

Axes: T tokens (rows of x), I inputs, O outputs; a program computes a ``[block_t, block_o]``
tile of the output over ``block_i`` inputs at a time, and ``num_splits`` programs share the I
axis of one output tile (split-K) when there are too few output tiles to fill the GPU.

- Decode (T <= 16): weight-bandwidth-bound. x is padded to the 16 rows ``tl.dot`` needs (the
  tensor cores have FLOPs to spare at one token); a tile streams ``block_i x block_o`` weight
  bytes per step, and split-K brings the program count up to about two per SM, so a narrow
  matrix (Llama-3-8B's down projection: 32 output tiles of 128) still keeps every SM loading.
- Prefill (T > 16): an ordinary GEMM tile (64 or 128 rows, 128 columns, 64 inputs per step)
  whose weight tile is dequantized in registers once per step and reused by all its rows.

The defaults were checked with ptxas on sm_90 (``tests/aot/test_gpu.py -k quant``): no spills,
shared memory within 227 KiB, at Llama-3-8B and LM-head shapes.
"""

from __future__ import annotations

import dataclasses

MMA_MIN = 16  # Triton's tl.dot minimum for M, N and K
TARGET_PROGRAMS = 264  # ~2 programs per SM on an H100/H200 (132 SMs)
DECODE_ROWS = 16  # T <= DECODE_ROWS: the decode (GEMV) path


@dataclasses.dataclass(frozen=True)
class QuantTile:
    block_t: int  # rows of x per program (>= 16)
    block_o: int  # output columns per program
    block_i: int  # inputs per loop step (byte rows: block_i / 2 for int4)
    num_warps: int
    num_stages: int
    num_splits: int  # programs splitting the I axis of one output tile


def prev_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, max(at_most, 1)) + 1) if n % d == 0)


def _fit_block_i(want: int, inputs: int, group: int, bits: int) -> int:
    """The largest power of two <= ``want`` that divides I and nests with the group (one divides
    the other), with at least 16 byte rows per dot."""
    lo = MMA_MIN * (8 // bits)
    bi = want
    while bi >= lo:
        if inputs % bi == 0 and (group % bi == 0 or bi % group == 0):
            return bi
        bi //= 2
    raise ValueError(f"no block_i fits I={inputs} with group size {group}: I must be a "
                     f"multiple of {lo} and the group a power of two >= {lo} (or per channel)")


def quant_tile(tokens: int, inputs: int, outputs: int, *, bits: int, group: int,
               block_t=None, block_o=None, block_i=None, num_warps=None, num_stages=None,
               num_splits=None) -> QuantTile:
    """The tile for ``x[T, I] @ w[I, O]``: each knob as given, else the default for T."""
    decode = tokens <= DECODE_ROWS
    if decode:
        # int4: 64 byte rows a step (a 256-input step unrolls 16 dots of 16 rows at g32 and
        # compiles ~7x slower), one more stage in flight instead.
        bt, bo, bi, warps, stages = DECODE_ROWS, 128, 128, 4, 3 if bits == 8 else 4
    else:
        bt = min(128 if tokens >= 1024 else 64, prev_pow2(tokens))
        bo, bi, warps, stages = 128, 64 if bits == 8 else 128, 8 if bt == 128 else 4, 3
    bt = block_t or bt
    bo = block_o or min(bo, max(MMA_MIN, prev_pow2(outputs)))
    bi = block_i or _fit_block_i(bi, inputs, group, bits)
    if num_splits is None:  # split-K only below one program per SM: partials cost a pass
        programs = -(-max(tokens, 1) // bt) * -(-outputs // bo)
        want = -(-TARGET_PROGRAMS // programs) if 2 * programs < TARGET_PROGRAMS else 1
        num_splits = _largest_divisor(max(inputs // bi, 1), want)
    return QuantTile(bt, bo, bi, num_warps or warps, num_stages or stages, num_splits)
