"""Weight-only quantized matmul on GPU (Pallas, Triton lowering): ``x @ dequantize(q)`` with the
weight read from HBM as integers and dequantized in registers, tile by tile.

Axes: T tokens, I inputs, O outputs, G groups along I (G = 1: per output channel), NS splits of
the I axis; ``quant_matmul.py`` has the weight layout and the reference.

Design:
- Grid (T tiles, O tiles, NS), T fastest, so the programs that share a weight tile run side by
  side and read it from HBM about once. A program loops over its share of I in ``block_i``
  steps, accumulating ``[block_t, block_o]`` in f32 with ``tl.dot`` on x's dtype (bf16/f16
  tensor cores; f32 as TF32 by default, ``precision`` as in the attention kernels).
- Per channel (G = 1): the tile is only converted (int8 and 0..15 are exact in bf16) and the
  scale multiplies the accumulator once at the end; an offset adds ``sum(x) * offset`` there.
- Grouped: each step walks sub-blocks of at most one group (and at most SUB_ROWS byte rows),
  loads the group's ``[1, block_o]`` scale (and offset) row and dequantizes the sub-block in f32
  (``q * s + o``, cast to x's dtype) before its dot: the scale broadcast is a row broadcast,
  never a gather, and ``block_i`` and the group size must nest (one divides the other).
- int4: byte row r holds inputs 2r (low nibble) and 2r + 1 (high nibble). x is split into even
  and odd columns outside (x is small next to the weight); a byte tile gives ``q & 15`` and
  ``q >> 4``, two ``[rows, block_o]`` halves multiplied by the even and odd x tiles.
- Small T: x is padded to 16 rows (the ``tl.dot`` minimum, as jax's Pallas GPU ops and Triton
  W4A16 kernels do); decode is weight-bound, so the idle MMA rows cost nothing measurable.
  Split-K (``num_splits``) gives a narrow weight enough programs; the f32 partials are summed
  outside. O not a multiple of ``block_o`` and T not a multiple of ``block_t`` are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_paged_common import check_knob, is_pow2, resolve_f32_precision
from pallas_kernels.gpu_quant_block_sizes import MMA_MIN, QuantTile, quant_tile
from pallas_kernels.quant_reference import check_quantized_weight

X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
SUB_ROWS = 32  # byte rows dequantized at once in a grouped weight (see _quant_matmul_call)
# f32 dots (16-bit x always uses its native MMA): the modes of gpu_paged_common.
_DOT_PRECISION = {"tf32": lax.Precision.DEFAULT, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                  "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
                  "ieee": lax.Precision.HIGHEST}


def _masked_load(ref, mask):
    """``ref[...]`` with False positions read as 0 (never touching memory past the array)."""
    if mask is None:
        return ref[...]
    return plgpu.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


def _kernel(*refs, bits: int, group_rows: int | None, sub_rows: int, step_rows: int,
            steps: int, n_rows: int, n_cols: int, has_offset: bool, precision):
    # refs: x (int8) or x_even, x_odd (int4); q, scale, [offset], [xsum: G = 1 with offset];
    # then the output (a [bt, bo] tile, or the f32 partial of this split).
    nx = 1 if bits == 8 else 2
    x_refs, (q_ref, s_ref), rest = refs[:nx], refs[nx:nx + 2], list(refs[nx + 2:-1])
    off_ref = rest.pop(0) if has_offset else None
    xsum_ref = rest.pop(0) if rest else None
    o_ref = refs[-1]
    i, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bt, bo = x_refs[0].shape[0], q_ref.shape[1]
    f32, cdt = jnp.float32, x_refs[0].dtype
    row_ok = (i * bt + lax.iota(jnp.int32, bt) < n_rows)[:, None] if n_rows % bt else None
    col_ok = (j * bo + lax.iota(jnp.int32, bo) < n_cols)[None, :] if n_cols % bo else None

    def row(ref, g):  # one [1, bo] scale / offset row as f32
        return _masked_load(ref.at[pl.ds(g, 1), :], col_ok).astype(f32)

    def step(k, acc):
        r0 = (split * steps + k) * step_rows
        for u in range(step_rows // sub_rows):  # static: one sub-block per group in the step
            r = r0 + u * sub_rows
            qb = _masked_load(q_ref.at[pl.ds(r, sub_rows), :], col_ok)
            halves = (qb,) if bits == 8 else (qb & 15, qb >> 4)  # u8: a logical shift
            if group_rows is not None:
                s = row(s_ref, r // group_rows)
                o = row(off_ref, r // group_rows) if has_offset else None
            for x_ref, h in zip(x_refs, halves, strict=True):
                if group_rows is None:  # exact: |q| <= 127 fits every float dtype
                    w = h.astype(cdt)
                else:
                    w = h.astype(f32) * s
                    w = (w if o is None else w + o).astype(cdt)
                xt = _masked_load(x_ref.at[:, pl.ds(r, sub_rows)], row_ok)
                acc += lax.dot_general(xt, w, (((1,), (0,)), ((), ())), precision=precision,
                                       preferred_element_type=f32)
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros((bt, bo), f32))
    if group_rows is None:  # per channel: x @ (q s + o) = (x @ q) s + sum(x) o
        acc = acc * row(s_ref, 0)
        if has_offset:  # once, in split 0: the partials are summed
            term = xsum_ref[...] * row(off_ref, 0)
            acc += jnp.where(split == 0, term, jnp.zeros_like(term))
    oks = [m for m in (row_ok, col_ok) if m is not None]
    mask = None if not oks else jnp.broadcast_to(functools.reduce(jnp.logical_and, oks),
                                                 (bt, bo))
    plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=mask)


def _quant_matmul_call(xs, q, scale, offset, xsum, *, bits: int, group: int, tile: QuantTile,
                       n_rows: int, out_dtype, precision, interpret: bool):
    """The pallas_call: ``[Tp, O]`` in out_dtype, or f32 ``[NS, Tp, O]`` partials (NS > 1).

    ``xs``: (x,) or (x_even, x_odd), ``[Tp, I]`` / ``[Tp, I/2]``; ``xsum`` f32 ``[Tp, 1]``
    (per channel with an offset) or None."""
    tp, o_dim = xs[0].shape[0], q.shape[1]
    per_byte = 8 // bits
    bt, bo, ns = tile.block_t, tile.block_o, tile.num_splits
    step_rows = tile.block_i // per_byte
    grouped = scale.shape[0] > 1
    # Grouped: a sub-block per group, at most SUB_ROWS byte rows: int4 sub-blocks of 128 byte
    # rows took 204-214 registers in a 4-warp decode program (ptxas, sm_90), 32 rows 96-128.
    sub_rows = min(group // per_byte, step_rows, SUB_ROWS) if grouped else step_rows
    steps = q.shape[0] // step_rows // ns
    kernel = functools.partial(
        _kernel, bits=bits, group_rows=group // per_byte if grouped else None,
        sub_rows=sub_rows, step_rows=step_rows, steps=steps, n_rows=n_rows, n_cols=o_dim,
        has_offset=offset is not None, precision=precision)

    def weight_spec(rows):  # every row of an O tile: the kernel walks its rows
        return pl.BlockSpec((rows, bo), lambda i, j, s: (0, j))

    in_specs = [pl.BlockSpec((bt, x.shape[1]), lambda i, j, s: (i, 0)) for x in xs]
    in_specs += [weight_spec(q.shape[0]), weight_spec(scale.shape[0])]
    extra = []
    if offset is not None:
        in_specs.append(weight_spec(offset.shape[0]))
        extra.append(offset)
    if xsum is not None:
        in_specs.append(pl.BlockSpec((bt, 1), lambda i, j, s: (i, 0)))
        extra.append(xsum)
    if ns > 1:
        out_shape = jax.ShapeDtypeStruct((ns, tp, o_dim), jnp.float32)
        out_spec = pl.BlockSpec((None, bt, bo), lambda i, j, s: (s, i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((tp, o_dim), out_dtype)
        out_spec = pl.BlockSpec((bt, bo), lambda i, j, s: (i, j))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(tp, bt), pl.cdiv(o_dim, bo), ns),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tile.num_warps,
                                             num_stages=tile.num_stages),
        interpret=interpret,
        name="quantized_matmul_gpu",
    )(*xs, q, scale, *extra)


def _check_tile(tile: QuantTile, inputs: int, group: int, bits: int, grouped: bool) -> None:
    lo = MMA_MIN * (8 // bits)  # 16 byte rows per dot
    if tile.block_t < MMA_MIN or tile.block_o < MMA_MIN:
        raise ValueError(f"block_t and block_o must be >= {MMA_MIN} (tl.dot), got "
                         f"{tile.block_t}, {tile.block_o}")
    bi = tile.block_i
    if bi < lo or inputs % bi:
        raise ValueError(f"block_i must be >= {lo} and divide I={inputs}, got {bi}")
    if grouped and (min(group, bi) < lo or (group % bi and bi % group)):
        raise ValueError(f"block_i={bi} and group size {group} must nest (one divides the "
                         f"other) with groups of >= {lo} inputs")
    if (inputs // bi) % tile.num_splits:
        raise ValueError(f"num_splits={tile.num_splits} must divide the {inputs // bi} block_i "
                         f"steps of I={inputs}")


@functools.partial(
    jax.jit,
    static_argnames=("bits", "interpret", "block_t", "block_o", "block_i", "num_warps",
                     "num_stages", "num_splits", "precision", "out_dtype", "group_size"))
def quantized_matmul_gpu(
    x,  # [T, I] f32 / bf16 / f16
    q,  # i8[I, O] (bits=8) or u8[I/2, O] (bits=4: row r = inputs 2r low nibble, 2r+1 high)
    scale,  # [G, O] any float dtype
    offset=None,  # [G, O] any float dtype, or None (symmetric int8)
    *,
    bits: int,
    interpret: bool = False,
    block_t: int | None = None,
    block_o: int | None = None,
    block_i: int | None = None,  # inputs per loop step (a power of two)
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,  # split-K: programs sharing one output tile's I axis
    precision: str | None = None,  # f32 x: tf32 | tf32x3 | bf16x3 | ieee (gpu_paged_common)
    out_dtype=None,
    group_size: int | None = None,  # if given, I // G must equal it
):
    """``x @ dequantize(q, scale, offset)`` -> ``[T, O]`` in out_dtype (x's), the weight read as
    integers and dequantized in registers; semantics of ``quantized_matmul_reference``."""
    inputs, _, group = check_quantized_weight(x.shape, q, scale, offset, bits,
                                              group_size=group_size)
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x dtype must be float32/bfloat16/float16, got {x.dtype}")
    for name, a in (("scale", scale), ("offset", offset)):
        if a is not None and not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {a.dtype}")
    for name, value in (("num_stages", num_stages), ("num_splits", num_splits)):
        check_knob(name, value)
    for name, value in (("block_t", block_t), ("block_o", block_o), ("block_i", block_i),
                        ("num_warps", num_warps)):
        check_knob(name, value, pow2=True)
    prec = resolve_f32_precision(precision, interpret=interpret)
    t = x.shape[0]
    grouped = scale.shape[0] > 1
    if grouped and not is_pow2(group):
        raise ValueError(f"grouped weights need a power-of-two group size, got {group}")
    tile = quant_tile(t, inputs, q.shape[1], bits=bits, group=group, block_t=block_t,
                      block_o=block_o, block_i=block_i, num_warps=num_warps,
                      num_stages=num_stages, num_splits=num_splits)
    _check_tile(tile, inputs, group, bits, grouped)

    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if t < tile.block_t:  # a block never exceeds the array: pad the few rows of decode
        x = jnp.pad(x, ((0, tile.block_t - t), (0, 0)))
    xs = (x,) if bits == 8 else (x[:, 0::2], x[:, 1::2])
    xsum = None
    if not grouped and offset is not None:
        xsum = jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)
    out = _quant_matmul_call(
        xs, q, scale, offset, xsum, bits=bits, group=group, tile=tile, n_rows=x.shape[0],
        out_dtype=out_dtype, precision=_DOT_PRECISION[prec] if x.dtype == jnp.float32 else None,
        interpret=interpret)
    if tile.num_splits > 1:
        out = jnp.sum(out, axis=0)
    return out[:t].astype(out_dtype)
