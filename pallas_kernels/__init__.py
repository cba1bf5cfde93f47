"""Paged-attention kernels for jaxkv and their pure-jnp references.

This package imports only jax: it knows nothing of jaxkv's model or engine. Pages are laid
out per layer as ``[kv_heads, num_pages, page_size, head_dim]``.
"""

from pallas_kernels.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)

__all__ = ["paged_decode_attention_reference", "ragged_paged_attention_reference"]
