"""Weight-only quantized matmul: ``x @ dequantize(w)`` with the weight read as integers.

Axes: T tokens (rows of x), I input features, O output features, G groups along I
(``I // group_size``; G = 1 is one scale per output channel).

A quantized weight is three arrays (the layout jaxkv's ``QuantizedWeight`` holds):

* ``q``: ``i8[I, O]`` (8 bits), or ``u8[I/2, O]`` (4 bits): byte row r holds input row 2r in
  its low nibble and row 2r + 1 in its high nibble, values 0..15;
* ``scale``: ``[G, O]`` floats;
* ``offset``: ``[G, O]`` floats or None (symmetric int8);

and ``w[i, o] = q[i, o] * scale[i // group_size, o] + offset[i // group_size, o]``.

Why nibbles pair neighbouring rows: a kernel splits x into its even and odd columns once,
outside the kernel (x is small), and then multiplies ``x_even @ dequant(q & 15)`` plus
``x_odd @ dequant(q >> 4)``: both halves are the same ``[I/2, O]`` tile of bytes, and byte row
r's group is ``r // (group_size / 2)`` for either nibble.

This module holds the layout's checks and ``quantized_matmul_reference``, the pure-jnp
definition every kernel is tested against; ``quant_matmul`` dispatches to the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

WEIGHT_BITS = (4, 8)


def check_quantized_weight(x_shape, q, scale, offset, bits: int, *,
                           group_size: int | None = None) -> tuple[int, int, int]:
    """(I, O, group_size) of a quantized weight, or a ValueError naming the argument.

    The group size is implied by the shapes (``I // G``), so scales meant for other rows (a
    shard of a weight whose groups do not divide over the devices) would pass unnoticed: a
    caller that knows the weight's ``group_size`` passes it, and a scale implying another is
    refused."""
    if bits not in WEIGHT_BITS:
        raise ValueError(f"bits must be one of {WEIGHT_BITS}, got {bits}")
    want = jnp.int8 if bits == 8 else jnp.uint8
    if q.ndim != 2 or q.dtype != want:
        raise ValueError(f"q must be {jnp.dtype(want).name}[I{'' if bits == 8 else '/2'}, O], "
                         f"got {q.dtype}{list(q.shape)}")
    rows, cols = q.shape
    i = rows * (8 // bits)
    if len(x_shape) != 2 or x_shape[1] != i:
        raise ValueError(f"x must be [T, {i}] for a weight of {i} inputs, got {list(x_shape)}")
    if scale.ndim != 2 or scale.shape[1] != cols or i % scale.shape[0]:
        raise ValueError(f"scale must be [G, {cols}] with G dividing {i}, got "
                         f"{list(scale.shape)}")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"offset must match scale {list(scale.shape)}, got "
                         f"{list(offset.shape)}")
    if bits == 4 and offset is None:
        raise ValueError("4-bit weights need an offset (values are 0..15)")
    group = i // scale.shape[0]
    if group_size is not None and group != group_size:
        raise ValueError(f"scale {list(scale.shape)} implies groups of {group} inputs for "
                         f"{i} inputs, but group_size={group_size} was given")
    if bits == 4 and group % 2:
        raise ValueError(f"4-bit groups must hold an even number of rows, got {group}")
    return i, cols, group


def unpack_int4(q):
    """u8[I/2, O] -> i32[I, O] values 0..15 (rows in order)."""
    return jnp.stack([q & 15, q >> 4], axis=1).reshape(-1, q.shape[-1]).astype(jnp.int32)


def dequantize_reference(q, scale, offset, *, bits: int, dtype=jnp.float32):
    """The float ``[I, O]`` weight (float32 arithmetic, cast to ``dtype``)."""
    values = unpack_int4(q) if bits == 4 else q.astype(jnp.int32)
    groups = scale.shape[0]
    rows, cols = values.shape
    w = values.reshape(groups, rows // groups, cols).astype(jnp.float32)
    w = w * scale.astype(jnp.float32)[:, None, :]
    if offset is not None:
        w = w + offset.astype(jnp.float32)[:, None, :]
    return w.reshape(rows, cols).astype(dtype)


@functools.partial(jax.jit, static_argnames=("bits", "out_dtype", "group_size"))
def quantized_matmul_reference(
    x,  # [T, I] float
    q,  # i8[I, O] or u8[I/2, O]
    scale,  # [G, O]
    offset=None,  # [G, O] or None
    *,
    bits: int,
    out_dtype=None,
    group_size: int | None = None,  # if given, I // G must equal it
):
    """``x @ w`` in float32 with the dequantized weight; the result in ``out_dtype`` (x's)."""
    check_quantized_weight(x.shape, q, scale, offset, bits, group_size=group_size)
    w = dequantize_reference(q, scale, offset, bits=bits)
    out = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype or x.dtype)
