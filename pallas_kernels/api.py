"""Public paged-attention entry points, dispatching to a backend.

``backend``: "auto" (the kernel for the default platform: Triton-lowered Pallas on GPU,
Mosaic on TPU, on CPU the C++ decode kernel and the jnp reference for ragged batches), "gpu",
"tpu", "cpu", or "reference".
``interpret=True`` runs the chosen kernel in Pallas interpret mode, on any platform (the
TPU kernel under ``pltpu.force_tpu_interpret_mode()``), which is how CPU tests execute
kernel code. Pages are packed K|V (``layout.py``): ``[K, P, S, 2D]``, or ``[L, K, P, S, 2D]``
with ``layer`` selecting the layer inside the kernel, so a caller scanning over layers never
copies a layer's pool. Quantized pages (int8, float8_e4m3fn) come with ``kv_scales``, one i32
word per slot holding the key and value scales, pages packed 128 words to a row
(``quant.scale_rows_shape``); every backend dequantizes inside its inner loop.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.cpu_library import library
from pallas_kernels.cpu_paged_attention import paged_decode_attention_cpu
from pallas_kernels.cpu_paged_attention import supports as cpu_supports
from pallas_kernels.gpu_paged_attention import (
    paged_decode_attention_gpu,
    ragged_paged_attention_gpu,
)
from pallas_kernels.quant import is_quantized, pages_per_scale_row, scale_rows_shape
from pallas_kernels.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)
from pallas_kernels.tpu_ragged_paged_attention import (
    paged_decode_attention_tpu,
    ragged_paged_attention_tpu,
)

BACKENDS = ("auto", "gpu", "tpu", "cpu", "reference")


def resolve_backend(backend: str) -> str:
    """The concrete backend for a name ("auto" looks at jax.default_backend(); on CPU, "cpu"
    where the C++ library builds, else "reference")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    if platform in ("gpu", "tpu"):
        return platform
    return "cpu" if library() is not None else "reference"


def _layer_of(kv_pages, layer):
    """The layer to read: required with 5-D pages [L, K, P, S, 2D], None with 4-D ones."""
    if kv_pages.ndim == 5:
        if layer is None:
            raise ValueError("layer is required with 5-D pages [L, K, P, S, 2D]")
        return layer
    return None


def _scales(kv_pages, kv_scales) -> dict:
    """``kv_scales`` as a keyword for the backend: given exactly when the pages are quantized."""
    if is_quantized(kv_pages.dtype) != (kv_scales is not None):
        raise ValueError(f"kv_scales: {kv_pages.dtype} pages need scales, and only quantized "
                         f"(int8, float8_e4m3fn) pages take them; got "
                         f"{None if kv_scales is None else kv_scales.shape}")
    if kv_scales is None:
        return {}
    want = scale_rows_shape(kv_pages.shape)
    if tuple(kv_scales.shape) != want or kv_scales.dtype != jnp.int32:
        raise ValueError(f"kv_scales: expected i32{list(want)} (a word per page slot, "
                         f"{pages_per_scale_row(kv_pages.shape[-2])} pages per row; quant.py), "
                         f"got {kv_scales.dtype}{list(kv_scales.shape)}")
    return {"kv_scales": kv_scales}


def _mode(backend: str, interpret: bool):
    if interpret and backend == "tpu":
        return pltpu.force_tpu_interpret_mode()
    return contextlib.nullcontext()


def ragged_paged_attention(
    q,  # [T, H, D]  new-token queries of all sequences, concatenated
    kv_pages,  # [K, P, S, 2D] or [L, K, P, S, 2D]: keys in [..., :D], values in [..., D:]
    page_table,  # i32[B, W]
    kv_lens,  # i32[B]  cached tokens per sequence, including the new ones
    cu_q_lens,  # i32[B + 1]  offsets of each sequence's queries in q
    num_seqs,  # i32[]  sequences in use; rows past it are padding
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,
    kv_scales=None,  # i32 quant.scale_rows_shape(kv_pages.shape): scales of quantized pages
    backend: str = "auto",
    interpret: bool = False,
    max_q_len: int | None = None,  # unused: no attention path takes the longest row as a shape
    **tuning,
):
    """Ragged causal attention over paged K/V -> [T, H, D] (see reference.py for semantics)."""
    backend = resolve_backend(backend)
    if backend == "cpu":  # the CPU kernel is decode-only
        backend = "reference"
    common = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                  **_scales(kv_pages, kv_scales))
    if backend == "reference":
        return ragged_paged_attention_reference(q, kv_pages, page_table, kv_lens, cu_q_lens,
                                                num_seqs, layer=_layer_of(kv_pages, layer),
                                                **common)
    with _mode(backend, interpret):
        if backend == "gpu":
            return ragged_paged_attention_gpu(q, kv_pages, page_table, kv_lens, cu_q_lens,
                                              num_seqs, layer=layer, interpret=interpret,
                                              **common, **tuning)
        return ragged_paged_attention_tpu(q, kv_pages, page_table, kv_lens, cu_q_lens,
                                          num_seqs, layer=layer, **common, **tuning)


def paged_decode_attention(
    q,  # [B, H, D]  one new token per sequence
    kv_pages,  # [K, P, S, 2D] or [L, K, P, S, 2D]
    page_table,  # i32[B, W]
    lengths,  # i32[B]  cached tokens including the new one; 0 marks a padding row
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,
    kv_scales=None,  # i32 quant.scale_rows_shape(kv_pages.shape): scales of quantized pages
    backend: str = "auto",
    interpret: bool = False,
    **tuning,
):
    """Decode attention (one query per sequence) over paged K/V -> [B, H, D]."""
    backend = resolve_backend(backend)
    common = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                  **_scales(kv_pages, kv_scales))
    if backend == "cpu":
        if cpu_supports(kv_pages):
            return paged_decode_attention_cpu(q, kv_pages, page_table, lengths, layer=layer,
                                              **common)
        backend = "reference"  # e.g. fp8 pages
    if backend == "reference":
        return paged_decode_attention_reference(q, kv_pages, page_table, lengths,
                                                layer=_layer_of(kv_pages, layer), **common)
    with _mode(backend, interpret):
        if backend == "gpu":
            return paged_decode_attention_gpu(q, kv_pages, page_table, lengths, layer=layer,
                                              interpret=interpret, **common, **tuning)
        return paged_decode_attention_tpu(q, kv_pages, page_table, lengths, layer=layer,
                                          **common, **tuning)
