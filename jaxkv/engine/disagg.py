"""Prefill/decode disaggregation: prompts run on one engine, decoding on another.

Prefill (compute-bound) and decode (bandwidth-bound) slow each other down when they share a
device: a long prompt's chunk stalls every decode in its step. Splitwise and DistServe run them
on different devices; `DisaggregatedEngine` does that with two `Engine`s, each on its own mesh
(tensor parallel of any size, one device, or different sizes on the two sides):

1. the prefill engine runs a request's prompt (chunked, with its own prefix cache) and draws
   each sample's first token, then hands the request off: its slots are freed, its prompt KV
   offered to the prefill prefix cache, and its pages held;
2. the decode engine reserves slots and pages for it: whole pages its own prefix cache already
   holds are shared, fresh pages take the rest (it waits, holding nothing, while the decode
   side lacks room);
3. only those missing pages move (`jaxkv.runtime.kv_transfer`): gathered on the prefill
   devices, put on the decode devices with the decode pool's kv-head sharding, scattered into
   the fresh pages; the prefill side lets go of its pages as soon as the gather is queued;
4. once the pages have arrived the request decodes on the decode engine, which may preempt it
   (it then recomputes there), fork it (n > 1 samples share the pages) and cache its prompt.

Steps overlap: each `step` dispatches both engines' device work before reading either back,
and a transfer in flight does not hold up either engine; the decode side picks it up on the
first step after it has landed. An abort at any stage frees what the request holds on both
sides. Tokens equal colocated serving's: the same Request objects (keys, samples, detokenizer)
move from one engine to the other.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from jaxkv.engine.engine import Engine
from jaxkv.engine.request import EngineStats, RequestOutput, RequestStatus
from jaxkv.engine.scheduler import Arrival, Handoff
from jaxkv.runtime.batch import pow2
from jaxkv.runtime.kv_transfer import PageMover, Payload
from jaxkv.sampling_params import SamplingParams


@dataclasses.dataclass
class _Transfer:
    request_id: str
    entry: object  # the engine's _Entry: prompt and sample streams
    handoff: Handoff
    arrival: Arrival | None = None  # set once the decode side reserved pages
    payload: Payload | None = None  # pages in flight (None: none were missing)
    started: float = 0.0


@dataclasses.dataclass
class TransferStats:
    """What moved from the prefill pool to the decode pool since the engine started."""

    requests: int = 0  # requests handed off and landed
    pages: int = 0  # pages copied
    bytes: int = 0  # bytes of those pages (scales included)
    reused_pages: int = 0  # prompt pages the decode side's prefix cache already held
    seconds: float = 0.0  # summed dispatch-to-landing time (host view, coarse)
    aborted: int = 0  # requests aborted while in transfer


class DisaggregatedEngine:
    """The `Engine` API (add_request, step, abort, ...) over a prefill and a decode engine."""

    def __init__(self, prefill: Engine, decode: Engine):
        if prefill is decode:
            raise ValueError("DisaggregatedEngine: prefill and decode must be two engines")
        for name in ("page_size", "kv_cache_dtype"):
            a, b = getattr(prefill, name), getattr(decode, name)
            if a != b:
                raise ValueError(f"DisaggregatedEngine: {name} differs: prefill {a!r}, decode "
                                 f"{b!r}")
        if prefill.model.config.vocab_size != decode.model.config.vocab_size:
            raise ValueError("DisaggregatedEngine: the two engines serve different models")
        if prefill.has_unfinished_requests() or decode.has_unfinished_requests():
            raise ValueError("DisaggregatedEngine: the engines must be idle")
        self.prefill, self.decode, self.model = prefill, decode, decode.model
        self.engines = [prefill, decode]
        self.max_model_len = decode.max_model_len  # the prefill side holds only prompts
        prefill.scheduler.hand_off_after_prefill = True
        sizes = sorted({min(pow2(n), pow2(decode.max_pages_per_seq))
                        for n in (1, 4, 16, 64, decode.max_pages_per_seq)})
        self.mover = PageMover(prefill.state, decode.state, sizes)
        self._where: dict[str, str] = {}  # unfinished request id -> "prefill" | "move" | "decode"
        self._moving: list[_Transfer] = []  # handed off, in arrival order
        self._pending: list[RequestOutput] = []  # aborted in transfer, reported by next step
        self.transfers = TransferStats()

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids=None,
                    sampling_params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        """Queues a request on the prefill engine; it must fit the decode engine whole (prompt
        plus max_tokens) and the prefill engine's prompt. Raises ValueError naming the field."""
        if isinstance(request_id, str) and request_id in self._where:
            raise ValueError(f"request_id {request_id!r} is already used by an unfinished "
                             "request")
        ids = self.decode._prompt_ids(prompt, prompt_token_ids)
        sp = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(sp, SamplingParams):
            self.decode._check_fits(str(request_id), len(ids), sp)
        self.prefill.add_request(request_id, prompt, prompt_token_ids, sampling_params,
                                 cache_salt)
        self._where[request_id] = "prefill"

    def abort(self, request_id: str) -> None:
        """Ends an unfinished request wherever it is (prefilling, in transfer, decoding),
        freeing what it holds on both sides; the next `step` reports it."""
        where = self._where.pop(request_id, None) if isinstance(request_id, str) else None
        if where is None:
            raise ValueError(f"abort: no unfinished request with request_id {request_id!r}")
        if where != "move":
            (self.prefill if where == "prefill" else self.decode).abort(request_id)
            return
        t = next(t for t in self._moving if t.request_id == request_id)
        self._moving.remove(t)
        if t.arrival is None:
            self.prefill.scheduler.release_handoff(t.handoff)
        else:
            self.decode.scheduler.cancel_arrival(t.arrival)  # a payload in flight is dropped
        now = time.time()
        for s in t.entry.samples:
            if not s.is_done:
                self.decode.scheduler.finish(s, "abort", now)
        self.transfers.aborted += 1
        self._pending.append(self.decode._output(request_id, t.entry))

    def has_unfinished_requests(self) -> bool:
        return bool(self._moving) or self.prefill.has_unfinished_requests() \
            or self.decode.has_unfinished_requests()

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of each engine with work (both dispatched before either is read back),
        then the hand-offs: new ones reserve decode pages and start their copies, arrived ones
        join the decode engine's batch for its next step."""
        outputs, self._pending = self._pending, []
        busy = [e for e in (self.prefill, self.decode)
                if e.has_unfinished_requests() or e._pending]
        resets = self.prefill.state_resets
        for e, dispatched in [(e, e.dispatch()) for e in busy]:
            outputs += e.collect(dispatched)
        if self.prefill.state_resets != resets:  # a failed step lost the prefill pool
            for t in [t for t in self._moving if t.arrival is None]:
                self._recompute_on_decode(t)
        self._take_handoffs()
        self._start_transfers()
        if self._moving and not busy:  # nothing else to do: wait for the oldest copy
            jax.block_until_ready([t.payload.parts for t in self._moving[:1]
                                   if t.payload is not None])
        self._land()
        for out in outputs:
            if out.finished and self._where.get(out.request_id) != "move" and \
                    out.request_id not in self.prefill._requests and \
                    out.request_id not in self.decode._requests:
                self._where.pop(out.request_id, None)
        return outputs

    def _take_handoffs(self) -> None:
        known = {id(t.handoff) for t in self._moving}
        for h in self.prefill.scheduler.handoffs:
            if id(h) not in known:
                rid = h.seqs[0].request_id
                entry = self.prefill._requests.pop(rid)
                self._moving.append(_Transfer(rid, entry, h, started=time.time()))
                self._where[rid] = "move"

    def _recompute_on_decode(self, t: _Transfer) -> None:
        """Sends a handed-off request whose prefill KV cannot be used (lost with a failed
        prefill step, or computed by replaced weights) to wait on the decode engine, which
        recomputes it from its tokens, as after a preemption."""
        self._moving.remove(t)
        if t.arrival is None:
            self.prefill.scheduler.release_handoff(t.handoff)
        else:  # its pages reserved on the decode side, a payload maybe in flight: dropped
            self.decode.scheduler.cancel_arrival(t.arrival)
        for seq in t.handoff.seqs:
            seq.status, seq.num_computed_tokens = RequestStatus.WAITING, 0
            self.decode.scheduler.add(seq)
        self.decode._requests[t.request_id] = t.entry
        self._where[t.request_id] = "decode"

    def _start_transfers(self) -> None:
        """Reserves decode pages for hand-offs in arrival order (stopping at the first that
        does not fit) and dispatches the copy of the pages the decode side lacks."""
        s = self.decode.page_size
        for t in self._moving:
            if t.arrival is not None:
                continue
            arrival = self.decode.scheduler.reserve_arrival(t.handoff)
            if arrival is None:
                break
            self.decode._transfer()  # host-tier copies the reservation queued run first
            k, n = arrival.num_shared, -(-t.handoff.num_tokens // s)
            if k < n:
                t.payload = self.mover.send(self.prefill.state, t.handoff.pages[k:n],
                                            arrival.pages[k:n], self.decode.num_pages)
            t.arrival = arrival
            self.prefill.scheduler.release_handoff(t.handoff)  # the gather is queued before
            self.transfers.reused_pages += k                   # any later prefill program

    def _land(self) -> None:
        for t in list(self._moving):
            if t.arrival is None or (t.payload is not None and not t.payload.ready()):
                continue
            if t.payload is not None:
                self.decode.state = self.mover.receive(self.decode.state, t.payload)
                self.transfers.pages += t.payload.num_pages
                self.transfers.bytes += t.payload.nbytes
            self.decode.scheduler.land(t.arrival)
            self.decode._requests[t.request_id] = t.entry
            self._moving.remove(t)
            self._where[t.request_id] = "decode"
            self.transfers.requests += 1
            self.transfers.seconds += time.time() - t.started

    # ---- the rest of the Engine API ------------------------------------------------------

    def update_params(self, params, *, version: int | str | None = None,
                      in_flight: str = "restart") -> None:
        """New weights on both engines, under one version (`Engine.update_params`; nothing
        compiles). With ``in_flight="restart"`` a request in transfer, whose prompt KV the old
        weights computed, recomputes it on the decode engine; with "keep" its KV moves on."""
        self.prefill.update_params(params, version=version, in_flight=in_flight)
        self.decode.update_params(params, version=self.prefill.weight_version,
                                  in_flight=in_flight)
        if in_flight == "restart":
            for t in list(self._moving):
                self._recompute_on_decode(t)

    @property
    def weight_version(self) -> int | str:
        return self.decode.weight_version

    def warmup(self) -> int:
        """Compiles both engines' programs and the transfer's (one per payload size)."""
        n = self.prefill.warmup() + self.decode.warmup()
        for size in self.mover.sizes:  # out-of-range ids: reads zeros, writes nothing
            payload = self.mover.send(self.prefill.state, [self.prefill.num_pages] * size,
                                      [self.decode.num_pages] * size, self.decode.num_pages)
            self.decode.state = self.mover.receive(self.decode.state, payload)
            n += 2
        return n

    def check(self) -> None:
        """Both engines' invariants, and that every request in transfer is held on exactly
        one side (prefill pages before its decode reservation, decode pages after)."""
        self.prefill.check()
        self.decode.check()
        held = [t.handoff for t in self._moving if t.arrival is None]
        assert held == self.prefill.scheduler.handoffs, "prefill hand-offs out of step"
        arrived = [t.arrival for t in self._moving if t.arrival is not None]
        assert arrived == self.decode.scheduler.arrivals, "decode arrivals out of step"

    def stats(self) -> EngineStats:
        """Both engines' counters summed (steps: the most either ran), with the transfer's."""
        per = [self.prefill.stats(), self.decode.stats()]
        fields = {f.name: sum(getattr(s, f.name) for s in per)
                  for f in dataclasses.fields(EngineStats)}
        fields["steps"] = max(s.steps for s in per)
        fields.update(kv_transfers=self.transfers.requests,
                      kv_pages_transferred=self.transfers.pages,
                      kv_bytes_transferred=self.transfers.bytes)
        return EngineStats(**fields)
