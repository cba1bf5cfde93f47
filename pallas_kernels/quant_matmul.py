"""Weight-only quantized matmul: ``x @ dequantize(w)`` with the weight read as integers, on
the kernel of a backend (as the attention entry points in ``api.py`` dispatch).

The weight layout, its checks and the pure-jnp reference every kernel is tested against are
in ``quant_reference``.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.quant_reference import (  # noqa: F401 (the reference is part of the API)
    WEIGHT_BITS,
    check_quantized_weight,
    dequantize_reference,
    quantized_matmul_reference,
    unpack_int4,
)

QUANT_MATMUL_BACKENDS = ("cpu", "gpu", "tpu", "reference")


def _kernel(backend: str):
    # Imported when first used: a process loads only the kernels of the backends it runs.
    if backend == "cpu":
        from pallas_kernels.cpu_quant_matmul import quantized_matmul_cpu
        return quantized_matmul_cpu
    if backend == "gpu":
        from pallas_kernels.gpu_quant_matmul import quantized_matmul_gpu
        return quantized_matmul_gpu
    if backend == "tpu":
        from pallas_kernels.tpu_quant_matmul import quantized_matmul_tpu
        return quantized_matmul_tpu
    raise ValueError(f"backend must be one of {QUANT_MATMUL_BACKENDS}, got {backend!r}")


def kernel_takes(backend: str, x, q, scale, offset, *, bits: int,
                 group_size: int | None = None) -> bool:
    """Whether ``backend``'s kernel takes these operands (shapes, dtypes, group size): the
    kernels refuse what they cannot tile (e.g. TPU: O off the 128-lane tile), and a caller then
    falls back to the reference. Operands no backend reads right (`check_quantized_weight`,
    a scale implying another ``group_size`` among them) raise its ValueError instead. Decided
    at trace time from abstract values."""
    check_quantized_weight(x.shape, q, scale, offset, bits, group_size=group_size)
    if backend == "reference":
        return True
    if backend == "cpu":
        from pallas_kernels import cpu_quant_matmul as cpu
        return cpu.available() and cpu.supports(x.shape, q, scale, bits)
    try:
        jax.eval_shape(functools.partial(_kernel(backend), bits=bits), x, q, scale, offset)
    except ValueError:
        return False
    return True


def quantized_matmul(x, q, scale, offset=None, *, bits: int, backend: str = "reference",
                     interpret: bool = False, out_dtype=None, group_size: int | None = None):
    """``x[T, I] @ dequantize(q, scale, offset)`` -> ``[T, O]`` on ``backend``: "cpu" (C++
    FFI, `cpu_quant_matmul`), "gpu" (Pallas Triton), "tpu" (Pallas Mosaic) or "reference"
    (XLA: dequantize, then dot). ``interpret`` runs a Pallas kernel in interpret mode.
    ``group_size``: the weight's true group (a ValueError if ``I // G`` differs)."""
    if backend == "reference":
        return quantized_matmul_reference(x, q, scale, offset, bits=bits, out_dtype=out_dtype,
                                          group_size=group_size)
    kwargs = {} if backend == "cpu" else {"interpret": interpret}
    return _kernel(backend)(x, q, scale, offset, bits=bits, out_dtype=out_dtype,
                            group_size=group_size, **kwargs)
