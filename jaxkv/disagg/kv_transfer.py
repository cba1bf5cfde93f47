"""Moving KV pages from one engine's pool to another's: prefill/decode disaggregation.

A request's KV leaves the prefill pool as a page-major payload (`gather_pages`: values
[N, L, K, S, 2D] and, for int8/fp8 pools, scale words i32[N, L, K, S]), is put on the decode
side's devices with the decode pool's kv-head sharding (`jax.device_put`: a reshard between
two meshes), and is scattered into the pages the decode side allocated (`load_pages`).

The two pools may split kv heads differently (tensor parallelism of different sizes). A pool of
``Kp`` kv heads built from a model with K holds head j as a copy of original head j * K // Kp
(`jaxkv.sharding.shard`); so the payload carries min(Kp, Kd) heads, picked on the prefill
side when it has more and spread on the decode side when it has more, and never moves a head
twice.

Every call is asynchronous: the payload is in flight while both engines keep stepping; the
decode side loads it once it has arrived (`ready`), and device order keeps each pool's later
programs after the reads and writes queued here. A payload's destination pages are chosen when
it is received, so pages can be sent before the decode side has reserved any (page-run
streaming of a prompt still prefilling).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.kv import PagedKVState
from jaxkv.runtime.page_copy import gather_pages, load_pages, padded_parts


def head_maps(prefill_heads: int, decode_heads: int) -> tuple[np.ndarray | None,
                                                                np.ndarray | None]:
    """(prefill heads to send, payload head of each decode head); None where it is all of
    them in order. Raises ValueError if one count is not a multiple of the other."""
    big, small = max(prefill_heads, decode_heads), min(prefill_heads, decode_heads)
    if big % small:
        raise ValueError(f"kv heads: the prefill pool has {prefill_heads} and the decode pool "
                         f"{decode_heads}; one must be a multiple of the other")
    if prefill_heads == decode_heads:
        return None, None
    spread = np.arange(big, dtype=np.int32) * small // big
    pick = np.arange(small, dtype=np.int32) * big // small
    return (pick, None) if prefill_heads > decode_heads else (None, spread)


@jax.jit
def export_pages(state: PagedKVState, pages, heads):
    """The contents of ``pages`` (i32[N]; >= P gives zeros), kv heads ``heads`` only (all when
    None): (values [N, L, K', S, 2D], scales i32[N, L, K', S] or None). Reads only."""
    values, scales = gather_pages(state, pages)
    if heads is not None:
        values = values[:, :, heads]
        scales = None if scales is None else scales[:, :, heads]
    return values, scales


@functools.partial(jax.jit, donate_argnums=(0,))
def import_pages(state: PagedKVState, pages, values, scales, heads) -> PagedKVState:
    """Writes a payload into ``pages`` (i32[N]; >= P is dropped), decode head j taking payload
    head ``heads[j]`` (all in order when None). The state is donated."""
    if heads is not None:
        values = values[:, :, heads]
        scales = None if scales is None else scales[:, :, heads]
    return load_pages(state, pages, values, scales)


def payload_shardings(state: PagedKVState, heads: int):
    """Shardings of a payload with ``heads`` kv heads on ``state``'s devices: split by kv
    head like the pool when the heads divide over its "tp" axis, else whole on each device."""
    sharding = state.kv_pages.sharding
    if isinstance(sharding, NamedSharding) and "tp" in sharding.mesh.axis_names:
        tp = sharding.mesh.shape["tp"]
        axis = "tp" if heads % tp == 0 else None
        values = NamedSharding(sharding.mesh, PartitionSpec(None, None, axis, None, None))
        scales = NamedSharding(sharding.mesh, PartitionSpec(None, None, axis, None))
    else:
        values = scales = sharding
    return values, (None if state.kv_scales is None else scales)


@dataclasses.dataclass
class Payload:
    """Pages in flight to the decode side: parts of a few program sizes, each holding its
    real pages first (the rest is padding)."""

    parts: list[tuple[tuple[object, object], int]]  # ((values, scales), real pages)
    num_pages: int
    nbytes: int  # bytes of the real pages (padding excluded)

    def ready(self) -> bool:
        """True once every array of the payload is on the decode side's devices."""
        return all(x.is_ready() for part, _ in self.parts for x in jax.tree.leaves(part))

    def wait(self) -> None:
        """Blocks until `ready`."""
        jax.block_until_ready([part for part, _ in self.parts])


class PageMover:
    """Copies pages from a prefill pool to a decode pool (possibly split differently).

    ``sizes``: page counts of the programs (a payload of N pages moves in parts padded to
    these, so few programs compile)."""

    def __init__(self, prefill: PagedKVState, decode: PagedKVState, sizes):
        for name in ("page_size", "num_layers", "head_dim"):
            a, b = getattr(prefill, name), getattr(decode, name)
            if a != b:
                raise ValueError(f"prefill and decode KV pools differ in {name}: {a} vs {b}")
        if prefill.kv_pages.dtype != decode.kv_pages.dtype:
            raise ValueError(f"prefill and decode KV pools differ in kv_cache_dtype: "
                             f"{prefill.kv_pages.dtype} vs {decode.kv_pages.dtype}")
        self.pick, self.spread = head_maps(prefill.num_kv_heads, decode.num_kv_heads)
        heads = min(prefill.num_kv_heads, decode.num_kv_heads)
        self.shardings = payload_shardings(decode, heads)
        self.sizes = tuple(sorted(sizes))
        per_token = 2 * decode.head_dim * decode.kv_pages.dtype.itemsize + (
            0 if decode.kv_scales is None else 4)
        self.page_bytes = per_token * decode.page_size * decode.num_layers * heads

    def send(self, prefill: PagedKVState, src) -> Payload:
        """Dispatches the copy of prefill pages ``src`` to the decode devices; returns at once
        with the payload in flight (where its pages land is `receive`'s choice)."""
        parts = []
        for part, n in padded_parts(list(src), self.sizes):
            ids = np.full(n, prefill.num_pages, np.int32)  # out of range: zeros
            ids[:len(part)] = part
            values = export_pages(prefill, ids, self.pick)
            parts.append((jax.device_put(values, self.shardings), len(part)))
        return Payload(parts, len(src), len(src) * self.page_bytes)

    def receive(self, decode: PagedKVState, payload: Payload, dst) -> PagedKVState:
        """Scatters an arrived payload: its page i into decode page ``dst[i]`` (None: not
        needed, dropped). Returns the new decode state."""
        spread = None if self.spread is None else jnp.asarray(self.spread)
        dst = iter(dst)
        for (values, scales), real in payload.parts:
            ids = np.full(values.shape[0], decode.num_pages, np.int32)  # out of range: dropped
            for i in range(real):
                page = next(dst)
                if page is not None:
                    ids[i] = page
            decode = import_pages(decode, ids, values, scales, spread)
        return decode
