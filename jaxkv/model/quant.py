"""Weight-only quantization: integer weights and their scales kept on the device, and the
matmul that reads them.

A quantized linear weight is a `QuantizedWeight` pytree (packed integers + scales + offsets)
held where the float weight would be, so it jits, donates, shards and `update_params` like any
params. Axes: I input, O output, G groups along I (``I // group_size``; 1 = per output channel),
V vocabulary, E hidden. A weight is ``w[i, o] = q[i, o] * scale[g(i), o] + offset[g(i), o]``:
symmetric int8 has no offset; int4 is asymmetric (min/max), the form GGUF's Q4_1 and AWQ/GPTQ
zero points take exactly (``offset = -zero * scale``).

How it multiplies (`qdot`):

- **int8 per output channel, integer dot** (the CPU path): the activations are quantized per
  token to int8 (absmax), the product accumulates in int32 (an s8 x s8 -> s32 dot, which
  XLA:CPU runs through its int8 GEMM), and one multiply by ``x_scale[t] * scale[o]`` gives the
  output. No float copy of the weight exists at any point. XLA:CPU does not fuse an int8 ->
  float conversion into a float dot (it materializes the converted weight every step, slower
  than reading fp32), so this is the only fast int8 path it has.
- **otherwise** (int4, grouped int8, GPU/TPU): the weight is dequantized inside the jitted step
  next to its dot, which XLA fuses on GPU and TPU; Pallas weight-only kernels take over there.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How weights are quantized: ``bits`` 8 or 4, ``group_size`` None (per output channel) or
    one of 32/64/128; ``embedding``: the embedding (and an untied LM head) int8 per row too."""

    bits: int
    group_size: int | None
    embedding: bool = True
    gguf: bool = False  # a GGUF file's block formats, kept per tensor (`gguf_blocks`)

    @classmethod
    def parse(cls, spec: str | QuantScheme | None) -> QuantScheme | None:
        """``"int8"`` (per channel), ``"int8-g32"``, ``"int4"`` (= int4-g128, AWQ/GPTQ's
        default), ``"int4-g32"``/``"-g64"``/``"-g128"``, ``"gguf"`` (a GGUF file's blocks as
        stored: Q8_0 -> int8 g32, Q4_0/Q4_1 -> int4 g32, others the nearest), or None."""
        if spec is None or isinstance(spec, QuantScheme):
            return spec
        if spec == "gguf":  # the embedding as stored too: float, exactly its dequantized value
            return cls(4, 32, embedding=False, gguf=True)
        m = re.fullmatch(r"int(8|4)(?:-g(\d+))?", str(spec))
        group = None if m is None or m.group(2) is None else int(m.group(2))
        if m is None or (group is not None and group not in GROUP_SIZES):
            raise ValueError(f"quantization must be None, 'int8', 'int4', 'int8'/'int4' with "
                             f"-g32, -g64 or -g128, or 'gguf', got {spec!r}")
        bits = int(m.group(1))
        return cls(bits, 128 if bits == 4 and group is None else group)

    @property
    def name(self) -> str:
        if self.gguf:
            return "gguf"
        return f"int{self.bits}" + ("" if self.group_size is None else f"-g{self.group_size}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [..., I, O] linear weight (leading axes: stacked layers)."""

    q: jax.Array  # i8[..., I, O] (8 bits), u8[..., I/2, O] (4 bits: row 2i low nibble, 2i+1 high)
    scale: jax.Array  # f32[..., G, O]
    offset: jax.Array | None  # f32[..., G, O] (4 bits), None (8 bits: symmetric)
    bits: int = dataclasses.field(metadata=dict(static=True), default=8)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape [..., I, O]."""
        *lead, rows, cols = self.q.shape
        return (*lead, rows * (8 // self.bits), cols)

    @property
    def group_size(self) -> int:
        return self.shape[-2] // self.scale.shape[-2]

    def dequantize(self, dtype=jnp.float32):
        """The float weight [..., I, O] (inside a jitted step: next to its dot)."""
        q = self.q
        if self.bits == 4:
            q = jnp.stack([q & 15, q >> 4], axis=-2)  # [..., I/2, 2, O]
        *lead, rows, cols = self.shape
        groups = self.scale.shape[-2]
        w = q.reshape(*lead, groups, rows // groups, cols).astype(jnp.float32)
        w = w * self.scale[..., None, :]
        if self.offset is not None:
            w = w + self.offset[..., None, :]
        return w.reshape(*lead, rows, cols).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedEmbedding:
    """An int8 [V, E] table with one scale per row: looked up by token, and (tied) the LM head,
    whose output channels are its rows."""

    q: jax.Array  # i8[V, E]
    scale: jax.Array  # f32[V]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def lookup(self, tokens, dtype):
        return (self.q[tokens].astype(jnp.float32) * self.scale[tokens, None]).astype(dtype)


def is_quantized(x) -> bool:
    return isinstance(x, (QuantizedWeight, QuantizedEmbedding))


def placeholder_weight(shape, scheme: QuantScheme) -> QuantizedWeight:
    """Zeros of the quantized layout of a float [..., I, O] weight (a model's params before a
    checkpoint fills them; shape-only under `nnx.eval_shape`)."""
    *lead, rows, cols = shape
    groups = 1 if scheme.group_size is None else rows // scheme.group_size
    if scheme.bits == 8:
        return QuantizedWeight(jnp.zeros(shape, jnp.int8),
                               jnp.ones((*lead, groups, cols), jnp.float32), None, 8)
    return QuantizedWeight(jnp.zeros((*lead, rows // 2, cols), jnp.uint8),
                           jnp.ones((*lead, groups, cols), jnp.float32),
                           jnp.zeros((*lead, groups, cols), jnp.float32), 4)


def placeholder_embedding(shape) -> QuantizedEmbedding:
    return QuantizedEmbedding(jnp.zeros(shape, jnp.int8), jnp.ones(shape[:1], jnp.float32))


# ---- quantizing on the host (numpy, one tensor at a time) -----------------------------------

CHUNK = 1 << 22  # elements quantized at once: bounds the host's temporaries (16 MB of f32)


def quantize(w, scheme: QuantScheme) -> QuantizedWeight:
    """Quantizes a float [..., I, O] weight (numpy, on the host), a block of output columns at
    a time so that the temporaries stay small next to the weight."""
    *lead, rows, cols = w.shape
    step = max(1, CHUNK // max(1, int(np.prod(lead, dtype=np.int64)) * rows))
    if cols > step:
        parts = [_quantize(w[..., c:c + step], scheme) for c in range(0, cols, step)]
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=-1), *parts)
    return _quantize(w, scheme)


def _quantize(w, scheme: QuantScheme) -> QuantizedWeight:
    w = np.asarray(w, np.float32)
    *lead, rows, cols = w.shape
    group = rows if scheme.group_size is None else scheme.group_size
    if rows % group or (scheme.bits == 4 and group % 2):
        raise ValueError(f"quantization {scheme.name}: input size {rows} is not a multiple of "
                         f"the group size {group}")
    g = w.reshape(*lead, rows // group, group, cols)
    if scheme.bits == 8:
        scale = np.abs(g).max(axis=-2) / 127.0
        scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
        q = np.clip(np.rint(g / scale[..., None, :]), -127, 127).astype(np.int8)
        return QuantizedWeight(q.reshape(w.shape), scale, None, 8)
    low, high = g.min(axis=-2), g.max(axis=-2)
    scale = ((high - low) / 15.0).astype(np.float32)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint((g - low[..., None, :]) / scale[..., None, :]), 0, 15).astype(np.uint8)
    return QuantizedWeight(pack_int4(q.reshape(w.shape)), scale, low.astype(np.float32), 4)


def pack_int4(q):
    """u8[..., I, O] values 0..15 -> u8[..., I/2, O]: row 2i in the low nibble, 2i+1 high."""
    q = np.asarray(q, np.uint8)
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


def quantize_embedding(table) -> QuantizedEmbedding:
    """Int8 [V, E] with one absmax scale per row (a block of rows at a time)."""
    step = max(1, CHUNK // table.shape[1])
    if table.shape[0] > step:
        parts = [_quantize_rows(table[r:r + step]) for r in range(0, table.shape[0], step)]
        return QuantizedEmbedding(np.concatenate([p.q for p in parts]),
                                  np.concatenate([p.scale for p in parts]))
    return _quantize_rows(table)


def _quantize_rows(table) -> QuantizedEmbedding:
    table = np.asarray(table, np.float32)
    scale = np.abs(table).max(axis=-1) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(table / scale[:, None]), -127, 127).astype(np.int8)
    return QuantizedEmbedding(q, scale)


def dequantize_host(x) -> np.ndarray:
    """The float32 value of a quantized tensor, on the host (saving, tests)."""
    if isinstance(x, QuantizedEmbedding):
        return np.asarray(x.q, np.float32) * np.asarray(x.scale)[:, None]
    return np.asarray(jax.jit(lambda w: w.dequantize(jnp.float32))(x))


# ---- multiplying on the device --------------------------------------------------------------

def _int8_dot(x, q, scale, contract: int):
    """x[T, I] times the int8 weight q (contracted on its axis ``contract``), both as int8 with
    an int32 accumulator; ``scale``: f32[O] per output channel. -> f32[T, O]."""
    x32 = x.astype(jnp.float32)
    x_scale = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0
    x_scale = jnp.where(x_scale == 0, 1.0, x_scale)
    xq = jnp.clip(jnp.round(x32 / x_scale), -127, 127).astype(jnp.int8)
    rows = xq.shape[0]
    if rows == 1:  # XLA:CPU takes a slow GEMV path for one int8 row; two rows take the GEMM
        xq = jnp.pad(xq, ((0, 1), (0, 0)))
    acc = jax.lax.dot_general(xq, q, (((1,), (contract,)), ((), ())),
                              preferred_element_type=jnp.int32)[:rows]
    return acc.astype(jnp.float32) * x_scale * scale


def qdot(x, w, dtype, *, integer_dot: bool):
    """x[T, I] @ w[I, O] for a float or quantized weight, in ``dtype``."""
    if not isinstance(w, QuantizedWeight):
        return x @ w.astype(dtype)
    if integer_dot and w.bits == 8 and w.scale.shape[-2] == 1:
        return _int8_dot(x, w.q, w.scale[0], 0).astype(dtype)
    return x @ w.dequantize(dtype)


def embedding_logits(hidden, table, dtype, *, integer_dot: bool):
    """f32[T, V] logits of hidden[T, E] against a [V, E] table (tied LM head)."""
    if isinstance(table, QuantizedEmbedding):
        if integer_dot:
            return _int8_dot(hidden, table.q, table.scale, 1)
        w = table.q.astype(dtype) * table.scale[:, None].astype(dtype)
        return jnp.einsum("te,ve->tv", hidden, w).astype(jnp.float32)
    # Contract against the [V, E] table directly: `table.T` would copy it every step.
    return jnp.einsum("...e,ve->...v", hidden, table.astype(dtype)).astype(jnp.float32)


def embed_lookup(table, tokens, dtype):
    if isinstance(table, QuantizedEmbedding):
        return table.lookup(tokens, dtype)
    return table[tokens].astype(dtype)
