"""The weight-only quantized matmul shapes ``make test-aot`` compiles for TPU.

A ``QuantCase`` is one call of ``quantized_matmul_tpu`` at a real shape: Llama-3-8B's MLP
(4096 -> 14336, 14336 -> 4096) and LM head (4096 -> 128256), decode (T = 1, 16) and prefill
(T = 512), int8 per output channel and int4 with groups of 128 and 32, bf16 activations and
f32 scales (what ``jaxkv.model.quant`` stores).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from pallas_kernels.tpu_quant_matmul import quantized_matmul_tpu

SHAPES = {"mlp-up": (4096, 14336), "mlp-down": (14336, 4096), "lm-head": (4096, 128256)}
SCHEMES = {"int8": (8, None), "int4-g128": (4, 128), "int4-g32": (4, 32)}
TOKENS = (1, 16, 512)


@dataclasses.dataclass(frozen=True)
class QuantCase:
    shape: str  # a key of SHAPES
    scheme: str  # a key of SCHEMES
    tokens: int
    x_dtype: str = "bfloat16"
    scale_dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"{self.shape}-{self.scheme}-T{self.tokens}"

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme][0]

    def shapes(self) -> list[jax.ShapeDtypeStruct | None]:
        """x, q, scale, offset (None for symmetric int8)."""
        i, o = SHAPES[self.shape]
        group = SCHEMES[self.scheme][1] or i
        scale = jax.ShapeDtypeStruct((i // group, o), jnp.dtype(self.scale_dtype))
        return [jax.ShapeDtypeStruct((self.tokens, i), jnp.dtype(self.x_dtype)),
                jax.ShapeDtypeStruct((i * self.bits // 8, o),
                                     jnp.int8 if self.bits == 8 else jnp.uint8),
                scale, scale if self.bits == 4 else None]

    def fn(self):
        return jax.jit(functools.partial(quantized_matmul_tpu, bits=self.bits))

    def weight_bytes(self) -> int:
        return self.shapes()[1].size  # one byte per element of q

    def x_bytes(self) -> int:
        x = self.shapes()[0]
        return x.size * x.dtype.itemsize


COLUMNS = ["chip", "quantized matmul (bf16 x)", "weight MiB", "temp MiB", "largest copy MiB",
           "VMEM KiB", "compile s"]


def cases() -> list[QuantCase]:
    """Every (shape, scheme, T)."""
    return [QuantCase(s, q, t) for s, q, t in itertools.product(SHAPES, SCHEMES, TOKENS)]


def chip_cases(chips) -> list[tuple[str, QuantCase, bool]]:
    """(chip, case, in CI): every case on every chip; CI compiles each case on one chip,
    alternating, so every shape, scheme and T still runs on both chips."""
    return [(chip, case, (n + c) % 2 == 0) for n, case in enumerate(cases())
            for c, chip in enumerate(chips)]


def row(chip: str, case: QuantCase, report) -> list[str]:
    """The case's row of the table (``report``: a ``aot_tpu.TpuReport``)."""
    mib = 2**20
    return [chip, case.name, f"{case.weight_bytes() / mib:.1f}", f"{report.temp_bytes / mib:.2f}",
            f"{report.largest_copy() / mib:.2f}",
            "/".join(str(v // 1024) for v in report.vmem_bytes), f"{report.seconds:.1f}"]
