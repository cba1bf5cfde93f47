"""Copying whole KV pages on device: prefix reuse of a partly matched page, copy-on-write.

Axes: L layers, K kv heads, P pages, S page_size, D head_dim, N copies (pages are [L, K, P, S, 2D]).
Quantized pages move with their scales: a page is its values and its S scale words, which sit
in row ``p // G`` of the scale array at columns ``p % G * S ...`` (``pallas_kernels.quant``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.kv import PagedKVState
from pallas_kernels.quant import NAN_SCALES, pages_per_scale_row


def _scale_slots(state: PagedKVState, pages):
    """Index arrays (rows [N, 1], columns [N, S]) of the scale words of pages ``pages``."""
    s = state.page_size
    g = pages_per_scale_row(s)
    rows = jnp.where(pages < state.num_pages, pages // g, state.kv_scales.shape[2])  # >= P: out
    return rows[:, None], (pages % g * s)[:, None] + jnp.arange(s)


def _get_scales(state: PagedKVState, pages):
    """Scale words of ``pages`` (>= P: zeros): i32[L, K, N, S]."""
    rows, cols = _scale_slots(state, pages)
    return state.kv_scales.at[:, :, rows, cols].get(mode="fill", fill_value=0)


def _set_scales(state: PagedKVState, pages, words):
    """The scale array with ``words`` ([L, K, N, S] or a scalar) at ``pages`` (>= P: dropped)."""
    rows, cols = _scale_slots(state, pages)
    return state.kv_scales.at[:, :, rows, cols].set(words, mode="drop")


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_pages(state: PagedKVState, src, dst) -> PagedKVState:
    """Copies page ``src[i]`` to page ``dst[i]`` in every layer and kv head (i32[N] each).

    All sources are read before any destination is written. A destination >= P is dropped
    (padding); destinations must be distinct. The state is donated: pages update in place.
    """
    moved = jnp.moveaxis(_read_pages(state.kv_pages, src), 0, 2)
    kv_pages = state.kv_pages.at[:, :, dst].set(moved, mode="drop")
    scales = None if state.kv_scales is None else _set_scales(state, dst,
                                                              _get_scales(state, src))
    return state.replace(kv_pages=kv_pages, kv_scales=scales)


@functools.partial(jax.jit, donate_argnums=(0,))
def fill_pages(state: PagedKVState, pages, value) -> PagedKVState:
    """Sets every entry of pages ``pages`` (i32[N]; >= P is dropped) to ``value``: the debug
    option that poisons freed pages with NaN, to prove they are never read. Quantized pages,
    whose values cannot hold NaN, get zero values and NaN scales instead (a NaN ``value``)."""
    def fill(pages_lkp, v):
        return pages_lkp.at[:, :, pages].set(jnp.asarray(v, pages_lkp.dtype), mode="drop")

    if state.kv_scales is None:
        return state.replace(kv_pages=fill(state.kv_pages, value))
    word = jnp.where(jnp.isnan(value), jnp.int32(NAN_SCALES), jnp.int32(0))
    return state.replace(kv_pages=fill(state.kv_pages, 0),
                         kv_scales=_set_scales(state, pages, word))


def fill_pages_padded(state: PagedKVState, pages, value, chunk: int = 64) -> PagedKVState:
    """`fill_pages` in calls of exactly ``chunk`` ids (one program whatever the count)."""
    pages = list(pages)
    for at in range(0, len(pages), chunk):
        ids = np.full(chunk, state.num_pages, np.int32)
        part = pages[at:at + chunk]
        ids[:len(part)] = part
        state = fill_pages(state, ids, value)
    return state


def padded_parts(items, sizes):
    """``items`` in parts, each with the size of the program that runs it: the smallest of
    ``sizes`` that holds what is left, else the largest (so few programs compile)."""
    items = list(items)
    while items:
        n = next((k for k in sizes if k >= len(items)), sizes[-1])
        yield items[:n], n
        items = items[n:]


def copy_pages_padded(state: PagedKVState, pairs, sizes=(8, 64)) -> PagedKVState:
    """`copy_pages` of (src, dst) pairs, padded to the smallest of ``sizes`` that holds them
    (in several calls of the largest when none does), so few programs compile."""
    for part, n in padded_parts(pairs, sizes):
        src = np.zeros(n, np.int32)
        dst = np.full(n, state.num_pages, np.int32)  # out of range: dropped
        for i, (s, d) in enumerate(part):
            src[i], dst[i] = s, d
        state = copy_pages(state, src, dst)
    return state


def _read_pages(kv_pages, pages):
    """Pages ``pages`` of ``kv_pages`` (i32[N]; >= P gives zeros), page-major: [N, L, K, S, 2D].

    One page at a time (a loop of dynamic slices along the page axis): compiled for TPU, a
    gather ``kv_pages[:, :, pages]`` made XLA relay the whole pool out at head_dim 128 (1 GiB of
    temporaries for a 1 GiB bf16 pool, `make test-aot`); the loop reads in place."""
    L, K, P, S, D2 = kv_pages.shape

    def one(i, out):
        page = lax.dynamic_slice(kv_pages, (0, 0, jnp.minimum(pages[i], P - 1), 0, 0),
                                 (L, K, 1, S, D2))
        page = jnp.where(pages[i] < P, page, jnp.zeros_like(page))
        return lax.dynamic_update_slice(out, page.reshape(1, L, K, S, D2), (i, 0, 0, 0, 0))

    return lax.fori_loop(0, pages.shape[0], one,
                         jnp.zeros((pages.shape[0], L, K, S, D2), kv_pages.dtype))


@jax.jit
def gather_pages(state: PagedKVState, pages):
    """The contents of pages ``pages`` (i32[N]; >= P gives zeros), page-major for a host pool
    or a transfer: (values [N, L, K, S, 2D], scale words i32[N, L, K, S] or None). Not donated:
    it only reads."""
    scales = None if state.kv_scales is None else jnp.moveaxis(_get_scales(state, pages), 2, 0)
    return _read_pages(state.kv_pages, pages), scales


@functools.partial(jax.jit, donate_argnums=(0,))
def load_pages(state: PagedKVState, pages, values, scales) -> PagedKVState:
    """Writes page-major ``values`` [N, L, K, S, 2D] (and ``scales`` [N, L, K, S] for quantized
    pages) into pages ``pages`` (i32[N]; >= P is dropped): a host pool's pages coming back."""
    kv_pages = state.kv_pages.at[:, :, pages].set(
        jnp.moveaxis(values, 0, 2).astype(state.kv_pages.dtype), mode="drop")
    kv_scales = None if state.kv_scales is None else _set_scales(
        state, pages, jnp.moveaxis(scales, 0, 2))
    return state.replace(kv_pages=kv_pages, kv_scales=kv_scales)
