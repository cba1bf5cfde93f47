"""Paged-attention kernels for jaxkv and their pure-jnp references.

This package imports only jax: it knows nothing of jaxkv's model or engine. Pages hold K and V
side by side, per layer ``[kv_heads, num_pages, page_size, 2 * head_dim]`` (see ``layout``).

- ``ragged_paged_attention`` / ``paged_decode_attention``: dispatch to the kernel for a backend
  ("auto", "gpu", "tpu", "reference"), optionally in Pallas interpret mode;
- ``*_gpu`` (Pallas, Triton lowering), ``*_tpu`` (Pallas, Mosaic) and ``*_reference`` (jnp):
  the implementations, with identical semantics;
- ``pack_kv`` / ``split_kv``: between separate K and V pages and the packed layout.
"""

from pallas_kernels.api import BACKENDS, paged_decode_attention, ragged_paged_attention
from pallas_kernels.gpu_paged_attention import (
    paged_decode_attention_gpu,
    ragged_paged_attention_gpu,
)
from pallas_kernels.layout import pack_kv, split_kv
from pallas_kernels.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)
from pallas_kernels.tpu_ragged_paged_attention import (
    paged_decode_attention_tpu,
    ragged_paged_attention_tpu,
)

__all__ = [
    "BACKENDS",
    "pack_kv",
    "paged_decode_attention",
    "paged_decode_attention_gpu",
    "paged_decode_attention_reference",
    "paged_decode_attention_tpu",
    "ragged_paged_attention",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "split_kv",
]
