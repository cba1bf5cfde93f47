"""The worker half of disaggregation's connector: moving page runs from one pool to another.

A `PageTransport` exports a run of prefill pages (`send`, asynchronous: it returns a payload in
flight) and imports an arrived payload into decode pages chosen at that time (`receive`), so
pages can leave before the decode side has reserved any. Implementations:

- `jaxkv.disagg.kv_transfer.PageMover`: both pools in one process, device to device (a
  reshard between the two meshes); `DisaggregatedEngine`'s default;
- `FakeTransport` (here): through host memory, with deliveries a test can hold back, so tests
  drive every interleaving of a transfer (slow links, aborts in flight) on any devices;
- across processes, `jaxkv.disagg.kv_remote.KVPeer` (offers and pulls by id over
  jax.experimental.transfer), which `jaxkv.disagg.remote`'s workers drive themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.disagg.kv_transfer import PageMover, export_pages, import_pages
from jaxkv.kv import PagedKVState


@dataclasses.dataclass
class TransferStats:
    """What moved from the prefill pool to the decode pool since the engine started."""

    requests: int = 0  # requests handed off and landed
    pages: int = 0  # pages copied
    streamed_pages: int = 0  # of those, sent while their prompt was still prefilling
    bytes: int = 0  # bytes of those pages (scales included)
    reused_pages: int = 0  # prompt pages the decode side's prefix cache already held
    seconds: float = 0.0  # summed hand-off-to-landing time (waiting for decode room included)
    aborted: int = 0  # requests aborted while in transfer
    failed: int = 0  # transfers that raised (their requests recomputed on the decode side)


class InFlight(Protocol):
    """A payload on its way: how many pages and bytes it carries, and whether it arrived."""

    num_pages: int
    nbytes: int

    def ready(self) -> bool: ...

    def wait(self) -> None:
        """Blocks until `ready` (or, where no wait can end it, returns; the caller polls)."""


class PageTransport(Protocol):
    sizes: tuple[int, ...]  # page counts of its programs (a run moves in parts padded to these)

    def send(self, prefill: PagedKVState, src) -> InFlight:
        """Starts moving prefill pages ``src``; returns at once."""

    def receive(self, decode: PagedKVState, payload: InFlight, dst) -> PagedKVState:
        """Writes an arrived payload's page i into decode page ``dst[i]`` (None: dropped);
        the state is donated."""


@dataclasses.dataclass
class HostPayload:
    """Pages held in host memory (values, scales or None), padded to one of the sizes."""

    values: np.ndarray
    scales: np.ndarray | None
    num_pages: int
    nbytes: int
    transport: FakeTransport

    def ready(self) -> bool:
        return not self.transport.hold

    def wait(self) -> None:
        """Returns at once: the pages are in host memory already (while held, `ready` stays
        False and the caller polls again, as behind a link that has not delivered)."""


class FakeTransport:
    """Copies pages through host memory (numpy), one payload per run; while ``hold`` is True
    no payload is ready, as on a link that has not delivered yet. ``sent`` counts the runs."""

    def __init__(self, prefill: PagedKVState, decode: PagedKVState, sizes):
        self.local = PageMover(prefill, decode, sizes)  # its checks, head maps and sizes
        self.sizes = self.local.sizes
        self.hold = False
        self.sent = 0

    def send(self, prefill: PagedKVState, src) -> HostPayload:
        src = list(src)
        size = next((n for n in self.sizes if n >= len(src)), None)
        if size is None:
            raise ValueError(f"FakeTransport: a run of {len(src)} pages exceeds the largest "
                             f"size {self.sizes[-1]}")
        ids = np.full(size, prefill.num_pages, np.int32)  # out of range: zeros
        ids[:len(src)] = src
        values, scales = jax.device_get(export_pages(prefill, ids, self.local.pick))
        self.sent += 1
        return HostPayload(values, scales, len(src), len(src) * self.local.page_bytes, self)

    def receive(self, decode: PagedKVState, payload: HostPayload, dst) -> PagedKVState:
        ids = np.full(payload.values.shape[0], decode.num_pages, np.int32)  # dropped
        for i, page in enumerate(dst):
            if page is not None:
                ids[i] = page
        values, scales = self.local.shardings
        spread = None if self.local.spread is None else jnp.asarray(self.local.spread)
        return import_pages(decode, ids, jax.device_put(payload.values, values),
                            None if payload.scales is None else
                            jax.device_put(payload.scales, scales), spread)
