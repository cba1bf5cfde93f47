"""The device KV state: an immutable pytree of pages, page table and lengths.

Axes: L layers, K kv heads, P pages, S page_size, D head_dim, B max_seqs (slots),
W max_pages_per_seq, T tokens of a step.

The host decides *which* pages a slot owns; the device holds *what* is in them. Transitions are
pure (`state.replace(...)`) and jitted with the state donated, so XLA updates pages in place.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.errors import KVStateError
from jaxkv.model.config import ModelConfig


def _check(field: str, fn, *args) -> None:
    try:
        fn(*args)
    except AssertionError as e:
        raise KVStateError(f"PagedKVState.{field}: {e}") from None


@struct.dataclass
class PagedKVState:
    k_pages: jax.Array  # [L, K, P, S, D]
    v_pages: jax.Array  # [L, K, P, S, D]
    page_table: jax.Array  # i32[B, W]  slot -> physical pages
    lengths: jax.Array  # i32[B]  tokens cached per slot

    def __post_init__(self):
        # jax rebuilds pytrees with placeholder leaves (tracing, vmap axes); check real arrays only.
        fields = (self.k_pages, self.v_pages, self.page_table, self.lengths)
        if all(hasattr(x, "shape") and hasattr(x, "dtype") for x in fields):
            self.validate()

    def _looks_valid(self) -> bool:
        k, v, pt, ln = self.k_pages, self.v_pages, self.page_table, self.lengths
        return (len(k.shape) == 5 and v.shape == k.shape and v.dtype == k.dtype
                and len(pt.shape) == 2 and pt.dtype == jnp.int32
                and ln.shape == (pt.shape[0],) and ln.dtype == jnp.int32)

    def validate(self) -> None:
        """Raises KVStateError naming the first field with a wrong rank, shape or dtype."""
        if self._looks_valid():  # the per-step fast path; chex below words the failure
            return
        _check("k_pages", chex.assert_rank, self.k_pages, 5)
        _check("v_pages", chex.assert_shape, self.v_pages, self.k_pages.shape)
        _check("v_pages", chex.assert_type, self.v_pages, self.k_pages.dtype)
        _check("page_table", chex.assert_rank, self.page_table, 2)
        _check("page_table", chex.assert_type, self.page_table, jnp.int32)
        _check("lengths", chex.assert_shape, self.lengths, (self.page_table.shape[0],))
        _check("lengths", chex.assert_type, self.lengths, jnp.int32)

    def validate_for(self, config: ModelConfig) -> None:
        """Checks that this state can hold the KV of `config`'s model."""
        want = (config.num_layers, config.num_kv_heads, self.num_pages, self.page_size,
                config.head_dim)
        _check("k_pages", chex.assert_shape, self.k_pages, want)

    num_layers = property(lambda self: self.k_pages.shape[0])
    num_kv_heads = property(lambda self: self.k_pages.shape[1])
    num_pages = property(lambda self: self.k_pages.shape[2])
    page_size = property(lambda self: self.k_pages.shape[3])
    head_dim = property(lambda self: self.k_pages.shape[4])
    max_seqs = property(lambda self: self.page_table.shape[0])
    max_pages_per_seq = property(lambda self: self.page_table.shape[1])


def init_state(config: ModelConfig, num_pages: int, page_size: int, max_seqs: int,
               max_pages_per_seq: int, dtype=jnp.float32) -> PagedKVState:
    """An empty state: zeroed pages, an all-zero page table and zero lengths."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size),
                        ("max_seqs", max_seqs), ("max_pages_per_seq", max_pages_per_seq)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"init_state: {name} must be a positive int, got {value!r}")
    if page_size & (page_size - 1):
        raise ValueError(f"init_state: page_size must be a power of two, got {page_size}")
    shape = (config.num_layers, config.num_kv_heads, num_pages, page_size, config.head_dim)
    return PagedKVState(
        k_pages=jnp.zeros(shape, dtype),
        v_pages=jnp.zeros(shape, dtype),
        page_table=jnp.zeros((max_seqs, max_pages_per_seq), jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
    )


def write_kv(pages, layer, new_tkd, page_t, offset_t):
    """Scatters new K (or V) of T tokens into one layer of [L, K, P, S, D] pages.

    Token t goes to page ``page_t[t]`` at slot ``offset_t[t]``; a page index >= P (padding
    tokens) is dropped, so padding never touches a page.
    """
    return pages.at[layer, :, page_t, offset_t].set(new_tkd.astype(pages.dtype), mode="drop")
