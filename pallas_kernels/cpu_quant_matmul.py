"""The CPU twin of the quantized-matmul kernels: a C++ XLA FFI call (``csrc/cpu_quant_matmul.cc``).

XLA:CPU has no fused int4 dot and materializes a converted weight before a float dot, so on
CPU a quantized weight multiplied through XLA is slower than fp32. This kernel reads the
integers once per step: x is rounded to int8 per token and per block of 32 inputs (llama.cpp's
Q8_0 scheme), products accumulate in int32 per block with AVX-512 VNNI, each block's sum is
scaled in float (`csrc/cpu_quant_matmul.cc` has the formula), and columns are split over XLA's
intra-op threads.

The library is compiled on first use with the system C++ compiler against jaxlib's FFI headers
(``jax.ffi.include_dir()``) into a cache folder (``$JAXKV_CACHE_DIR``, default
``~/.cache/jaxkv``), keyed by the source's hash; `available` is False where that fails (no
compiler), and callers fall back to XLA. Without AVX-512 VNNI the library computes the same
integer sums in portable C++ (slower), and `has_vnni` says so (``JAXKV_CPU_PORTABLE=1`` forces
that path). Scales and offsets are read as stored if f16 or f32 (others are cast to f32).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_matmul import check_quantized_weight

SOURCE = Path(__file__).parent / "csrc" / "cpu_quant_matmul.cc"
TARGET = "jaxkv_quantized_matmul"
BLOCK = 32  # inputs per activation scale: group sizes and I must be multiples of it
LANES = 16  # outputs per vector: O must be a multiple of it


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXKV_CACHE_DIR") or Path.home() / ".cache" / "jaxkv")


def _compile() -> Path:
    """The shared library for this source, compiled once per source hash and jaxlib."""
    digest = hashlib.sha256(SOURCE.read_bytes() + jax.ffi.include_dir().encode()
                            + jax.__version__.encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_quant_matmul-{digest}.so"
    if out.is_file():
        return out
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++ or $CXX) to build the CPU quantized matmul")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # atomic: rename when complete
        built = Path(tmp) / out.name
        subprocess.run([compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-w",
                        f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built)],
                       check=True, capture_output=True, text=True)
        os.replace(built, out)
    return out


@functools.cache
def _library():
    """The loaded library with its FFI target registered, or None where it cannot be built."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_compile()))
    except (OSError, subprocess.CalledProcessError):
        return None
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxkvQuantizedMatmul),
                                platform="cpu")
    return lib


def available() -> bool:
    """True where the CPU kernel is built and registered (a C++ compiler was found)."""
    return _library() is not None


def has_vnni() -> bool:
    """True where the library's AVX-512 VNNI path runs (else its portable loop does)."""
    lib = _library()
    return lib is not None and bool(lib.JaxkvQuantizedMatmulHasVnni())


def supports(x_shape, q, scale, bits: int) -> bool:
    """Whether the kernel takes these shapes: I and the group size multiples of 32, O of 16."""
    i, o, group = check_quantized_weight(x_shape, q, scale, None if bits == 8 else scale, bits)
    return i % BLOCK == 0 and group % BLOCK == 0 and o % LANES == 0


@functools.partial(jax.jit, static_argnames=("bits", "out_dtype"))
def quantized_matmul_cpu(
    x,  # [T, I] float
    q,  # i8[I, O] or u8[I/2, O]
    scale,  # [G, O]
    offset=None,  # [G, O] or None
    *,
    bits: int,
    out_dtype=None,
):
    """``x @ dequantize(q, scale, offset)`` -> ``[T, O]`` (``out_dtype``, default x's), on
    XLA:CPU through the FFI kernel. Requires `available()` and `supports(...)`."""
    check_quantized_weight(x.shape, q, scale, offset, bits)
    if not supports(x.shape, q, scale, bits):
        raise ValueError(f"quantized_matmul_cpu: needs I and group size multiples of {BLOCK} "
                         f"and O a multiple of {LANES}; got x {list(x.shape)}, q "
                         f"{list(q.shape)}, scale {list(scale.shape)}")
    if _library() is None:
        raise RuntimeError("quantized_matmul_cpu: the C++ kernel could not be built")
    f32 = jnp.float32
    stored = scale.dtype if scale.dtype in (jnp.float16, f32) else f32
    scale = scale.astype(stored)
    offset = scale if offset is None else offset.astype(stored)  # unread without has_offset
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], q.shape[1]), f32))
    out = call(x.astype(f32), q, scale, offset, bits=np.int32(bits),
               has_offset=offset is not scale)
    return out.astype(out_dtype or x.dtype)
