"""GGUF block formats kept as they are (``load_pretrained(..., quantization="gguf")``).

llama.cpp stores a weight [out, in] row by row in blocks of 32 inputs. Three block formats
are exactly jaxkv's group-32 layouts (`jaxkv.model.quant`), so they are repacked, never
dequantized:

- Q8_0 (34 bytes: f16 ``d``, 32 x int8 ``q``): ``w = d * q``            -> int8, group 32;
- Q4_0 (18 bytes: f16 ``d``, 16 bytes of nibbles): ``w = d * (q - 8)``  -> int4, group 32,
  offset ``-8 d``;
- Q4_1 (20 bytes: f16 ``d``, f16 ``m``, 16 bytes): ``w = d * q + m``    -> int4, group 32,
  offset ``m``.

In a block's 16 nibble bytes, byte j holds input j in its low nibble and input j + 16 in its
high one. Every other format (the K-quants, Q5_x, float) is dequantized one tensor at a time
and quantized into the nearest kept layout: int4 group 32 from 4 bits or fewer, else int8
group 32 — never a float copy of the whole model.
"""

from __future__ import annotations

import numpy as np

from jaxkv.model.quant import QuantizedWeight, QuantScheme, pack_int4, quantize

KEPT = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # block bytes
LOW_BITS = ("Q4_K", "Q3_K", "Q2_K")  # repacked to int4 group 32; the rest to int8 group 32


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """f16[...] from the trailing 2-byte axis of a u8[..., 2] array (little-endian f16): kept
    in 16 bits, as jaxkv stores scales (exactly the file's)."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0]


def kept_weight(blocks: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantizedWeight:
    """The jaxkv [in, out] weight of a Q8_0/Q4_0/Q4_1 tensor: ``blocks`` u8[out, in / 32, B]
    (rows already in HF order), ``shape`` its HF (out, in)."""
    out, inputs = shape
    d = _f16(blocks[..., 0:2])  # [out, in/32]
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, inputs)
        return QuantizedWeight(np.ascontiguousarray(q.T), np.ascontiguousarray(d.T), None, 8)
    first = 4 if kind == "Q4_1" else 2
    nibbles = blocks[..., first:]  # [out, in/32, 16]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(out, inputs)
    offset = _f16(blocks[..., 2:4]) if kind == "Q4_1" else d * np.float16(-8)  # exact
    return QuantizedWeight(pack_int4(q.T), np.ascontiguousarray(d.T),
                           np.ascontiguousarray(offset.T), 4)


def nearest_weight(w_hf: np.ndarray, kind: str) -> QuantizedWeight:
    """A dequantized [out, in] tensor of another format in the nearest kept layout."""
    return quantize(w_hf.T, _nearest(kind))


def nearest_weight_by_rows(chunks, shape: tuple[int, int], kind: str) -> QuantizedWeight:
    """The same from ``chunks``, (first row, f32 rows [n, in]) of the dequantized [out, in]
    tensor in order: each block of rows (output channels) quantized as it comes into the
    preallocated result, so the whole tensor never exists in float32 (an 8B model's Q6_K
    output matrix would take 2.1 GB)."""
    out_rows, _ = shape
    q = scale = offset = None
    done = 0
    for r0, rows in chunks:
        if r0 != done:
            raise ValueError(f"rows {done}.. expected next, got {r0}")
        done += rows.shape[0]
        w = quantize(rows.T, _nearest(kind))
        if q is None:
            q = np.empty((w.q.shape[0], out_rows), w.q.dtype)
            scale = np.empty((w.scale.shape[0], out_rows), w.scale.dtype)
            offset = None if w.offset is None else np.empty_like(scale)
        cols = slice(r0, r0 + rows.shape[0])
        q[:, cols], scale[:, cols] = w.q, w.scale
        if offset is not None:
            offset[:, cols] = w.offset
    if done != out_rows:
        raise ValueError(f"{done} rows converted, the tensor has {out_rows}")
    return QuantizedWeight(q, scale, offset, _nearest(kind).bits)


def _nearest(kind: str) -> QuantScheme:
    return QuantScheme(4 if kind in LOW_BITS else 8, 32)


def blocks_of(data: np.ndarray, kind: str, shape: tuple[int, int]) -> np.ndarray:
    """The u8[out, in / 32, B] block view of a tensor's raw data."""
    out, inputs = shape
    if inputs % 32:
        raise ValueError(f"a {kind} tensor's rows must hold whole blocks of 32, got {inputs}")
    return np.asarray(data).reshape(out, inputs // 32, KEPT[kind])
