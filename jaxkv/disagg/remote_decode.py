"""The decode side of two-process disaggregation (`jaxkv.disagg.remote` has the protocol):
a `DecodeWorker` takes hand-offs from a `PrefillWorker`, reserves room for them, pulls their
pages over `jaxkv.disagg.kv_remote.KVPeer`, lands them and decodes."""

from __future__ import annotations

import dataclasses
import logging
import time
from multiprocessing.connection import Connection

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.disagg.connector import Arrival, DecodeConnector, Handoff
from jaxkv.disagg.kv_remote import KVPeer, Pull, wire_shards
from jaxkv.disagg.kv_transfer import head_maps, import_pages, payload_shardings
from jaxkv.disagg.remote import CARRIED, Worker, detokenizer, page_bytes
from jaxkv.engine.engine import Engine
from jaxkv.engine.outputs import RequestEntry, build_output
from jaxkv.engine.request import Request, RequestOutput, RequestStatus
from jaxkv.runtime.page_copy import padded_parts

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Incoming:
    """A request handed off to the decode side, until it lands or is aborted."""

    request_id: str
    entry: RequestEntry
    handoff: Handoff  # its streams and token count (no pages on this side)
    arrival: Arrival | None = None
    pulls: list[tuple[Pull, np.ndarray]] | None = None  # started pulls and their pages


class DecodeWorker(Worker):
    """Takes hand-offs from a `PrefillWorker` at the other end of ``channel`` and decodes."""

    role = "decode"

    def __init__(self, engine: Engine, peer: KVPeer, channel: Connection):
        super().__init__(engine, peer, channel)
        self.connector = DecodeConnector(engine.scheduler)
        engine.use_connector(self.connector)
        self._incoming: dict[str, _Incoming] = {}  # in arrival order
        self._known: set[str] = set()  # ids handed here, until "finished" is sent for them
        self._draining: list[Pull] = []  # pulls of aborted requests, dropped once here
        self._pending: list[RequestOutput] = []

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self._incoming or self._draining)

    def step(self) -> list[RequestOutput]:
        """Handles the prefill side's messages, reserves room for waiting hand-offs, lands
        the ones whose pages arrived, then runs one engine step."""
        for msg in self._messages():
            try:
                self._handle(msg)
            except Exception as e:  # noqa: BLE001 - fail this request, keep serving the rest
                self._fail(msg.get("request_id"), f"{type(e).__name__}: {e}", e)
        self._reserve()
        self._land()
        self._draining = [p for p in self._draining if not self._drained(p)]
        outputs, self._pending = self._pending, []  # aborts, this step's included
        resets = self.engine.state_resets
        outputs += self._step_engine()
        if self.engine.state_resets != resets:  # a failed step lost this pool: reservations
            for rid in [r for r, t in self._incoming.items() if t.arrival is not None]:
                self._recompute(rid)  # share pages of it, so they recompute here
            self.engine.radix.clear()  # entries those pages kept through the clear
        for rid in [r for r in self._known
                    if r not in self._incoming and not self.engine.has_request(r)]:
            self._known.discard(rid)  # ended here (normally, aborted or failed)
            if self.link_open:
                self.channel.send(dict(op="finished", request_id=rid))
        return outputs

    def _handle(self, msg: dict) -> None:
        op, rid = msg.get("op"), msg.get("request_id")
        if op == "handoff":
            if rid in self._known:  # the prefill side never reuses an unfinished id
                _log.error("DecodeWorker: a second hand-off of unfinished request %r "
                           "(ignored)", rid)
                return
            self._incoming[rid] = self._rebuild(msg)
            self._known.add(rid)
        elif op == "offer":
            if rid not in self._incoming and self.engine.has_request(rid):
                # Its reservation was cancelled (this pool was lost) and it recomputes here.
                self._drain_offer(rid, msg["uuid"], msg["sizes"])
            else:
                self._pull(rid, msg["uuid"])
        elif op == "abort":
            if msg.get("error") is not None and rid in self._incoming:
                self._fail(rid, msg["error"])
            else:
                self.abort(rid)
        elif op == "recompute":
            self._recompute(rid)
        else:
            raise ValueError(f"DecodeWorker: unexpected message {msg!r}")

    def abort(self, request_id: str) -> None:
        """Aborts it wherever it is here (waiting for room, pulling, decoding); unknown ids
        (finished already) are ignored."""
        t = self._incoming.pop(request_id, None)
        if t is None:
            if self.engine.has_request(request_id):
                self.engine.abort(request_id)
            return
        self._end(t, "abort")
        self.counters["aborted"] += 1

    def _fail(self, rid, error: str, exc: Exception | None = None) -> None:
        """Logs a message it could not act on and fails its request, if it is in transfer
        here (finish_reason "error", ``error`` in its output)."""
        _log.error("DecodeWorker: request %r failed: %s", rid, error, exc_info=exc)
        t = self._incoming.pop(rid, None) if isinstance(rid, str) else None
        if t is not None:
            t.entry.error = error
            self._end(t, "error")
            self.counters["failed"] += 1

    def _end(self, t: _Incoming, reason: str) -> None:
        """Ends a request in transfer: its reservation freed, its pulls drained."""
        if t.arrival is not None:
            self.connector.cancel(t.arrival)
        self._draining += [p for p, _ in t.pulls or ()]
        now = time.time()
        for s in t.entry.samples:
            if not s.is_done:
                self.engine.scheduler.finish(s, reason, now)
        self._pending.append(build_output(t.request_id, t.entry))

    @staticmethod
    def _drained(pull: Pull) -> bool:
        try:
            return pull.poll()
        except Exception as e:  # noqa: BLE001 - its payload was to be dropped anyway
            _log.warning("DecodeWorker: a drained pull failed: %s: %s", type(e).__name__, e)
            return True

    def _recompute(self, rid: str) -> None:
        """The prefill side lost the request's KV before offering it: its samples wait on
        this engine, which recomputes them from their tokens (as after a preemption)."""
        t = self._incoming.pop(rid, None)
        if t is None:  # landed already (its pages were all cached here), or aborted
            return
        if t.arrival is not None:
            self.connector.cancel(t.arrival)
        self._draining += [p for p, _ in t.pulls or ()]
        for seq in t.handoff.seqs:
            seq.status, seq.num_computed_tokens = RequestStatus.WAITING, 0
            self.engine.scheduler.add(seq)
        self.engine.adopt_request(rid, t.entry)
        self.counters["recomputed"] += 1

    def _rebuild(self, msg: dict) -> _Incoming:
        tok, eos = self.engine.model.tokenizer, self.engine.scheduler.eos_token_ids
        sp, ids = msg["sampling_params"], msg["prompt_token_ids"]
        grammar = None if sp.structured_outputs is None else \
            self.engine.runner.grammars.compile(sp.structured_outputs)
        samples = []
        for d in msg["samples"]:
            s = Request(msg["request_id"], ids, sp, msg["arrival_index"], msg["arrival_time"],
                        cache_salt=msg["cache_salt"], detok=detokenizer(tok, ids, sp),
                        grammar=None if grammar is None else grammar.matcher())
            for token in d["output_token_ids"]:  # replayed into its detokenizer and grammar
                s.append_token(token, eos)
            for k in CARRIED:
                setattr(s, k, d[k])
            s.status = RequestStatus(d["status"])
            samples.append(s)
        going = [s for s in samples if s.status is RequestStatus.TRANSFERRING]
        return _Incoming(msg["request_id"], RequestEntry(msg["prompt"], samples),
                         Handoff(going, [], msg["num_tokens"]))

    def _reserve(self) -> None:
        """Reserves room for waiting hand-offs in arrival order, stopping at the first that
        does not fit (it retries next step)."""
        if self.engine.scheduler.waiting:  # its own waiting requests (preempted, recomputing)
            return                         # first: steady hand-offs would starve them
        for t in self._incoming.values():
            if t.arrival is not None:
                continue
            arrival = self.connector.reserve(t.handoff)
            if arrival is None:
                break
            self.engine.run_cache_copies()  # host-tier copies the reservation queued run first
            t.arrival = arrival
            self.channel.send(dict(op="reserve", request_id=t.request_id,
                                   first=arrival.num_shared, shards=self._wire()[2]))
            self.counters["reused_pages"] += arrival.num_shared
            if arrival.num_shared * self.engine.page_size >= arrival.num_tokens:
                t.pulls = []  # every page was in the prefix cache: lands at once

    def _wire(self):
        """(payload kv heads, shardings, kv-head blocks an offer should travel in)."""
        state = self.engine.state
        heads = min(self._other()["kv_heads"], state.num_kv_heads)
        shardings = payload_shardings(state, heads)
        shape = (1, state.num_layers, heads, state.page_size, 2 * state.head_dim)
        return heads, shardings, wire_shards(shardings[0], shape)

    def _part_shapes(self, size: int):
        """(values, scales) shapes of an offered part of ``size`` pages, and their shardings."""
        heads, shardings, _ = self._wire()
        state = self.engine.state
        shape = (size, state.num_layers, heads, state.page_size, 2 * state.head_dim)
        return (jax.ShapeDtypeStruct(shape, state.kv_pages.dtype),
                None if state.kv_scales is None else
                jax.ShapeDtypeStruct(shape[:4], jnp.int32)), shardings

    def _drain_offer(self, rid, uuid: int, sizes) -> None:
        """Pulls an offer no reservation waits for (its request recomputes here) and drops
        it, so the prefill side's transfer server lets it go."""
        _log.info("DecodeWorker: draining an offer for request %r, which no reservation "
                  "waits for", rid)
        for i, size in enumerate(sizes):
            shapes, shardings = self._part_shapes(size)
            self._draining.append(self.peer.start_pull(self._other()["kv_address"], uuid + i,
                                                       shapes, shardings))
        self.counters["drained_offers"] += 1

    def _pull(self, rid: str, uuid: int) -> None:
        """Starts pulling a request's parts (offered under uuid, uuid + 1, ...)."""
        t, state = self._incoming.get(rid), self.engine.state
        if t is None:  # the prefill side forwards an abort after its offer, never before
            raise ValueError(f"DecodeWorker: an offer for unknown request {rid!r}")
        if t.arrival is None or t.pulls is not None:
            raise ValueError(f"DecodeWorker: an offer for request {rid!r}, which has "
                             f"{'no reservation' if t.arrival is None else 'its pulls'}")
        heads = self._wire()[0]
        k, n = t.arrival.num_shared, -(-t.arrival.num_tokens // state.page_size)
        t.pulls = []
        for i, (part, size) in enumerate(padded_parts(t.arrival.pages[k:n],
                                                      self.hello["sizes"])):
            shapes, shardings = self._part_shapes(size)
            dst = np.full(size, state.num_pages, np.int32)  # out of range: dropped
            dst[:len(part)] = part
            t.pulls.append((self.peer.start_pull(self._other()["kv_address"], uuid + i,
                                                 shapes, shardings), dst))
            self.counters["pages"] += len(part)
            self.counters["bytes"] += len(part) * page_bytes(state, heads)

    def _land(self) -> None:
        for t in list(self._incoming.values()):
            try:
                if t.pulls is None or not all(p.poll() for p, _ in t.pulls):
                    continue
                _, spread = head_maps(self._other()["kv_heads"],
                                      self.engine.state.num_kv_heads)
                spread = None if spread is None else jnp.asarray(spread)
                for p, dst in t.pulls:
                    values, scales = p.result()
                    self.engine.write_kv(lambda state, d=dst, v=values, s=scales, h=spread:
                                         import_pages(state, d, v, s, h))
            except Exception as e:  # noqa: BLE001 - a failed pull fails its request only
                self._fail(t.request_id, f"{type(e).__name__}: {e}", e)
                continue
            self.connector.land(t.arrival)
            self.engine.adopt_request(t.request_id, t.entry)
            del self._incoming[t.request_id]
            if t.pulls:
                self.channel.send(dict(op="landed", request_id=t.request_id))
            self.counters["requests"] += 1

    def check(self) -> None:
        """The engine's invariants, and that its arrivals are exactly the reserved hand-offs."""
        self.engine.check()
        assert [t.arrival for t in self._incoming.values() if t.arrival is not None] == \
            self.connector.arrivals, "decode arrivals out of step"
        assert set(self._incoming) <= self._known, "hand-off books out of step"

