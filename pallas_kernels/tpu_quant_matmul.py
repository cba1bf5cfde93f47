"""Weight-only quantized matmul on TPU (Pallas Mosaic): ``x @ dequant(q, scale, offset)``.

Axes: T tokens, I inputs, O outputs, G groups along I (``group`` inputs each; G = 1 per output
channel), Bt / Bi / Bo block sizes, Bq byte rows of a weight block (Bi for 8 bits, Bi / 2 for
4), Gb = Bi / group scale rows of a block, R byte rows per group (group, or group / 2).

Semantics and the weight layout are those of ``quant_reference.quantized_matmul_reference``.
Design:

* Grid (T / Bt, cdiv(O, Bo), I / Bi). I is innermost and "arbitrary": a float32 VMEM
  accumulator [Bt, Bo] is zeroed at its first step and written out at its last (the standard
  Pallas TPU matmul, jax's ``pallas/ops/tpu/matmul.py``); T and O are "parallel".
* The weight stays integer in HBM. A step DMAs a [Bq, Bo] block of bytes with its [Gb, Bo]
  scales (and offsets) and dequantizes it, CHUNK_ROWS byte rows at a time (widened to int32,
  float32 arithmetic: v5e's VPU has no bf16), into a [Bi, Bo] VMEM scratch in x's dtype; one
  [Bt, Bi] @ [Bi, Bo] dot on the MXU follows. A group's scale is a [1, Bo] row of the scale
  block broadcast over its R rows: static slices at multiples of 16 rows, aligned to every
  tile involved, and no reshape (the TPU interpreter cannot run ``ref.reshape``).
* int4: byte row r holds inputs 2r (low nibble) and 2r + 1 (high nibble). The wrapper orders
  x's columns within each I block as [even | odd] (x is small; the weight never moves), so the
  low nibbles fill scratch rows [0, Bq), the high nibbles rows [Bq, Bi), and one dot with
  K = Bi covers both; a byte row's group is ``r // R`` for either nibble.
* int8 per output channel without offset: the block is only converted (exact in bf16) and the
  scale multiplies the accumulator once, at the last I step.
* O need not be a multiple of Bo (an LM head): the last O block reads past the weight's end.
  Those columns hold garbage, and Pallas drops their outputs; a matmul never mixes columns.
  Bi must divide I (garbage along I would reach every output); T is padded with zero rows.

Block defaults and Mosaic's tiling rules: ``tpu_quant_block_sizes``. ``make test-aot`` compiles
the kernel for v5e and v6e at Llama-3-8B shapes (``tests/aot/test_tpu.py -k quant``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_quant_block_sizes as sizes
from pallas_kernels.quant_reference import check_quantized_weight

X_DTYPES = (jnp.float32, jnp.bfloat16)


def _dequantize(q_ref, scale_ref, offset_ref, w_ref, *, bits: int, rows_per_group: int,
                scaled: bool) -> None:
    """Writes the block's float weight [Bi, Bo] into ``w_ref`` (x's dtype)."""
    byte_rows = q_ref.shape[0]
    chunk = math.gcd(sizes.CHUNK_ROWS, byte_rows)
    sub = min(rows_per_group, chunk)  # rows sharing one scale row inside a chunk
    scale = scale_ref[...].astype(jnp.float32) if scaled else None  # [Gb, Bo]
    offset = None if offset_ref is None else offset_ref[...].astype(jnp.float32)
    for c0 in range(0, byte_rows, chunk):
        q = q_ref[c0:c0 + chunk, :].astype(jnp.int32)  # Mosaic has no 8-bit VPU arithmetic
        halves = ((0, q),) if bits == 8 else ((0, q & 15), (byte_rows, q >> 4))
        for base, values in halves:
            values = values.astype(jnp.float32)
            for s0 in range(0, chunk, sub):
                g = (c0 + s0) // rows_per_group
                part = values[s0:s0 + sub]
                if scale is not None:
                    part = part * scale[g:g + 1]
                if offset is not None:
                    part = part + offset[g:g + 1]
                row = base + c0 + s0
                w_ref[row:row + sub, :] = part.astype(w_ref.dtype)


def _kernel(x_ref, q_ref, scale_ref, *refs, bits: int, rows_per_group: int, scale_last: bool,
            precision):
    """One (T block, O block, I block) step: dequantize the weight block, accumulate x @ w."""
    offset_ref, (o_ref, acc_ref, w_ref) = (refs[0], refs[1:]) if len(refs) == 4 else (None, refs)
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    _dequantize(q_ref, scale_ref, offset_ref, w_ref, bits=bits, rows_per_group=rows_per_group,
                scaled=not scale_last)
    acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32,
                            precision=precision)

    @pl.when(k == pl.num_programs(2) - 1)
    def _finalize():
        acc = acc_ref[...]
        if scale_last:  # per output channel: one multiply per output instead of per weight
            acc = acc * scale_ref[...].astype(jnp.float32)
        o_ref[...] = acc.astype(o_ref.dtype)


def quant_matmul_pallas_call(
    x,  # [T_pad, I] float; int4: columns [even | odd] within each I block
    q,  # i8[I, O] or u8[I/2, O]
    scale,  # [G, O] float
    offset,  # [G, O] float or None
    *,
    bits: int,
    blocks: sizes.QuantBlocks,
    out_dtype,
    vmem_limit_bytes: int | None,
    interpret: bool,
):
    """One pallas_call over the (T block, O block, I block) grid -> [T_pad, O]."""
    (t, i), o, groups = x.shape, q.shape[1], scale.shape[0]
    bt, bo, bi = blocks.block_t, blocks.block_o, blocks.block_i
    group = i // groups
    scale_last = groups == 1 and offset is None
    if groups == 1:  # one scale row for every I block
        scale_spec = pl.BlockSpec((1, bo), lambda ti, oi, ki: (0, oi))
    else:
        scale_spec = pl.BlockSpec((bi // group, bo), lambda ti, oi, ki: (ki, oi))
    in_specs = [
        pl.BlockSpec((bt, bi), lambda ti, oi, ki: (ti, ki)),
        pl.BlockSpec((bi * bits // 8, bo), lambda ti, oi, ki: (ki, oi)),
        scale_spec,
    ] + ([scale_spec] if offset is not None else [])
    kernel = functools.partial(
        _kernel, bits=bits, rows_per_group=group * bits // 8, scale_last=scale_last,
        precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
    return pl.pallas_call(
        kernel,
        grid=(t // bt, pl.cdiv(o, bo), i // bi),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bt, bo), lambda ti, oi, ki: (ti, oi)),
        out_shape=jax.ShapeDtypeStruct((t, o), out_dtype),
        scratch_shapes=[pltpu.VMEM((bt, bo), jnp.float32), pltpu.VMEM((bi, bo), x.dtype)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(x, q, scale, *([] if offset is None else [offset]))


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {msg}")


def _validate(x, q, scale, offset, *, bits, block_t, block_o, block_i, out_dtype,
              vmem_limit_bytes, group_size) -> tuple[int, int, int]:
    """Static checks; each error names the offending argument. Returns (I, O, group)."""
    i, o, group = check_quantized_weight(x.shape, q, scale, offset, bits, group_size=group_size)
    _check(x.dtype in X_DTYPES, "x", f"dtype {x.dtype}: the TPU kernel computes in float32 or "
           "bfloat16")
    for arr, name in ((scale, "scale"), (offset, "offset")):
        _check(arr is None or jnp.issubdtype(arr.dtype, jnp.floating), name,
               f"must be a float array, got {None if arr is None else arr.dtype}")
    _check(out_dtype is None or jnp.issubdtype(out_dtype, jnp.floating), "out_dtype",
           f"must be a float dtype, got {out_dtype}")
    # O off the lane tile makes XLA:TPU relay the whole weight out for the kernel (measured with
    # O = 32064): pad such an LM head's columns once, when it is quantized, instead.
    _check(i % sizes.LANES == 0 and o % sizes.LANES == 0, "q",
           f"I={i} and O={o} must be multiples of {sizes.LANES} (the TPU lane tile)")
    _check(scale.shape[0] == 1 or (group % 32 == 0 and group & (group - 1) == 0), "scale",
           f"groups of {group} inputs: the TPU kernel takes per-channel scales or groups of a "
           "power of two >= 32 inputs")
    for value, name in ((block_t, "block_t"), (block_o, "block_o"), (block_i, "block_i"),
                        (vmem_limit_bytes, "vmem_limit_bytes")):
        _check(value is None or (isinstance(value, int) and value > 0), name,
               f"must be None or a positive int, got {value!r}")
    _check(block_o is None or block_o % sizes.LANES == 0, "block_o",
           f"must be a multiple of {sizes.LANES}, got {block_o}")
    if block_i is not None:
        why = sizes.block_i_error(block_i, i, group, scale.shape[0])
        _check(why is None, "block_i", f"{block_i} {why}")
    tile = max(sizes.sublane_tile(x.dtype), sizes.sublane_tile(out_dtype or x.dtype))
    _check(block_t is None or block_t >= x.shape[0] or block_t % tile == 0, "block_t",
           f"{block_t} must be a multiple of {tile} (the sublane tile of x / the output) or "
           f"cover all T={x.shape[0]}")
    return i, o, group


@functools.partial(jax.jit, static_argnames=(
    "bits", "interpret", "block_t", "block_o", "block_i", "out_dtype", "vmem_limit_bytes",
    "group_size"))
def quantized_matmul_tpu(
    x,  # [T, I] float32 or bfloat16
    q,  # i8[I, O] (8 bits) or u8[I/2, O] (4 bits: byte row r = inputs 2r, 2r + 1)
    scale,  # [G, O] any float dtype
    offset=None,  # [G, O] any float dtype, or None (symmetric int8)
    *,
    bits: int,
    interpret: bool = False,  # run the kernel in the Pallas TPU interpreter (any platform)
    block_t: int | None = None,  # Bt: rows of x per step
    block_o: int | None = None,  # Bo: output columns per step (a multiple of 128)
    block_i: int | None = None,  # Bi: inputs per step (divides I)
    out_dtype=None,  # default: x's dtype
    vmem_limit_bytes: int | None = None,
    group_size: int | None = None,  # if given, I // G must equal it
):
    """``x @ dequant(q, scale, offset)`` -> [T, out_dtype or x.dtype] on TPU, the weight read as
    integers and dequantized in VMEM (float32 accumulation); semantics of
    ``quantized_matmul_reference``."""
    i, o, group = _validate(x, q, scale, offset, bits=bits, block_t=block_t, block_o=block_o,
                            block_i=block_i, out_dtype=out_dtype,
                            vmem_limit_bytes=vmem_limit_bytes, group_size=group_size)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    # Mosaic loads no f16 on v5e: such scales become f32 first (a copy of the small scales).
    scale, offset = (a if a is None or a.dtype in X_DTYPES else a.astype(jnp.float32)
                     for a in (scale, offset))
    t = x.shape[0]
    blocks = sizes.quant_blocks(
        t, i, o, bits=bits, group=group, groups=scale.shape[0], x_dtype=x.dtype,
        scale_dtype=scale.dtype, out_dtype=out_dtype, has_offset=offset is not None,
        block_t=None if block_t is None else min(block_t, t), block_o=block_o,
        block_i=block_i)
    bi = blocks.block_i
    if bits == 4:  # [even | odd] columns within each I block, matching the nibbles' rows
        x = x.reshape(t, i // bi, bi // 2, 2).swapaxes(2, 3).reshape(t, i)
    t_pad = pl.cdiv(t, blocks.block_t) * blocks.block_t
    x = jnp.pad(x, ((0, t_pad - t), (0, 0)))
    out = quant_matmul_pallas_call(x, q, scale, offset, bits=bits, blocks=blocks,
                                   out_dtype=out_dtype, vmem_limit_bytes=vmem_limit_bytes,
                                   interpret=interpret)
    return out[:t]
