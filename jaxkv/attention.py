"""Attention backend dispatch for the paged runtime.

``attention_impl``:
  "auto"           the Pallas kernel on GPU (Triton) or TPU (Mosaic), the jnp reference on CPU;
  "reference"      the pure-jnp oracle everywhere;
  "pallas"         the kernel for the current platform (an error on CPU);
  "interpret"      the GPU-style kernel in Pallas interpret mode (runs on CPU);
  "interpret-tpu"  the TPU kernel in TPU interpret mode (runs on CPU).
The runtime passes all layers' pages with a layer index, so kernels read one layer's pages in
place instead of receiving a copied slice of the pool.
"""

from __future__ import annotations

import jax

from pallas_kernels.api import paged_decode_attention, ragged_paged_attention

ATTENTION_IMPLS = ("auto", "reference", "pallas", "interpret", "interpret-tpu")


def check_attention_impl(impl: str) -> str:
    """Validates an ``attention_impl`` name and returns it."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "pallas" and jax.default_backend() not in ("gpu", "tpu"):
        raise ValueError(f"attention_impl='pallas' needs a GPU or TPU, not "
                         f"{jax.default_backend()!r}; use 'interpret' to run kernels on CPU")
    return impl


def _backend(impl: str) -> tuple[str, bool]:
    """(pallas_kernels backend, interpret) for an attention_impl."""
    return {"auto": ("auto", False), "reference": ("reference", False),
            "pallas": ("auto", False), "interpret": ("gpu", True),
            "interpret-tpu": ("tpu", True)}[impl]


def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, cu_q_lens, num_seqs, *,
                    decode: bool, sm_scale, sliding_window=None, max_q_len=None, impl="auto"):
    """[T, H, D] attention of a step's tokens over layer `layer` of [L, K, P, S, D] pages.

    ``decode`` (static): one token per row, rows aligned with tokens; uses the decode kernel.
    """
    backend, interpret = _backend(check_attention_impl(impl))
    common = dict(sm_scale=sm_scale, sliding_window=sliding_window, layer=layer,
                  backend=backend, interpret=interpret)
    if decode:  # padding rows have kv_len 0, which the decode kernels treat as empty
        b = page_table.shape[0]
        return paged_decode_attention(q[:b], k_pages, v_pages, page_table, kv_lens, **common)
    return ragged_paged_attention(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs,
                                  max_q_len=max_q_len, **common)
