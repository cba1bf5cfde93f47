"""The CPU twin of the quantized-matmul kernels: a C++ XLA FFI call (``csrc/cpu_quant_matmul.cc``).

XLA:CPU has no fused int4 dot and materializes a converted weight before a float dot, so on
CPU a quantized weight multiplied through XLA is slower than fp32. This kernel reads the
integers once per step: x is rounded to int8 per token and per block of 32 inputs (llama.cpp's
Q8_0 scheme), products accumulate in int32 per block with AVX-512 VNNI, each block's sum is
scaled in float (`csrc/cpu_quant_matmul.cc` has the formula), and columns are split over XLA's
intra-op threads.

The library is compiled on first use (`pallas_kernels.cpu_library`); `available` is False
where that fails (no compiler), and callers fall back to XLA. Without AVX-512 VNNI (and VBMI)
the library computes the same integer sums in portable C++ (slower), and `has_vnni` says so
(``JAXKV_CPU_PORTABLE=1`` forces that path). Scales and offsets are read as stored if f16 or
f32 (others are cast to f32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_library import library
from pallas_kernels.quant_reference import check_quantized_weight

TARGET = "jaxkv_quantized_matmul"
BLOCK = 32  # inputs per activation scale: group sizes and I must be multiples of it
LANES = 16  # outputs per vector: O must be a multiple of it


def available() -> bool:
    """True where the CPU kernel is built and registered (a C++ compiler was found)."""
    return library() is not None


def has_vnni() -> bool:
    """True where the library's AVX-512 VNNI path runs (else its portable loop does)."""
    lib = library()
    return lib is not None and bool(lib.JaxkvQuantizedMatmulHasVnni())


def supports(x_shape, q, scale, bits: int) -> bool:
    """Whether the kernel takes these shapes: I and the group size multiples of 32, O of 16."""
    i, o, group = check_quantized_weight(x_shape, q, scale, None if bits == 8 else scale, bits)
    return i % BLOCK == 0 and group % BLOCK == 0 and o % LANES == 0


@functools.partial(jax.jit, static_argnames=("bits", "out_dtype", "group_size"))
def quantized_matmul_cpu(
    x,  # [T, I] float
    q,  # i8[I, O] or u8[I/2, O]
    scale,  # [G, O]
    offset=None,  # [G, O] or None
    *,
    bits: int,
    out_dtype=None,
    group_size: int | None = None,  # if given, I // G must equal it
):
    """``x @ dequantize(q, scale, offset)`` -> ``[T, O]`` (``out_dtype``, default x's), on
    XLA:CPU through the FFI kernel. Requires `available()` and `supports(...)`."""
    check_quantized_weight(x.shape, q, scale, offset, bits, group_size=group_size)
    if not supports(x.shape, q, scale, bits):
        raise ValueError(f"quantized_matmul_cpu: needs I and group size multiples of {BLOCK} "
                         f"and O a multiple of {LANES}; got x {list(x.shape)}, q "
                         f"{list(q.shape)}, scale {list(scale.shape)}")
    if library() is None:
        raise RuntimeError("quantized_matmul_cpu: the C++ kernel could not be built")
    f32 = jnp.float32
    stored = scale.dtype if scale.dtype in (jnp.float16, f32) else f32
    scale = scale.astype(stored)
    offset = scale if offset is None else offset.astype(stored)  # unread without has_offset
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], q.shape[1]), f32))
    out = call(x.astype(f32), q, scale, offset, bits=np.int32(bits),
               has_offset=offset is not scale)
    return out.astype(out_dtype or x.dtype)
