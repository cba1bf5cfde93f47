"""Weight-only quantization: integer weights and their scales kept on the device, and the
matmul that reads them.

A quantized linear weight is a `QuantizedWeight` pytree (packed integers + scales + offsets)
held where the float weight would be, so it jits, donates, shards and `update_params` like any
params. Axes: I input, O output, G groups along I (``I // group_size``; 1 = per output channel),
V vocabulary, E hidden. A weight is ``w[i, o] = q[i, o] * scale[g(i), o] + offset[g(i), o]``:
symmetric int8 has no offset; int4 is asymmetric (min/max), the form GGUF's Q4_1 and AWQ/GPTQ
zero points take exactly (``offset = -zero * scale``).

The embedding, quantized, is the same pytree in the tied LM head's [in, out] layout: int8
[E, V] with a scale per table row (per output channel), or a GGUF file's own blocks; a lookup
dequantizes only the gathered columns.

How it multiplies (`qdot`), by ``kernel``:

- **"cpu"**: the C++ FFI kernel (`pallas_kernels.cpu_quant_matmul`): activations rounded to
  int8 per 32 inputs (llama.cpp's Q8_0), int32 sums with AVX-512 VNNI, no float weight at any
  point. XLA:CPU has no fused int4 dot and writes a converted copy of an int8 weight before a
  float dot, slower than reading fp32: this is its fast path. Without a C++ compiler, int8
  per-channel weights fall back to XLA's int8 x int8 -> int32 dot (activations per token).
- **"gpu"** / **"tpu"**: the Pallas weight-only kernels (`gpu_quant_matmul`,
  `tpu_quant_matmul`): integers read from HBM, dequantized in registers / VMEM.
- **"xla"** (``integer_dot=False``, or shapes a kernel refuses): the weight dequantized next
  to its dot inside the jitted step.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_matmul import kernel_takes, quantized_matmul

GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How weights are quantized: ``bits`` 8 or 4, ``group_size`` None (per output channel) or
    one of 32/64/128, the most: a weight whose inputs it does not divide takes the largest of
    those below it that does (`group_for`); ``embedding``: the embedding (and an untied LM
    head) int8 per row too."""

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
        if spec == "gguf":  # the embedding's blocks as stored too (a float one: int8 per row)
            return cls(4, 32, embedding=True, gguf=True)
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
    scale: jax.Array  # f16[..., G, O] (f32 where a checkpoint's values need it: AWQ/GPTQ)
    offset: jax.Array | None  # like scale (4 bits), None (8 bits: symmetric)
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
        w = w * self.scale[..., None, :].astype(jnp.float32)
        if self.offset is not None:
            w = w + self.offset[..., None, :].astype(jnp.float32)
        return w.reshape(*lead, rows, cols).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTable:
    """An int8 embedding table kept row by row, [V, E], one scale per row: the layout for TPU,
    where a lookup gathers rows (gathering columns of the [E, V] `QuantizedWeight` makes
    XLA:TPU relayout the whole table every step) and the tied LM head contracts against the
    int8 rows with XLA's dot, the per-row scale applied to its product."""

    values: jax.Array  # i8[V, E]
    scales: jax.Array  # f16[V, 1]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def dequantize(self, dtype=jnp.float32):
        return (self.values.astype(jnp.float32) * self.scales.astype(jnp.float32)).astype(dtype)

    def logits(self, hidden, dtype):
        """f32[T, V] of hidden[T, E] against the table."""
        out = jnp.einsum("te,ve->tv", hidden.astype(dtype), self.values.astype(dtype),
                         preferred_element_type=jnp.float32)
        return out * self.scales[:, 0].astype(jnp.float32)


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight | QuantizedTable)


def table_rows(platform: str | None = None) -> bool:
    """Whether a quantized embedding is kept as a `QuantizedTable` (rows: TPU) or in the LM
    head's [E, V] layout (columns: CPU and GPU, where the matmul kernels read it and a lookup
    gathers columns in place)."""
    return (platform or jax.default_backend()) == "tpu"


def group_for(rows: int, scheme: QuantScheme) -> int:
    """The group size of a weight of ``rows`` inputs under ``scheme``: ``rows`` (per channel),
    else the scheme's group or, where that does not divide ``rows``, the largest of
    `GROUP_SIZES` below it that does (SmolLM2's 576 hidden inputs take int4's 128 as 64): a
    power of two >= 32, as every kernel tiles. A ValueError if none divides."""
    if scheme.group_size is None:
        return rows
    fits = [g for g in GROUP_SIZES if g <= scheme.group_size and rows % g == 0]
    if not fits:
        raise ValueError(f"quantization {scheme.name}: input size {rows} is not a multiple of "
                         f"the group size {scheme.group_size} or of a smaller one of "
                         f"{GROUP_SIZES}")
    return max(fits)


def placeholder_weight(shape, scheme: QuantScheme) -> QuantizedWeight:
    """Zeros of the quantized layout of a float [..., I, O] weight (a model's params before a
    checkpoint fills them; shape-only under `nnx.eval_shape`)."""
    *lead, rows, cols = shape
    groups = rows // group_for(rows, scheme)
    if scheme.bits == 8:
        return QuantizedWeight(jnp.zeros(shape, jnp.int8),
                               jnp.ones((*lead, groups, cols), jnp.float16), None, 8)
    return QuantizedWeight(jnp.zeros((*lead, rows // 2, cols), jnp.uint8),
                           jnp.ones((*lead, groups, cols), jnp.float16),
                           jnp.zeros((*lead, groups, cols), jnp.float16), 4)


def placeholder_embedding(shape, rows: bool = False) -> QuantizedWeight | QuantizedTable:
    """The quantized layout of a float [V, E] table: int8 [E, V], a scale per row of the table
    (per output channel of the tied LM head), or with ``rows`` a `QuantizedTable`; filled by
    loading."""
    v, e = shape
    if rows:
        return QuantizedTable(jnp.zeros((v, e), jnp.int8), jnp.ones((v, 1), jnp.float16))
    return placeholder_weight((e, v), QuantScheme(8, None))


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


def _half(x, up: bool) -> np.ndarray:
    """``x`` as float16, rounded toward +inf (``up``) or -inf instead of to nearest: the
    scales and offsets are stored in 16 bits (GGUF's own are), and directed rounding keeps
    every weight inside the grid they span, so rounding error stays at most half a step."""
    h = np.asarray(x, np.float32).astype(np.float16)
    off = h.astype(np.float32) < x if up else h.astype(np.float32) > x
    return np.where(off, np.nextafter(h, np.float16(np.inf if up else -np.inf)), h)


def _quantize(w, scheme: QuantScheme) -> QuantizedWeight:
    w = np.asarray(w, np.float32)
    *lead, rows, cols = w.shape
    group = group_for(rows, scheme)
    if scheme.bits == 4 and group % 2:  # per channel, an odd number of inputs
        raise ValueError(f"quantization {scheme.name}: int4 needs an even input size (two "
                         f"rows per byte), got {rows}")
    g = w.reshape(*lead, rows // group, group, cols)
    if scheme.bits == 8:
        scale = _half(np.abs(g).max(axis=-2) / 127.0, up=True)
        scale = np.where(scale == 0, np.float16(1), scale)
        q = np.clip(np.rint(g / scale[..., None, :].astype(np.float32)), -127, 127)
        return QuantizedWeight(q.astype(np.int8).reshape(w.shape), scale, None, 8)
    low = _half(g.min(axis=-2), up=False)
    scale = _half((g.max(axis=-2) - low.astype(np.float32)) / 15.0, up=True)
    scale = np.where(scale == 0, np.float16(1), scale)
    q = np.rint((g - low[..., None, :].astype(np.float32)) / scale[..., None, :].astype(np.float32))
    q = np.clip(q, 0, 15).astype(np.uint8)
    return QuantizedWeight(pack_int4(q.reshape(w.shape)), scale, low, 4)


def pack_int4(q):
    """u8[..., I, O] values 0..15 -> u8[..., I/2, O]: row 2i in the low nibble, 2i+1 high."""
    q = np.asarray(q, np.uint8)
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


def quantize_embedding(table) -> QuantizedWeight:
    """A float [V, E] table as int8 [E, V] with one scale per row of the table: the LM head's
    [in, out] layout (`qdot`'s kernels multiply it as they do any weight); a lookup gathers
    columns (`embed_lookup`)."""
    return quantize(np.asarray(table).T, QuantScheme(8, None))


def as_table(w: QuantizedWeight) -> QuantizedTable:
    """A quantized embedding in the [E, V] layout as a `QuantizedTable`: int8 per-row values
    as they are, transposed; other layouts (a GGUF table's Q8_0 or Q4 blocks, int4 groups)
    requantized to int8 per row, a block of rows at a time (never the whole table in float)."""
    q, scale = np.asarray(w.q), np.asarray(w.scale)
    if w.bits == 8 and scale.shape[-2] == 1:
        return QuantizedTable(np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T))
    e, v = w.shape
    values, scales = np.empty((v, e), np.int8), np.empty((v, 1), np.float16)
    step = max(1, CHUNK // e)
    for c in range(0, v, step):
        part = QuantizedWeight(q[:, c:c + step], scale[:, c:c + step],
                               None if w.offset is None else np.asarray(w.offset)[:, c:c + step],
                               w.bits)
        rows = quantize(dequantize_host(part), QuantScheme(8, None))
        values[c:c + step], scales[c:c + step] = rows.q.T, rows.scale.T
    return QuantizedTable(values, scales)


def dequantize_host(x) -> np.ndarray:
    """The float32 value of a quantized tensor ([..., I, O], or a table's [V, E]), in numpy on
    the host (saving, requantizing, tests): nothing goes through a device."""
    if isinstance(x, QuantizedTable):
        return np.asarray(x.values, np.float32) * np.asarray(x.scales, np.float32)
    q = np.asarray(x.q)
    if x.bits == 4:  # byte row r holds input rows 2r (low nibble) and 2r + 1
        q = np.stack([q & 15, q >> 4], axis=-2).reshape(*q.shape[:-2], 2 * q.shape[-2],
                                                          q.shape[-1])
    *lead, rows, cols = q.shape
    groups = x.scale.shape[-2]
    w = (q.reshape(*lead, groups, rows // groups, cols).astype(np.float32)
         * np.asarray(x.scale, np.float32)[..., None, :])
    if x.offset is not None:
        w += np.asarray(x.offset, np.float32)[..., None, :]
    return w.reshape(*lead, rows, cols)


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
    return acc.astype(jnp.float32) * x_scale * scale.astype(jnp.float32)


MATMUL_KERNELS = ("cpu", "gpu", "tpu", "xla")


def qdot(x, w, dtype, *, kernel: str, split: str | None = None, mesh=None):
    """x[T, I] @ w[I, O] for a float or quantized weight, in ``dtype``. ``kernel``: "cpu",
    "gpu" or "tpu" multiply a quantized weight with that platform's kernel
    (`pallas_kernels.quant_matmul`) where it takes the shapes; "xla" (or a shape the kernel
    refuses) dequantizes next to the dot. With a ``mesh`` of tensor parallelism (axis "tp"),
    the kernel runs per device on its shard (``split`` "column": w split by output, or "row":
    split by input, partial sums added); a kernel is a custom call, which the partitioner
    would otherwise run on gathered, whole weights."""
    if not isinstance(w, QuantizedWeight):
        return x @ w.astype(dtype)
    if kernel != "xla" and mesh is not None and mesh.shape.get(TP, 1) > 1 and split:
        out = _sharded_kernel_dot(x, w, dtype, kernel, split, mesh)
        if out is not None:
            return out
    elif kernel != "xla" and kernel_takes(kernel, x, w.q, w.scale, w.offset, bits=w.bits):
        return quantized_matmul(x, w.q, w.scale, w.offset, bits=w.bits, backend=kernel,
                                out_dtype=dtype)
    if kernel == "cpu" and w.bits == 8 and w.scale.shape[-2] == 1:
        return _int8_dot(x, w.q, w.scale[0], 0).astype(dtype)
    return x @ w.dequantize(dtype)


TP = "tp"  # the tensor-parallel mesh axis (jaxkv.sharding)


def _sharded_kernel_dot(x, w: QuantizedWeight, dtype, kernel: str, split: str, mesh):
    """``x @ w`` with the kernel run per shard of ``mesh`` (None where a shard's shapes are
    ones the kernel refuses: the caller dequantizes, which the partitioner splits correctly).

    A row-split weight's G groups need not divide over the tp devices (Qwen2.5-0.5B's o_proj:
    7 groups of 128 over 2; `jaxkv.sharding.param_spec` then keeps its scales whole). Its
    scales are then repeated into groups of gcd(group, I / tp) rows, the same weight in finer
    groups, which do split with the rows: [G, O] floats repeated in the step, next to [I, O]
    integers read. Each shard's kernel is told its group size, so scales that were not
    meant for its rows are refused rather than applied."""
    from jax.sharding import PartitionSpec as P

    tp = mesh.shape[TP]
    group, scale, offset = w.group_size, w.scale, w.offset
    if split == "column":
        if w.q.shape[1] % tp:
            return None
        x_spec, w_spec, g_spec, out_spec = P(), P(None, TP), P(None, TP), P(None, TP)
    else:
        if w.q.shape[0] % tp:
            return None
        x_spec, w_spec, g_spec, out_spec = P(None, TP), P(TP, None), P(TP, None), P()
        # I / tp is even for 4 bits (its byte rows split), so the finer group is too.
        finer = math.gcd(group, w.shape[0] // tp)
        if finer != group:
            scale, offset = (None if a is None else jnp.repeat(a, group // finer, axis=0)
                             for a in (scale, offset))
            group = finer

    def local(a, spec):
        if a is None:
            return None
        axes = (*spec, *(None,) * (a.ndim - len(spec)))
        return jax.ShapeDtypeStruct(tuple(n // tp if ax == TP else n
                                          for n, ax in zip(a.shape, axes, strict=True)),
                                    a.dtype)

    if not kernel_takes(kernel, local(x, x_spec), local(w.q, w_spec), local(scale, g_spec),
                        local(offset, g_spec), bits=w.bits, group_size=group):
        return None

    def body(x, q, scale, offset):
        y = quantized_matmul(x, q, scale, offset, bits=w.bits, backend=kernel,
                             out_dtype=jnp.float32, group_size=group)
        return (y if split == "column" else jax.lax.psum(y, TP)).astype(dtype)

    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(x_spec, w_spec, g_spec, None if offset is None else g_spec),
                       out_specs=out_spec, check_vma=False)
    return fn(x, w.q, scale, offset)


def embedding_logits(hidden, table, dtype, *, kernel: str, mesh=None):
    """f32[T, V] logits of hidden[T, E] against the embedding (the tied LM head): a float
    [V, E] table, a `QuantizedTable`, or a quantized one in its [E, V] layout."""
    if isinstance(table, QuantizedTable):
        return table.logits(hidden, dtype)
    if isinstance(table, QuantizedWeight):
        return qdot(hidden, table, dtype, kernel=kernel, split="column",
                    mesh=mesh).astype(jnp.float32)
    # Contract against the [V, E] table directly: `table.T` would copy it every step.
    return jnp.einsum("...e,ve->...v", hidden, table.astype(dtype)).astype(jnp.float32)


def embed_lookup(table, tokens, dtype):
    """[T, E] embeddings of ``tokens``: rows of a float [V, E] table, or the dequantized
    columns of a quantized [E, V] one (only the gathered columns are dequantized)."""
    if isinstance(table, QuantizedTable):
        return QuantizedTable(table.values[tokens], table.scales[tokens]).dequantize(dtype)
    if isinstance(table, QuantizedWeight):
        def cols(a):
            return None if a is None else a[:, tokens]
        picked = QuantizedWeight(cols(table.q), cols(table.scale), cols(table.offset), table.bits)
        return picked.dequantize(dtype).T
    return table[tokens].astype(dtype)
