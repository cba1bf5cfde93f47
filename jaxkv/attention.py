"""Attention backend dispatch for the paged runtime.

``attention_impl``:
  "auto"           the Pallas kernel on GPU (Triton) or TPU (Mosaic), the jnp reference on CPU;
  "reference"      the pure-jnp oracle everywhere;
  "pallas"         the kernel for the current platform (an error on CPU);
  "interpret"      the GPU-style kernel in Pallas interpret mode (runs on CPU);
  "interpret-tpu"  the TPU kernel in TPU interpret mode (runs on CPU);
  "pallas-gpu" / "pallas-tpu"  that platform's kernel whatever the default backend: for
                   compiling ahead of time for a chip this process does not run on.
The runtime passes all layers' pages with a layer index, so kernels read one layer's pages in
place instead of receiving a copied slice of the pool. Kernels take the window as a static
argument; `windowed_attention` picks a layer's window when layers differ (Gemma 2/3).
"""

from __future__ import annotations

import jax

from jaxkv.config import ATTENTION_IMPLS
from jaxkv.config_checks import power_of_two
from pallas_kernels.api import paged_decode_attention, ragged_paged_attention
from pallas_kernels.reference import dense_causal_attention
from pallas_kernels.tpu_block_sizes import sublane_tile


def check_attention_impl(impl: str) -> str:
    """Validates an ``attention_impl`` name and returns it."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "pallas" and jax.default_backend() not in ("gpu", "tpu"):
        raise ValueError(f"attention_impl='pallas' needs a GPU or TPU, not "
                         f"{jax.default_backend()!r}; use 'interpret' to run kernels on CPU")
    return impl


def kernel_for(impl: str) -> str:
    """Which code computes attention for ``impl`` here: "tpu", "gpu" or "reference"."""
    check_attention_impl(impl)
    if impl in ("auto", "pallas"):
        platform = jax.default_backend()
        return platform if platform in ("gpu", "tpu") else "reference"
    return {"reference": "reference", "interpret": "gpu", "interpret-tpu": "tpu",
            "pallas-gpu": "gpu", "pallas-tpu": "tpu"}[impl]


def check_page_size(impl: str, page_size: int, dtype) -> None:
    """Raises ValueError if the kernel ``impl`` selects cannot take pages of ``page_size``
    tokens of ``dtype``: every kernel needs a power of two; the TPU kernel also needs a
    multiple of the sublane tile (8 rows of 32-bit data, 16 of 16-bit) for aligned page DMAs."""
    power_of_two("page_size", page_size)
    if kernel_for(impl) == "tpu" and page_size % sublane_tile(dtype):
        raise ValueError(f"page_size={page_size}: the TPU kernel (attention_impl={impl!r}) "
                         f"needs a multiple of {sublane_tile(dtype)} for {jax.numpy.dtype(dtype)} "
                         "pages")


def check_head_dim(impl: str, head_dim: int) -> None:
    """Raises ValueError if the kernel ``impl`` selects cannot take ``head_dim``: the GPU
    (Triton) kernels need a power of two >= 16 (Phi-3's 96 is not); the TPU and CPU kernels
    and the reference take any."""
    if kernel_for(impl) == "gpu" and (head_dim < 16 or head_dim & (head_dim - 1)):
        raise ValueError(f"head_dim={head_dim}: the GPU attention kernel (attention_impl="
                         f"{impl!r}) needs a power of two >= 16; attention_impl='reference' "
                         "runs this model on GPU with the pure-jnp attention (slower)")


def _backend(impl: str) -> tuple[str, bool]:
    """(pallas_kernels backend, interpret) for an attention_impl."""
    return {"auto": ("auto", False), "reference": ("reference", False),
            "pallas": ("auto", False), "interpret": ("gpu", True),
            "interpret-tpu": ("tpu", True), "pallas-gpu": ("gpu", False),
            "pallas-tpu": ("tpu", False)}[impl]


def paged_attention(q, kv_pages, layer, page_table, kv_lens, cu_q_lens, num_seqs, *,
                    decode: bool, sm_scale, soft_cap=None, sliding_window=None, impl="auto",
                    kv_scales=None):
    """[T, H, D] attention of a step's tokens over layer `layer` of [L, K, P, S, 2D] pages
    (quantized pages with their ``kv_scales`` i32[L, K, P, S]).

    ``decode`` (static): one token per row, rows aligned with tokens; uses the decode kernel.
    """
    backend, interpret = _backend(check_attention_impl(impl))
    common = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                  layer=layer,
                  backend=backend, interpret=interpret, kv_scales=kv_scales)
    if decode:  # padding rows have kv_len 0, which the decode kernels treat as empty
        b = page_table.shape[0]
        return paged_decode_attention(q[:b], kv_pages, page_table, kv_lens, **common)
    return ragged_paged_attention(q, kv_pages, page_table, kv_lens, cu_q_lens, num_seqs,
                                  **common)


def windowed_attention(read, windows, layer):
    """``read(window)`` with layer ``layer``'s window from ``windows`` (one per layer). A
    Python int layer (unrolled layers) picks it statically; a traced one (a scan over layers)
    switches among the distinct windows, so each branch is a kernel with a static window and
    only the layer's own branch runs."""
    distinct = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if len(distinct) == 1:
        return read(distinct[0])
    if isinstance(layer, int):
        return read(windows[layer])
    which = jax.numpy.asarray([distinct.index(w) for w in windows], jax.numpy.int32)[layer]
    return jax.lax.switch(which, [lambda w=w: read(w) for w in distinct])


def dense_attention(config):
    """The model's ``attention(layer, q, k, v, carry)`` over one sequence with dense causal
    attention and no pages (oracles, perplexity): each layer's window, the model's scale and
    soft cap; the carry passes through."""
    def attention(layer, q, k, v, carry):
        def read(window):
            return dense_causal_attention(q[None], k[None], v[None], sm_scale=config.sm_scale,
                                          soft_cap=config.attn_softcap,
                                          sliding_window=window)[0]
        return windowed_attention(read, config.windows, layer), carry
    return attention
