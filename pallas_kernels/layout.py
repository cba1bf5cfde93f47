"""The page layout every kernel reads: K and V of a kv head side by side in one array.

Axes: L layers, K kv heads, P pages, S page_size, D head_dim.

``kv_pages`` is ``[K, P, S, 2D]`` (or ``[L, K, P, S, 2D]``): slot s of page p holds the key of
kv head k in ``[..., :D]`` and its value in ``[..., D:]``.

Why not two ``[..., S, D]`` pools: XLA:TPU tiles the two minor dims of an array in (8, 128)
tiles. With D = 64 (Llama-3.2-1B/3B, SmolLM2, Qwen2.5-0.5B, ...) a ``[..., S, 64]`` row-major
array would pad every row to 128 lanes, so XLA stores it with the page axis minor instead; a
Pallas kernel needs row-major operands, and XLA then copied both whole pools (padded: 2x each)
on every kernel call. Packed, a head-64 page row is exactly 128 lanes: XLA keeps the array
row-major, the kernel reads it in place, and one DMA (one gather on GPU) moves K and V of a
page together. The same layout serves D = 128 (256 lanes), so there is one state layout for
every model, every backend and the pure-jnp reference. tpu-inference's head_dim-64 TPU kernel
(ragged paged attention v3, ``kernel_hd64.py``) also concatenates K and V along head_dim, in a
page-major ``[P, S, K, 2D]`` cache; here kv heads stay outer (``[K, P, S, 2D]`` per layer), so
a page of one kv head is one contiguous ``[S, 2D]`` slab and pages shard by kv head.
"""

from __future__ import annotations

import jax.numpy as jnp


def pack_kv(k_pages, v_pages):
    """``[..., S, D]`` keys and values -> ``[..., S, 2D]`` packed pages (a copy)."""
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.dtype}{list(k_pages.shape)} and v_pages "
                         f"{v_pages.dtype}{list(v_pages.shape)} must match")
    return jnp.concatenate([k_pages, v_pages], axis=-1)


def split_kv(kv_pages):
    """Packed ``[..., S, 2D]`` pages -> (keys, values), each ``[..., S, D]``."""
    d2 = kv_pages.shape[-1]
    if d2 % 2:
        raise ValueError(f"kv_pages last dim must be 2 * head_dim, got {d2}")
    return kv_pages[..., : d2 // 2], kv_pages[..., d2 // 2:]
