"""Copying whole KV pages on device: prefix reuse of a partly matched page, copy-on-write.

Axes: L layers, K kv heads, P pages, S page_size, D head_dim, N copies (pages are [L, K, P, S, 2D]).
Quantized pages move with their scales: a page is its values and its S scale words, which sit
in row ``p // G`` of the scale array at columns ``p % G * S ...`` (``pallas_kernels.quant``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.kv import PagedKVState
from jaxkv.runtime.stored_jit import stored_jit
from pallas_kernels.quant import NAN_SCALES, pages_per_scale_row


def _scale_slots(kv_pages, kv_scales, pages):
    """Index arrays (rows [N, 1], columns [N, S]) of the scale words of pages ``pages``."""
    s = kv_pages.shape[3]
    g = pages_per_scale_row(s)
    rows = jnp.where(pages < kv_pages.shape[2], pages // g, kv_scales.shape[2])  # >= P: out
    return rows[:, None], (pages % g * s)[:, None] + jnp.arange(s)


def _get_scales(state: PagedKVState, pages, window: bool = False):
    """Scale words of ``pages`` (>= P: zeros): i32[L, K, N, S]."""
    kv, scales = _pool(state, window)
    rows, cols = _scale_slots(kv, scales, pages)
    return scales.at[:, :, rows, cols].get(mode="fill", fill_value=0)


def _set_scales(state: PagedKVState, pages, words, window: bool = False):
    """The scale array with ``words`` ([L, K, N, S] or a scalar) at ``pages`` (>= P: dropped)."""
    kv, scales = _pool(state, window)
    rows, cols = _scale_slots(kv, scales, pages)
    return scales.at[:, :, rows, cols].set(words, mode="drop")


def _pool(state: PagedKVState, window: bool):
    return (state.window_pages, state.window_scales) if window else \
        (state.kv_pages, state.kv_scales)


def _copy(state: PagedKVState, src, dst, window: bool):
    """(pages, scales) of one pool with ``src[i]`` copied to ``dst[i]``."""
    kv, scales = _pool(state, window)
    moved = jnp.moveaxis(_read_pages(kv, src), 0, 2)
    kv = kv.at[:, :, dst].set(moved, mode="drop")
    if scales is not None:
        scales = _set_scales(state, dst, _get_scales(state, src, window), window)
    return kv, scales


@functools.partial(stored_jit, donate_argnums=(0,))
def copy_pages(state: PagedKVState, src, dst, window_src=None, window_dst=None
               ) -> PagedKVState:
    """Copies page ``src[i]`` to page ``dst[i]`` in every layer and kv head (i32[N] each),
    and (window-only KV) slot ``window_src[i]`` to ``window_dst[i]`` of the local layers.

    All sources are read before any destination is written. A destination >= P is dropped
    (padding); destinations must be distinct. The state is donated: pages update in place.
    """
    kv_pages, kv_scales = _copy(state, src, dst, False)
    state = state.replace(kv_pages=kv_pages, kv_scales=kv_scales)
    if window_src is None:
        return state
    window_pages, window_scales = _copy(state, window_src, window_dst, True)
    return state.replace(window_pages=window_pages, window_scales=window_scales)


@functools.partial(stored_jit, donate_argnums=(0,))
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


def copy_pages_padded(state: PagedKVState, pairs, sizes=(8, 64), window_pairs=()
                      ) -> PagedKVState:
    """`copy_pages` of (src, dst) pairs (and, window-only KV, the local layers' slot pairs,
    which the host plans with them: at most as many), padded to the smallest of ``sizes``
    that holds them (in several calls of the largest when none does), so few programs
    compile."""
    pairs, window_pairs = list(pairs), list(window_pairs)
    if len(window_pairs) > len(pairs):
        raise ValueError(f"copy_pages_padded: {len(window_pairs)} window copies for "
                         f"{len(pairs)} page copies")
    at = 0
    for part, n in padded_parts(pairs, sizes):
        src, dst = _padded(part, n, state.num_pages)
        if state.windowed:
            wsrc, wdst = _padded(window_pairs[at:at + len(part)], n,
                                 state.window_pages.shape[2])
            state = copy_pages(state, src, dst, wsrc, wdst)
        else:
            state = copy_pages(state, src, dst)
        at += len(part)
    return state


def _padded(pairs, n: int, out_of_range: int):
    """(src, dst) i32[n] each; padding copies page 0 to an out-of-range page (dropped)."""
    src, dst = np.zeros(n, np.int32), np.full(n, out_of_range, np.int32)
    for i, (s, d) in enumerate(pairs):
        src[i], dst[i] = s, d
    return src, dst


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


@stored_jit
def gather_pages(state: PagedKVState, pages):
    """The contents of pages ``pages`` (i32[N]; >= P gives zeros), page-major for a host pool
    or a transfer: (values [N, L, K, S, 2D], scale words i32[N, L, K, S] or None). Not donated:
    it only reads. (Full-attention layers only: window-only KV goes with neither.)"""
    scales = None if state.kv_scales is None else jnp.moveaxis(_get_scales(state, pages), 2, 0)
    return _read_pages(state.kv_pages, pages), scales


@functools.partial(stored_jit, donate_argnums=(0,))
def load_pages(state: PagedKVState, pages, values, scales) -> PagedKVState:
    """Writes page-major ``values`` [N, L, K, S, 2D] (and ``scales`` [N, L, K, S] for quantized
    pages) into pages ``pages`` (i32[N]; >= P is dropped): a host pool's pages coming back."""
    kv_pages = state.kv_pages.at[:, :, pages].set(
        jnp.moveaxis(values, 0, 2).astype(state.kv_pages.dtype), mode="drop")
    kv_scales = None if state.kv_scales is None else _set_scales(
        state, pages, jnp.moveaxis(scales, 0, 2))
    return state.replace(kv_pages=kv_pages, kv_scales=kv_scales)
