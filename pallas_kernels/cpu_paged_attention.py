"""Decode attention over paged K/V on CPU: a C++ XLA FFI call (``csrc/cpu_paged_attention.cc``).

XLA:CPU's gather from the head-major pool ``[L, K, P, S, 2D]`` is the jnp reference's cost
(it runs at a tenth of the memory bandwidth: docs/BENCHMARKS.md); this kernel reads each
page's ``[S, 2D]`` slab where it lies, once per (row, kv head), with the semantics of
`paged_decode_attention_reference` (window, soft cap, quantized pages). Pages f32, bf16 or
int8 (with their scale words); `supports` says which, and callers use the reference otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_library import library
from pallas_kernels.quant import scale_rows_shape

TARGET = "jaxkv_paged_decode_attention"
PAGE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


def supports(kv_pages) -> bool:
    """Whether the kernel takes these pages (dtype) and the library is built."""
    return jnp.dtype(kv_pages.dtype) in PAGE_DTYPES and library() is not None


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window"))
def paged_decode_attention_cpu(
    q,  # [B, H, D]  one new token per sequence
    kv_pages,  # [K, P, S, 2D], or [L, K, P, S, 2D] with ``layer``
    page_table,  # i32[B, W]
    lengths,  # i32[B]  cached tokens including the new one; 0 marks a padding row
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,
    kv_scales=None,  # i32 quant.scale_rows_shape(kv_pages.shape): scales of int8 pages
):
    """Decode attention -> [B, H, D] in q's dtype (see the module docstring)."""
    if not supports(kv_pages):
        raise ValueError(f"paged_decode_attention_cpu: pages must be one of "
                         f"{[jnp.dtype(d).name for d in PAGE_DTYPES]}, got {kv_pages.dtype} "
                         "(and the C++ library must build)")
    if kv_pages.ndim == 4:
        kv_pages, layer = kv_pages[None], 0
        kv_scales = None if kv_scales is None else kv_scales[None]
    if layer is None:
        raise ValueError("layer is required with 5-D pages [L, K, P, S, 2D]")
    b, h, d = q.shape
    if kv_pages.shape[-1] != 2 * d or h % kv_pages.shape[1]:
        raise ValueError(f"q [B, H, D] = {list(q.shape)} does not fit pages "
                         f"{list(kv_pages.shape)} (2D and a multiple of K heads)")
    quantized = kv_pages.dtype == jnp.int8
    if quantized != (kv_scales is not None):
        raise ValueError("kv_scales: int8 pages need their scale words, others take none")
    if quantized and tuple(kv_scales.shape) != scale_rows_shape(kv_pages.shape):
        raise ValueError(f"kv_scales: expected {scale_rows_shape(kv_pages.shape)}, got "
                         f"{list(kv_scales.shape)}")
    scales = kv_scales if quantized else jnp.zeros((1, 1, 1, 1), jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((b, h, d), jnp.float32))
    out = call(q.astype(jnp.float32), kv_pages, page_table.astype(jnp.int32),
               lengths.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
               scales.astype(jnp.int32), sm_scale=np.float32(sm_scale),
               soft_cap=np.float32(soft_cap or 0.0),
               window=np.int32(sliding_window or 0), has_scales=quantized)
    return out.astype(q.dtype)
