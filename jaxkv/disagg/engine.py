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
3. only those missing pages move (`jaxkv.disagg.kv_transfer`, or any `PageTransport`):
   gathered on the prefill devices, put on the decode devices with the decode pool's kv-head
   sharding, scattered into the fresh pages; the prefill side lets go of its pages as soon
   as the gather is queued. With ``stream_pages`` (the default) the pages of a prompt still
   prefilling in chunks start moving as each chunk fills them (page-run streaming: they
   wait, outside the pool, on the decode devices), so at the hand-off only the last chunk's
   pages are left to move. Pages the decode side's prefix cache holds (looked up before each
   run) are not streamed, nor are those the prefill side's own cache served (they wait for
   the hand-off's look);
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
import logging
import time

from jaxkv.disagg.connector import Arrival, DecodeConnector, Handoff, PrefillConnector
from jaxkv.disagg.kv_transfer import PageMover
from jaxkv.disagg.transport import InFlight, PageTransport, TransferStats
from jaxkv.engine.engine import Engine
from jaxkv.engine.outputs import RequestEntry, build_output
from jaxkv.engine.request import EngineStats, RequestOutput, RequestStatus
from jaxkv.runtime.batch import pow2
from jaxkv.sampling_params import SamplingParams

_log = logging.getLogger("jaxkv.disagg")

POLL_S = 0.0002  # how often `step` looks whether an engine's step in flight has finished


@dataclasses.dataclass
class _Sent:
    """A run of a prompt's pages sent to the decode devices: their indices in the prompt."""

    index: list[int]
    payload: InFlight


@dataclasses.dataclass
class _Transfer:
    request_id: str
    entry: RequestEntry  # prompt and sample streams
    handoff: Handoff
    sent: list[_Sent]  # runs streamed while it prefilled, then the rest at the reservation
    arrival: Arrival | None = None  # set once the decode side reserved pages
    started: float = 0.0


class DisaggregatedEngine:
    """The `Engine` API (add_request, step, abort, ...) over a prefill and a decode engine.

    Both must be idle and share ``page_size`` and ``kv_cache_dtype``; kv heads may be split
    differently (one count a multiple of the other). The prefill engine is a prefill engine
    from then on (it hands every request off after its first token). ``stream_pages``: send
    a prompt's pages as its prefill chunks fill them (see the module docstring).
    ``lockstep``: each `step` waits for both engines' steps (a reproducible interleaving, for
    tests; slower: decode steps then wait for prefill chunks). ``transport``: how pages move
    (`jaxkv.disagg.transport`; default: `PageMover`, device to device); a callable
    ``(prefill_state, decode_state, sizes) -> PageTransport``.
    ``transfers`` counts what moved; `stats` sums both engines' counters.
    """

    def __init__(self, prefill: Engine, decode: Engine, *, stream_pages: bool = True,
                 lockstep: bool = False, transport=PageMover):
        if prefill is decode:
            raise ValueError("DisaggregatedEngine: prefill and decode must be two engines")
        for name in ("page_size", "kv_cache_dtype"):
            a, b = getattr(prefill, name), getattr(decode, name)
            if a != b:
                raise ValueError(f"DisaggregatedEngine: {name} differs: prefill {a!r}, decode "
                                 f"{b!r}")
        if prefill.model.config.vocab_size != decode.model.config.vocab_size:
            raise ValueError(f"DisaggregatedEngine: vocab_size differs: prefill "
                             f"{prefill.model.config.vocab_size}, decode "
                             f"{decode.model.config.vocab_size} (two different models)")
        if prefill.has_unfinished_requests() or decode.has_unfinished_requests():
            raise ValueError("DisaggregatedEngine: the engines must be idle")
        self.prefill, self.decode, self.model = prefill, decode, decode.model
        self.engines = [prefill, decode]
        self.max_model_len = decode.max_model_len  # the prefill side holds only prompts
        self.handoffs = PrefillConnector(prefill.scheduler)  # prefill pages held for transfer
        self.arrivals = DecodeConnector(decode.scheduler)  # decode pages reserved for it
        sizes = sorted({min(pow2(n), pow2(decode.max_pages_per_seq))
                        for n in (1, 4, 16, 64, decode.max_pages_per_seq)})
        self.mover: PageTransport = transport(prefill.state, decode.state, sizes)
        prefill.use_connector(self.handoffs)
        decode.use_connector(self.arrivals)
        self.stream_pages, self.lockstep = bool(stream_pages), bool(lockstep)
        self._streams: dict[str, list[_Sent]] = {}  # runs sent of prompts still prefilling
        self._where: dict[str, str] = {}  # unfinished request id -> "prefill" | "move" | "decode"
        self._moving: list[_Transfer] = []  # handed off, in arrival order
        self._pending: list[RequestOutput] = []  # outputs the next step returns
        self._flight: dict[Engine, tuple] = {}  # each engine's dispatched, uncollected step
        self._aborts: list[tuple] = []  # (id, entry) waiting for their engine's step's collection
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
        ids = self.decode.prompt_ids(prompt, prompt_token_ids)
        sp = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(sp, SamplingParams):
            self.decode.check_fits(str(request_id), len(ids), sp)
        self.prefill.add_request(request_id, prompt, prompt_token_ids, sampling_params,
                                 cache_salt)
        self._where[request_id] = "prefill"

    def abort(self, request_id: str) -> None:
        """Ends an unfinished request wherever it is (prefilling, in transfer, decoding),
        freeing what it holds on both sides; the next `step` reports it. (If the engine
        holding it has a step in flight, the abort happens as that step is collected.)"""
        where = self._where.pop(request_id, None) if isinstance(request_id, str) else None
        if where is None:
            raise ValueError(f"abort: no unfinished request with request_id {request_id!r}")
        entry = next((e.get_request(request_id) for e in self.engines
                      if e.has_request(request_id)), None)
        if entry is None:
            entry = next(t.entry for t in self._moving if t.request_id == request_id)
        self._aborts.append((request_id, entry))
        self._apply_aborts()

    def _apply_aborts(self) -> None:
        # By identity: the id is free once `abort` returns, and a new request may take it
        # while the aborted one waits for its engine's step to be collected.
        for pending in list(self._aborts):
            rid, entry = pending
            engine = next((e for e in self.engines if e.get_request(rid) is entry), None)
            if engine is not None:
                if engine in self._flight:
                    continue  # after its step is collected
                engine.abort(rid)
            else:
                t = next((t for t in self._moving if t.entry is entry), None)
                if t is not None:
                    self._abort_transfer(t)
            self._aborts.remove(pending)  # (or it finished meanwhile: nothing left to free)

    def _abort_transfer(self, t: _Transfer) -> None:
        self._moving.remove(t)
        if t.arrival is None:
            self.handoffs.release(t.handoff)
        else:
            self.arrivals.cancel(t.arrival)  # payloads in flight are dropped
        now = time.time()
        for s in t.entry.samples:
            if not s.is_done:
                self.decode.scheduler.finish(s, "abort", now)
        self.transfers.aborted += 1
        self._pending.append(build_output(t.request_id, t.entry))

    def has_unfinished_requests(self) -> bool:
        return bool(self._moving or self._flight) or self.prefill.has_unfinished_requests() \
            or self.decode.has_unfinished_requests()

    def num_running(self) -> int:
        """Sample streams running on either engine, plus requests in transfer."""
        return self.prefill.num_running() + self.decode.num_running() + len(self._moving)

    def num_waiting(self) -> int:
        return self.prefill.num_waiting() + self.decode.num_waiting()

    def location(self, request_id: str) -> str | None:
        """Where an unfinished request is: "prefill", "move" (in transfer) or "decode"."""
        return self._where.get(request_id)

    def num_in_transfer(self) -> int:
        return len(self._moving)

    def has_step_in_flight(self, engine: Engine) -> bool:
        """True while ``engine`` (either side) has a dispatched step not collected yet."""
        return engine in self._flight

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advances the engines independently: each engine with work has one step in flight,
        and this collects whichever finished (waiting for the first), so a long prefill chunk
        holds up no decode step. Then the hand-offs: new ones reserve decode pages and start
        their copies, arrived ones join the decode engine's batch."""
        outputs, self._pending = self._pending, []
        for e in self.engines:
            if e not in self._flight and e.has_work():
                self._flight[e] = e.dispatch()
        if self._flight:
            for e in self._first_done():
                outputs += self._collect(e)
        elif self._moving:  # nothing else to do: wait for the oldest copy
            try:
                for x in self._moving[0].sent:
                    x.payload.wait()
            except Exception as e:  # noqa: BLE001 - that request recomputes, the rest go on
                self._transfer_failed(self._moving[0], e)
        self._start_transfers()
        self._land()
        outputs, self._pending = outputs + self._pending, []  # (aborts applied meanwhile)
        for out in outputs:  # (collected here or by a `_drain`)
            if out.finished and self._where.get(out.request_id) != "move" and \
                    not self.prefill.has_request(out.request_id) and \
                    not self.decode.has_request(out.request_id):
                self._where.pop(out.request_id, None)
        return outputs

    def _first_done(self) -> list[Engine]:
        """The engines whose step in flight has finished, once at least one has (with
        ``lockstep``: all of them)."""
        if self.lockstep:
            return list(self._flight)
        while True:
            done = [e for e, dispatched in self._flight.items() if dispatched.ready()]
            if done:
                return done
            time.sleep(POLL_S)

    def _collect(self, engine: Engine) -> list[RequestOutput]:
        resets = engine.state_resets
        outputs = engine.collect(self._flight.pop(engine))
        if engine.state_resets != resets:  # a failed step lost this engine's pool
            self._lost(engine)
        if engine is self.prefill:
            self._take_handoffs()
            if self.stream_pages:
                self._stream()
        self._apply_aborts()
        return outputs

    def _lost(self, engine: Engine) -> None:
        """``engine``'s KV pool was lost (and rebuilt): what holds pages of it recomputes on
        the decode side: hand-offs not gathered yet, or reservations sharing cached pages."""
        self._streams.clear()
        for t in [t for t in self._moving if (t.arrival is None) == (engine is self.prefill)]:
            self._recompute_on_decode(t)
        engine.radix.clear()  # entries those held kept through the engine's clear

    def _transfer_failed(self, t: _Transfer | None, error: Exception) -> None:
        """A page export, pull, import or a decode-side host copy raised. Policy: the request
        it was moving (if any) recomputes on the decode side, as after a lost pool (no request
        is failed: its tokens are all there); an engine whose KV state the failure lost is
        rebuilt (`Engine.recover`), and what held pages of it recomputes too."""
        _log.error("DisaggregatedEngine: a page transfer failed; %s: %s",
                   "its request recomputes on the decode side" if t else "streaming stops",
                   f"{type(error).__name__}: {error}")
        _log.debug("the failed transfer", exc_info=error)  # (a kept traceback holds payloads)
        self.transfers.failed += 1
        if t is not None and t in self._moving:
            self._recompute_on_decode(t)
        for engine in self.engines:
            if engine not in self._flight and engine.recover():
                self._lost(engine)

    def _drain(self) -> None:
        """Collects every step in flight (before changing what they ran with); the next
        `step` returns their outputs."""
        while self._flight:
            self._pending += self._collect(next(iter(self._flight)))

    def _take_handoffs(self) -> None:
        known = {id(t.handoff) for t in self._moving}
        for h in self.handoffs.handoffs:
            if id(h) not in known:
                rid = h.seqs[0].request_id
                entry = self.prefill.take_request(rid)
                self._moving.append(_Transfer(rid, entry, h, self._streams.pop(rid, []),
                                              started=time.time()))
                self._where[rid] = "move"
        for rid in [r for r in self._streams if not self.prefill.has_request(r)]:
            del self._streams[rid]  # finished at its first token, aborted or failed

    def _stream(self) -> None:
        """Sends the pages each prompt still prefilling has filled since the last step,
        except those the decode side's prefix cache holds now (page-run streaming)."""
        s, radix = self.prefill.page_size, self.decode.radix
        for req in self.prefill.scheduler.running:
            full = req.num_computed_tokens // s
            if req.num_computed_tokens >= req.prefill_end or full == 0:
                continue
            sent = self._streams.setdefault(req.request_id, [])
            have = {i for x in sent for i in x.index}
            held = radix.cached_length(req.token_ids[:full * s], req.cache_namespace) // s
            # Pages the prefill side's own prefix cache served came from an earlier request,
            # whose hand-off has usually put them in the decode side's cache too: they wait
            # for the hand-off's look, so streaming sends only what this prompt computed.
            first = max(held, (req.num_cached_tokens or 0) // s)
            run = [i for i in range(first, full) if i not in have]
            if run:
                try:
                    payload = self.mover.send(self.prefill.state, [req.pages[i] for i in run])
                except Exception as e:  # noqa: BLE001 - the hand-off sends the pages instead
                    self._streams.pop(req.request_id, None)
                    self._transfer_failed(None, e)
                    return
                sent.append(_Sent(run, payload))
                self.transfers.streamed_pages += len(run)

    def _recompute_on_decode(self, t: _Transfer) -> None:
        """Sends a handed-off request whose prefill KV cannot be used (lost with a failed
        prefill step, or computed by replaced weights) to wait on the decode engine, which
        recomputes it from its tokens, as after a preemption."""
        self._moving.remove(t)
        if any(h is t.handoff for h in self.handoffs.handoffs):  # not gathered yet
            self.handoffs.release(t.handoff)
        if t.arrival is not None:  # its decode pages reserved, payloads maybe in flight: dropped
            self.arrivals.cancel(t.arrival)
        for seq in t.handoff.seqs:
            seq.status, seq.num_computed_tokens = RequestStatus.WAITING, 0
            self.decode.scheduler.add(seq)
        self.decode.adopt_request(t.request_id, t.entry)
        self._where[t.request_id] = "decode"

    def _start_transfers(self) -> None:
        """Reserves decode pages for hand-offs in arrival order (stopping at the first that
        does not fit) and dispatches the copy of the pages the decode side lacks and that
        were not streamed already."""
        s = self.decode.page_size
        if self.decode.scheduler.waiting:  # its own preempted requests go first
            return
        for t in self._moving:
            if t.arrival is not None:
                continue
            arrival = self.arrivals.reserve(t.handoff)
            if arrival is None:
                break
            t.arrival = arrival
            try:
                self.decode.run_cache_copies()  # host-tier copies the reservation queued first
                k, n = arrival.num_shared, -(-t.handoff.num_tokens // s)
                have = {i for x in t.sent for i in x.index}
                rest = [i for i in range(k, n) if i not in have]
                if rest:
                    t.sent.append(_Sent(rest, self.mover.send(
                        self.prefill.state, [t.handoff.pages[i] for i in rest])))
            except Exception as e:  # noqa: BLE001 - that request recomputes, the rest go on
                self._transfer_failed(t, e)
                return  # (the list changed; the next step goes on)
            self.handoffs.release(t.handoff)  # the gather is queued before
            self.transfers.reused_pages += k                   # any later prefill program

    def _land(self) -> None:
        for t in list(self._moving):
            if t not in self._moving:
                continue  # sent to recompute by a failure just before
            try:
                if t.arrival is None or not all(x.payload.ready() for x in t.sent):
                    continue
                k, pages = t.arrival.num_shared, t.arrival.pages
                for x in t.sent:  # (a streamed page the decode side holds already: dropped)
                    dst = [pages[i] if i >= k else None for i in x.index]
                    self.decode.write_kv(lambda state, x=x, dst=dst:
                                         self.mover.receive(state, x.payload, dst))
            except Exception as e:  # noqa: BLE001 - that request recomputes, the rest go on
                self._transfer_failed(t, e)
                continue
            for x in t.sent:
                self.transfers.pages += x.payload.num_pages
                self.transfers.bytes += x.payload.nbytes
            self.arrivals.land(t.arrival)
            self.decode.adopt_request(t.request_id, t.entry)
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
        self._drain()  # the steps in flight ran with the old weights
        self.prefill.update_params(params, version=version, in_flight=in_flight)
        self.decode.update_params(params, version=self.prefill.weight_version,
                                  in_flight=in_flight)
        self._streams.clear()  # runs of KV the old weights computed
        if in_flight == "restart":
            for t in list(self._moving):
                self._recompute_on_decode(t)

    @property
    def weight_version(self) -> int | str:
        return self.decode.weight_version

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        return all([e.wait_for_warmup(timeout) for e in (self.prefill, self.decode)])

    def warmup(self) -> int:
        """Compiles both engines' programs and the transfer's (one per payload size)."""
        self._drain()
        n = self.prefill.warmup() + self.decode.warmup()
        for size in self.mover.sizes:  # out-of-range ids: reads zeros, writes nothing
            payload = self.mover.send(self.prefill.state, [self.prefill.num_pages] * size)
            self.decode.write_kv(lambda state, p=payload, n=size:
                                 self.mover.receive(state, p, [None] * n))
            n += 2
        return n

    def check(self) -> None:
        """Both engines' invariants, and that every request in transfer is held on exactly
        one side (prefill pages before its decode reservation, decode pages after)."""
        self.prefill.check()
        self.decode.check()
        held = [t.handoff for t in self._moving if t.arrival is None]
        assert held == self.handoffs.handoffs, "prefill hand-offs out of step"
        arrived = [t.arrival for t in self._moving if t.arrival is not None]
        assert arrived == self.arrivals.arrivals, "decode arrivals out of step"

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
