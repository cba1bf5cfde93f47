"""Copying whole KV pages on device: prefix reuse of a partly matched page, copy-on-write.

Axes: L layers, K kv heads, P pages, S page_size, D head_dim, N copies (pages are [L, K, P, S, 2D]).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kv import PagedKVState


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_pages(state: PagedKVState, src, dst) -> PagedKVState:
    """Copies page ``src[i]`` to page ``dst[i]`` in every layer and kv head (i32[N] each).

    All sources are read before any destination is written. A destination >= P is dropped
    (padding); destinations must be distinct. The state is donated: pages update in place.
    """
    def copy(pages_lkpsd):
        moved = pages_lkpsd.at[:, :, src].get(mode="fill", fill_value=0)
        return pages_lkpsd.at[:, :, dst].set(moved, mode="drop")

    return state.replace(kv_pages=copy(state.kv_pages))


@functools.partial(jax.jit, donate_argnums=(0,))
def fill_pages(state: PagedKVState, pages, value) -> PagedKVState:
    """Sets every entry of pages ``pages`` (i32[N]; >= P is dropped) to ``value``: the debug
    option that poisons freed pages with NaN, to prove they are never read."""
    def fill(pages_lkpsd):
        return pages_lkpsd.at[:, :, pages].set(jnp.asarray(value, pages_lkpsd.dtype), mode="drop")

    return state.replace(kv_pages=fill(state.kv_pages))


def fill_pages_padded(state: PagedKVState, pages, value, chunk: int = 64) -> PagedKVState:
    """`fill_pages` in calls of exactly ``chunk`` ids (one program whatever the count)."""
    pages = list(pages)
    for at in range(0, len(pages), chunk):
        ids = np.full(chunk, state.num_pages, np.int32)
        part = pages[at:at + chunk]
        ids[:len(part)] = part
        state = fill_pages(state, ids, value)
    return state


def copy_pages_padded(state: PagedKVState, pairs, sizes=(8, 64)) -> PagedKVState:
    """`copy_pages` of (src, dst) pairs, padded to the smallest of ``sizes`` that holds them
    (in several calls of the largest when none does), so few programs compile."""
    pairs = list(pairs)
    while pairs:
        n = next((k for k in sizes if k >= len(pairs)), sizes[-1])
        part, pairs = pairs[:n], pairs[n:]
        src = np.zeros(n, np.int32)
        dst = np.full(n, state.num_pages, np.int32)  # out of range: dropped
        for i, (s, d) in enumerate(part):
            src[i], dst[i] = s, d
        state = copy_pages(state, src, dst)
    return state
