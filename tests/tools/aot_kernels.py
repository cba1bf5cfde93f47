"""The kernel configurations ``make test-aot`` compiles, and their abstract inputs.

A ``KernelCase`` names one call of a public kernel (decode or ragged, GPU or TPU) at one
shape; ``sweep()`` enumerates them: the full product under ``-m slow``, a sample that touches
every value of every axis (and every pair of the ones that shape tiles) in CI.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels.quant import scale_rows_shape


@dataclasses.dataclass(frozen=True)
class KernelCase:
    kernel: str  # "decode" | "ragged"
    dtype: str  # "bfloat16" | "float32"
    head_dim: int
    page_size: int
    group: int  # query heads per kv head
    batch: int  # page-table rows
    layers: int  # 0: 4-D pages [K, P, S, 2D]; else 5-D [L, K, P, S, 2D] with a traced layer
    kv_heads: int = 8
    pages: int = 2048  # per layer and kv head
    width: int = 64  # page-table columns
    tokens: int = 128  # ragged: query tokens of the batch (decode: one per row)
    kv_dtype: str = ""  # "": pages in `dtype`; "int8" | "float8_e4m3fn": quantized, with scales

    @property
    def name(self) -> str:
        bits = [self.kernel, {"bfloat16": "bf16", "float32": "f32"}[self.dtype],
                f"D{self.head_dim}", f"S{self.page_size}", f"G{self.group}", f"B{self.batch}",
                "5D" if self.layers else "4D"] + ([f"W{self.width}"] if self.width != 64 else [])
        if self.kv_dtype:
            bits.append({"int8": "kv-int8", "float8_e4m3fn": "kv-fp8"}[self.kv_dtype])
        return "-".join(bits)

    def shapes(self) -> list[jax.ShapeDtypeStruct]:
        dt = jnp.dtype(self.dtype)
        i32 = jnp.int32
        lead = (self.layers,) if self.layers else ()
        pages = jax.ShapeDtypeStruct(
            lead + (self.kv_heads, self.pages, self.page_size, 2 * self.head_dim),
            jnp.dtype(self.kv_dtype or self.dtype))
        heads = self.kv_heads * self.group
        table = jax.ShapeDtypeStruct((self.batch, self.width), i32)
        lens = jax.ShapeDtypeStruct((self.batch,), i32)
        if self.kernel == "decode":
            return [jax.ShapeDtypeStruct((self.batch, heads, self.head_dim), dt), pages, table,
                    lens]
        return [jax.ShapeDtypeStruct((self.tokens, heads, self.head_dim), dt), pages, table,
                lens, jax.ShapeDtypeStruct((self.batch + 1,), i32),
                jax.ShapeDtypeStruct((), i32)]

    def scales(self) -> jax.ShapeDtypeStruct | None:
        """The i32 scale array of quantized pages (``quant.scale_rows_shape``), else None."""
        if not self.kv_dtype:
            return None
        return jax.ShapeDtypeStruct(scale_rows_shape(self.shapes()[1].shape), jnp.int32)

    def fn(self, backend: str, **knobs):
        """The public kernel for ``backend`` ("gpu" | "tpu") with ``layer`` traced for 5-D and,
        for quantized pages, ``kv_scales`` as the last argument (after the layer)."""
        kernel = {("decode", "gpu"): pk.paged_decode_attention_gpu,
                  ("ragged", "gpu"): pk.ragged_paged_attention_gpu,
                  ("decode", "tpu"): pk.paged_decode_attention_tpu,
                  ("ragged", "tpu"): pk.ragged_paged_attention_tpu}[(self.kernel, backend)]
        call = functools.partial(kernel, sm_scale=self.head_dim ** -0.5, **knobs)
        n = len(self.shapes())

        def run(*args):
            extra = {}
            if self.layers:  # the layer comes from the engine's scan: an argument keeps it traced
                extra["layer"] = args[n]
            if self.kv_dtype:
                extra["kv_scales"] = args[-1]
            return call(*args[:n], **extra)

        return run

    def all_shapes(self) -> list[jax.ShapeDtypeStruct]:
        extra = [jax.ShapeDtypeStruct((), jnp.int32)] if self.layers else []
        return self.shapes() + extra + ([self.scales()] if self.kv_dtype else [])


AXES = dict(kernel=("decode", "ragged"), dtype=("bfloat16", "float32"), head_dim=(64, 128),
            page_size=(16, 32), group=(1, 4, 8), batch=(1, 8), layers=(0, 4))


def sweep(full: bool) -> list[KernelCase]:
    """Every combination of AXES (``full``), or a CI sample: every (kernel, head_dim, page_size,
    group) combination in bf16, the tile-shaping axes, with batch, layout and one f32 variant
    per kernel and head_dim rotating through it."""
    if full:
        return [KernelCase(*values) for values in itertools.product(*AXES.values())] + QUANTIZED
    cases = []
    for i, (kernel, d, s, g) in enumerate(itertools.product(
            AXES["kernel"], AXES["head_dim"], AXES["page_size"], AXES["group"])):
        cases.append(KernelCase(kernel, "bfloat16", d, s, g, batch=(1, 8)[i % 2],
                                layers=(0, 4)[(i // 2) % 2]))
    for kernel, d in itertools.product(AXES["kernel"], AXES["head_dim"]):
        cases.append(KernelCase(kernel, "float32", d, 16, 4, batch=8, layers=4))
    return cases + EDGES + QUANTIZED


# Quantized pages (int8, fp8 e4m3) with bf16 compute: both kernels, both head dims, GQA 1 and 8,
# 4-D and 5-D pages. Pages of 32 tokens: int8's TPU sublane tile is 32 rows.
QUANTIZED = [
    KernelCase(kernel, "bfloat16", d, 32, g, batch=8, layers=layers, kv_dtype=kv)
    for kernel in AXES["kernel"] for d in AXES["head_dim"]
    for g, layers, kv in ((1, 0, "int8"), (8, 4, "int8"), (4, 4, "float8_e4m3fn"))
]


# Beyond the product: pages of 8 and 64 (at 64 with head_dim 128 no broadcast decode tile fits
# and the decode kernel falls back to tl.dot), and the engine's 1.5x-power-of-two shapes
# (3, 6, 12 rows; 96, 192, 384 table columns), which the TPU kernel's table windows must take.
EDGES = [
    KernelCase("decode", "bfloat16", 128, 64, 4, batch=8, layers=4),
    KernelCase("decode", "float32", 64, 8, 1, batch=8, layers=0),  # TPU: bf16 pages need 16
    KernelCase("ragged", "bfloat16", 128, 64, 8, batch=8, layers=4),
    KernelCase("ragged", "bfloat16", 64, 16, 4, batch=6, layers=4, width=96),
    KernelCase("decode", "bfloat16", 64, 16, 4, batch=12, layers=4, width=384),
    KernelCase("decode", "bfloat16", 128, 16, 1, batch=3, layers=4, width=192),
]
