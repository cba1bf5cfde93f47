"""Attention backend dispatch for the paged runtime.

``attention_impl``: "auto" (the Pallas kernel for the platform when one exists, else the
pure-jnp reference), "reference" (always the jnp oracle). The Pallas backends ("pallas",
"interpret") are added with the kernels themselves.
"""

from __future__ import annotations

from pallas_kernels.reference import ragged_paged_attention_reference

ATTENTION_IMPLS = ("auto", "reference")


def check_attention_impl(impl: str) -> str:
    """Validates an ``attention_impl`` name and returns it."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    return impl


def ragged_paged_attention(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, max_q_len=None, impl="auto"):
    """[T, H, D] attention of a ragged token batch over one layer's pages ([K, P, S, D])."""
    check_attention_impl(impl)
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, max_q_len=max_q_len,
    )
