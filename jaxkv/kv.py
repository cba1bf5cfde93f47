"""The device KV state: an immutable pytree of KV pages.

Axes: L layers, K kv heads, P pages, S page_size, D head_dim, T tokens of a step.

Pages hold keys and values side by side, ``kv_pages[..., :D]`` and ``kv_pages[..., D:]``: one
array the kernels read in place on every backend (``pallas_kernels.layout`` says why).
Quantized pages (``kv_cache_dtype`` "int8" or "fp8_e4m3") add ``kv_scales``, a key and a value
scale per token and kv head (``pallas_kernels.quant``), written by the step with the values.
They hold keys rotated (``k R``, `pallas_kernels.quant.rotate`), which spreads keys' outlier
channels over the whole head before the per-token scale is taken; attention over them takes
`rotate_queries` (``(q R) . (k R) = q . k``). R depends on head_dim alone, so the pages mean the
same under any weights (`update_params`) and in any process that reads them.

With window-only KV (`jaxkv.cache.window`) the local (sliding-window) layers keep their pages in
a pool of their own, ``window_pages`` [L_local, K, Q + 1, S, 2D]: Q slots, far fewer than P,
and a last zero slot that table entries no query reads point at. ``kv_pages`` then holds the
full-attention layers only (`pool_layers` says which layer is where).

The host decides *which* pages a slot owns; the device holds *what* is in them. Transitions are
pure (`state.replace(...)`) and jitted with the state donated, so XLA updates pages in place.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.config import KVSpec
from jaxkv.config_checks import power_of_two
from jaxkv.errors import KVStateError
from jaxkv.model.config import ModelConfig
from pallas_kernels.quant import (
    SCALE_DTYPE,
    is_quantized,
    pages_per_scale_row,
    quantize_kv,
    rotate,
    scale_rows_shape,
    storage_dtype,
)


def _check(field: str, fn, *args) -> None:
    try:
        fn(*args)
    except AssertionError as e:
        raise KVStateError(f"PagedKVState.{field}: {e}") from None


@struct.dataclass
class PagedKVState:
    """The KV pages of every sequence, and nothing else on device.

    ``kv_pages`` [L, K, P, S, 2D]: slot s of page p of kv head k in layer l holds one token's
    key in ``[..., :D]`` and value in ``[..., D:]``, in the compute dtype, or quantized (int8,
    float8_e4m3fn) with ``kv_scales`` i32[L, K, ceil(P / G), G * S] (G = 128 // S pages per
    row; ``pallas_kernels.quant``): a word per slot holding its key scale (bfloat16, high 16
    bits) and value scale (low 16 bits), so ``key = kv_pages[..., :D] * key_scale``. Which
    pages belong to which sequence, and how many tokens each holds, is host bookkeeping
    (allocator, scheduler) sent with every step in its `StepBatch`: the state has no page table.
    """

    kv_pages: jax.Array  # [L, K, P, S, 2D]  keys in [..., :D], values in [..., D:]
    kv_scales: jax.Array | None = None  # i32[L, K, P / G, G * S]  quantized pages only
    window_pages: jax.Array | None = None  # [L_local, K, Q + 1, S, 2D]  window-only KV
    window_scales: jax.Array | None = None  # its scales, like kv_scales

    def __post_init__(self):
        # jax rebuilds pytrees with placeholder leaves (tracing, vmap axes); check real arrays only.
        if hasattr(self.kv_pages, "shape") and hasattr(self.kv_pages, "dtype"):
            self.validate()

    def validate(self) -> None:
        """Raises KVStateError naming the field if its rank or last axis is wrong."""
        _validate_pool("kv", self.kv_pages, self.kv_scales)
        if self.window_pages is not None:
            _validate_pool("window", self.window_pages, self.window_scales)
            if self.window_pages.dtype != self.kv_pages.dtype:
                raise KVStateError(f"PagedKVState.window_pages: dtype {self.window_pages.dtype}"
                                   f" differs from kv_pages' {self.kv_pages.dtype}")
        elif self.window_scales is not None:
            raise KVStateError("PagedKVState.window_scales: given without window_pages")

    def validate_for(self, config: ModelConfig) -> None:
        """Checks that this state can hold the KV of `config`'s model."""
        full, local = pool_sizes(config, self.windowed)
        want = (full, config.num_kv_heads, self.num_pages, self.page_size, 2 * config.head_dim)
        _check("kv_pages", chex.assert_shape, self.kv_pages, want)
        if self.windowed:
            want = (local, config.num_kv_heads, self.window_pages.shape[2], self.page_size,
                    2 * config.head_dim)
            _check("window_pages", chex.assert_shape, self.window_pages, want)

    num_layers = property(lambda self: self.kv_pages.shape[0])
    num_kv_heads = property(lambda self: self.kv_pages.shape[1])
    num_pages = property(lambda self: self.kv_pages.shape[2])
    page_size = property(lambda self: self.kv_pages.shape[3])
    head_dim = property(lambda self: self.kv_pages.shape[4] // 2)
    quantized = property(lambda self: self.kv_scales is not None)
    windowed = property(lambda self: self.window_pages is not None)


def _validate_pool(name: str, kv, sc) -> None:
    """Raises KVStateError if the pool ``name`` (kv, window) has a wrong rank, last axis or
    scales."""
    if is_quantized(kv.dtype) != (sc is not None):
        raise KVStateError(f"PagedKVState.{name}_scales: {kv.dtype} pages "
                           + ("need scales" if sc is None else "take no scales"))
    if sc is not None and (tuple(sc.shape) != scale_rows_shape(kv.shape)
                           or sc.dtype != SCALE_DTYPE):
        raise KVStateError(f"PagedKVState.{name}_scales: expected i32"
                           f"{list(scale_rows_shape(kv.shape))}, got {sc.dtype}"
                           f"{list(sc.shape)}")
    if len(kv.shape) == 5 and kv.shape[4] % 2 == 0:  # the per-step fast path
        return
    _check(f"{name}_pages", chex.assert_rank, kv, 5)
    raise KVStateError(f"PagedKVState.{name}_pages: last dim must be 2 * head_dim (keys, "
                       f"then values), got {kv.shape[4]}")


def pool_sizes(config: ModelConfig, windowed: bool) -> tuple[int, int]:
    """(layers in ``kv_pages``, layers in ``window_pages``)."""
    local = config.num_local_layers if windowed else 0
    return config.num_layers - local, local


def pool_layers(config: ModelConfig, windowed: bool) -> tuple[tuple[str, int], ...]:
    """Where each layer's KV lives: ("kv", i) is layer i of ``kv_pages``, ("window", i) of
    ``window_pages`` (window-only KV: the local layers, in order)."""
    out, counts = [], {"kv": 0, "window": 0}
    for layer in range(config.num_layers):
        pool = "window" if windowed and config.is_sliding(layer) else "kv"
        out.append((pool, counts[pool]))
        counts[pool] += 1
    return tuple(out)


def kv_spec(config: ModelConfig, dtype) -> KVSpec:
    """The KV bytes of ``config``'s tokens in pages of ``dtype`` (storage dtype)."""
    scale = jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(dtype) else 0
    return KVSpec(config.num_layers, config.num_kv_heads, config.head_dim,
                  jnp.dtype(dtype).itemsize, scale)


def kv_specs(config: ModelConfig, dtype, windowed: bool) -> tuple[KVSpec, KVSpec]:
    """(full-attention layers, local layers) KV specs in pages of ``dtype``: with window-only
    KV the local layers are a pool of their own; without, the first holds every layer."""
    full, local = pool_sizes(config, windowed)
    spec = kv_spec(config, dtype)
    return (dataclasses.replace(spec, num_layers=full),
            dataclasses.replace(spec, num_layers=local))


def kv_bytes_per_token(config: ModelConfig, dtype) -> int:
    """Bytes of KV one token takes in pages of ``dtype``, scales included (all layers)."""
    return kv_spec(config, dtype).bytes_per_token


def init_state(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32,
               kv_cache_dtype: str = "auto", window_slots: int | None = None) -> PagedKVState:
    """An empty state: zeroed pages (and scales) for a model computing in ``dtype``, stored as
    ``kv_cache_dtype`` ("auto": ``dtype``; "int8"; "fp8_e4m3"). ``window_slots``: window-only
    KV, the local layers in a pool of that many slots (plus the zero one)."""
    checks = [("num_pages", num_pages), ("page_size", page_size)]
    if window_slots is not None:
        checks.append(("window_slots", window_slots))
        if not config.num_local_layers:
            raise ValueError("init_state: window_slots is given, but the model has no local "
                             "(sliding-window) layers")
    for name, value in checks:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"init_state: {name} must be a positive int, got {value!r}")
    power_of_two("init_state: page_size", page_size)
    stored = storage_dtype(kv_cache_dtype, dtype)
    full, local = pool_sizes(config, window_slots is not None)

    def pool(n, pages):
        shape = (n, config.num_kv_heads, pages, page_size, 2 * config.head_dim)
        scales = jnp.zeros(scale_rows_shape(shape), SCALE_DTYPE) if is_quantized(stored) \
            else None
        return jnp.zeros(shape, stored), scales

    kv_pages, kv_scales = pool(full, num_pages)
    window = pool(local, window_slots + 1) if window_slots is not None else (None, None)
    return PagedKVState(kv_pages=kv_pages, kv_scales=kv_scales, window_pages=window[0],
                        window_scales=window[1])


def write_kv(kv_pages, layer, k_tkd, v_tkd, page_t, offset_t, kv_scales=None):
    """Scatters the new K and V of T tokens into one layer of [L, K, P, S, 2D] pages.

    Token t goes to page ``page_t[t]`` at slot ``offset_t[t]``; a page index >= P (padding
    tokens) is dropped, so padding never touches a page. Quantized pages are written as values
    and scales (quantized here, once; keys rotated first, see `rotate_queries`); returns
    (pages, scales), scales None when unquantized.
    """
    heads_k = jnp.arange(kv_pages.shape[1], dtype=jnp.int32)[None, :]
    if kv_scales is not None:
        kv_tk2d, words_tk = quantize_kv(rotate(k_tkd), v_tkd, kv_pages.dtype)
        s = kv_pages.shape[3]
        g = pages_per_scale_row(s)  # the word of slot (p, o) is row p // G, column p % G * S + o
        rows = kv_scales.shape[2]  # a padding token's row is past the array: dropped
        row = jnp.where(page_t < kv_pages.shape[2], page_t // g, rows)
        col = page_t % g * s + offset_t
        kv_scales = kv_scales.at[layer, heads_k, row[:, None], col[:, None]].set(
            words_tk, mode="drop")
    else:
        kv_tk2d = jnp.concatenate([k_tkd, v_tkd], axis=-1).astype(kv_pages.dtype)
    # One scattered row per (token, kv head): the update window is only the contiguous last
    # axis, so XLA keeps the pool row-major. A [K, 2D] window per token (`[layer, :, page,
    # offset]`) makes XLA:TPU move K next to 2D in the layout, and then copy the whole pool
    # back to row-major for the attention kernel in every layer.
    kv_pages = kv_pages.at[layer, heads_k, page_t[:, None], offset_t[:, None]].set(
        kv_tk2d, mode="drop")
    return kv_pages, kv_scales


def rotate_queries(q_thd, kv_scales):
    """The queries attention over these pages takes: ``q R`` (`pallas_kernels.quant.rotate`, in
    q's dtype) for quantized pages (``kv_scales`` given), whose keys `write_kv` stored as
    ``k R``; q itself otherwise. Scores are unchanged: ``(q R) . (k R) = q . k``."""
    return q_thd if kv_scales is None else rotate(q_thd).astype(q_thd.dtype)
