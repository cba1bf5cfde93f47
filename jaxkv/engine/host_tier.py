"""The host-memory tier of the prefix cache: KV pages the device pool evicted, kept in numpy.

`jaxkv.cache.host_radix.HostTieredRadixCache` decides what moves (it demotes LRU entries
instead of dropping them, and promotes them back on a hit) and queues each copy as a
`jaxkv.cache.prefix.Transfer` (`take_transfers`); `HostKVPool` holds the slots and runs the
copies against the device state, in the order queued, before the step that reads or reuses
those pages:

- a save gathers device pages into one device array and starts its copy to the host without
  waiting (`copy_to_host_async`); it lands in the numpy slots when a load needs those slots,
  or at the latest when `flush` runs after the step's tokens were read, so a save never
  stalls the step behind it;
- a load reads slots (flushing saves first) and scatters them into device pages in one
  donated program; its host-to-device copy is issued before the step is dispatched, so it
  overlaps whatever the device is still running.

Slots are page-major, ``values[slot]`` = one page of every layer and kv head [L, K, S, 2D] in
the pool's dtype (scale words beside it for quantized pages). Programs are padded to a few
sizes, like page copies, so serving compiles nothing new.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np

from jaxkv.runtime.page_copy import gather_pages, load_pages, padded_parts


class HostKVPool:
    """``num_slots`` host slots, each holding one KV page of every layer (and its scales)."""

    def __init__(self, state, num_slots: int, sizes: tuple[int, ...] = (8, 64)):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"HostKVPool: num_slots must be an int >= 1, got {num_slots!r}")
        layers, heads, self.num_pages, page, lanes = state.kv_pages.shape
        self.values = np.zeros((num_slots, layers, heads, page, lanes), state.kv_pages.dtype)
        self.scales = None if state.kv_scales is None else np.zeros(
            (num_slots, layers, heads, page), np.int32)
        self.sizes = sizes
        self.page_bytes = self.values[0].nbytes + (0 if self.scales is None
                                                   else self.scales[0].nbytes)
        self._pending: list[tuple[object, list[int]]] = []  # saves not yet in the slots
        self.saved_pages = self.loaded_pages = 0
        # A run that raised with loads queued: pages promoted entries point at may be unfilled.
        self.loads_skipped = False

    @property
    def num_slots(self) -> int:
        return self.values.shape[0]

    def run(self, state, transfers):
        """Runs ``transfers`` (`Transfer`s: ("save", pages, slots) / ("load", slots, pages), in
        order) against ``state``; returns the new state (loads donate it). A run is not
        atomic: if a copy raises, `loads_skipped` says whether loads were queued."""
        try:
            return self._run(state, transfers)
        except Exception:
            self.loads_skipped = any(t[0] == "load" for t in transfers)
            raise

    def _run(self, state, transfers):
        for kind, group in itertools.groupby(transfers, key=lambda t: t[0]):
            pairs = [p for _, src, dst in group for p in zip(src, dst, strict=True)]
            if kind == "save":  # a slot saved twice in a row (freed, then reused): the last wins
                last = {slot: i for i, (_, slot) in enumerate(pairs)}
                pairs = [p for i, p in enumerate(pairs) if last[p[1]] == i]
            for part in padded_parts(pairs, self.sizes):
                if kind == "save":
                    self._save(state, part)
                else:
                    state = self._load(state, part)
        return state

    def flush(self) -> None:
        """Lands every save still in flight in its slots."""
        for (values, scales), slots in self._pending:
            n = len(slots)
            self.values[slots] = np.asarray(values)[:n]
            if self.scales is not None:
                self.scales[slots] = np.asarray(scales)[:n]
        self._pending = []

    def discard(self) -> None:
        """Forgets saves in flight (the device state they read was lost)."""
        self._pending = []
        self.loads_skipped = False


    def _save(self, state, part) -> None:
        pairs, n = part
        pages = np.full(n, self.num_pages, np.int32)  # out of range: zeros, never read back
        pages[:len(pairs)] = [p for p, _ in pairs]
        got = gather_pages(state, pages)
        for x in jax.tree.leaves(got):
            x.copy_to_host_async()
        self._pending.append((got, [s for _, s in pairs]))
        self.saved_pages += len(pairs)

    def _load(self, state, part):
        pairs, n = part
        slots = [s for s, _ in pairs]
        if any(set(slots) & set(pending) for _, pending in self._pending):
            self.flush()
        pages = np.full(n, self.num_pages, np.int32)  # out of range: dropped
        pages[:len(pairs)] = [p for _, p in pairs]
        take = np.zeros(n, np.int64)
        take[:len(pairs)] = slots
        scales = None if self.scales is None else self.scales[take]
        self.loaded_pages += len(pairs)
        return load_pages(state, pages, self.values[take], scales)


def tier_stats(radix, pool: HostKVPool | None) -> dict:
    """The `EngineStats` fields of the prefix cache's tiers: device hits, and with a host
    pool its hits, pages and bytes."""
    r = radix.stats()
    out = dict(device_hit_tokens=r["hit_tokens"] - r["host_hit_tokens"])
    if pool is not None:
        out.update(host_hit_tokens=r["host_hit_tokens"], host_kv_pages=radix.host.num_used,
                   host_kv_bytes=radix.host.num_used * pool.page_bytes,
                   host_kv_pages_total=pool.num_slots)
    return out
