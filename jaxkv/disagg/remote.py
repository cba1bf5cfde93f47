"""Prefill/decode disaggregation across processes: a prefill `Engine` in one, a decode
`Engine` in another, the KV pages moving between them over `jaxkv.disagg.kv_remote.KVPeer`.

The single-process `DisaggregatedEngine` (`jaxkv.disagg.engine`) split in two: the same
scheduler connectors (`jaxkv.disagg.connector`: `PrefillConnector` holds hand-offs,
`DecodeConnector` reserves, lands and cancels arrivals) and the same page payloads
(`kv_transfer.export_pages` / `import_pages`),
coordinated by pickled dicts over a `multiprocessing.connection` channel ("link"):

    prefill -> decode  {"op": "hello", ...pool and limits}          once, each way
    prefill -> decode  {"op": "handoff", "request_id", "prompt", "prompt_token_ids",
                        "sampling_params", "cache_salt", "arrival_index", "arrival_time",
                        "num_tokens", "samples": [per-sample state, `CARRIED`]}
    decode -> prefill  {"op": "reserve", "request_id", "first"}     pages first.. are missing
    prefill -> decode  {"op": "offer", "request_id", "uuid", "sizes"} parts under uuid, uuid+1..
    decode -> prefill  {"op": "landed", "request_id"}               pulled: prefill frees pages
    decode -> prefill  {"op": "finished", "request_id"}             ended on the decode side
    prefill -> decode  {"op": "abort", "request_id"[, "error"]}     not (or no longer) held here
    prefill -> decode  {"op": "recompute", "request_id"}            its prefill KV was lost

1. The prefill engine runs the prompt and draws each sample's first token (its outputs go to
   its front end), then hands the request off: its pages are held, its state sent.
2. The decode worker rebuilds the samples (tokens replayed through `Request.append_token`, so
   a detokenizer sees what it saw on the prefill side) and reserves slots and pages, retrying
   each step while it has no room; it answers with the first page its prefix cache lacks.
3. The prefill worker gathers exactly those pages (in parts padded to a few sizes, so few
   programs compile; kv heads picked when it has more), offers each part under its own uuid
   (ids belong to the offering transfer server, so the prefill side picks them).
4. The decode worker starts the pulls (`KVPeer.start_pull`: they return at once), keeps
   decoding, and once they have arrived scatters them (`import_pages`), lands the request and
   acknowledges; the transport tells the sender nothing, so the prefill side holds the pages
   until that acknowledgement (which also bounds the offers in flight by its pool).

Aborts go to the prefill worker, which aborts what its engine holds and forwards the rest in
order behind its own messages, so the decode side always sees a hand-off before its abort.
Offers are never left pending: a pull of an offer that never comes never ends (and an expired
offer is such an offer), so offers carry no deadline and the decode side pulls every offer it
is told about, dropping the payload of an aborted request once it arrives ("draining"). That
includes an offer for a request it no longer expects (its reservation was cancelled because
its own pool was lost, and the request recomputes there): the offer names its parts' sizes, so
it can always be pulled and dropped (`counters["drained_offers"]`).

Request ids: the prefill worker refuses (ValueError) an id in use by an unfinished request
wherever it is: its engine's, and every id it handed off until the decode worker says
"finished" (sent once for each request it was handed, however it ended: normally, aborted or
failed), so a reused id never meets its predecessor's messages on either side.

A failed prefill step that loses the prefill KV pool (`Engine.state_resets` changes: the
engine rebuilt a zeroed state) sends every held hand-off whose pages were not offered yet to
recompute on the decode side ("recompute": the prefill pages are freed, the decode worker
cancels its reservation, if any, and queues the samples to recompute from their tokens, as
after a preemption), as `DisaggregatedEngine` does. The decode worker reserves nothing for
hand-offs while its own engine has requests waiting (preempted or recomputing): they go first.

A message a worker cannot act on (an offer for an unknown request, a pull that fails) is
logged and fails that request (finish_reason "error", the message in `RequestOutput.error`);
the worker keeps serving.

Outputs: each worker returns `RequestOutput`s for what it holds: the first token comes from
the prefill side, the rest (and every abort after the hand-off) from the decode side.
This module holds the protocol, what both workers share and the `PrefillWorker`;
`jaxkv.disagg.remote_decode` holds the `DecodeWorker`.
`jaxkv.disagg.serve` runs each worker in its own process for a front end.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from multiprocessing.connection import Connection

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.disagg.connector import Handoff, PrefillConnector
from jaxkv.disagg.kv_remote import KVPeer
from jaxkv.disagg.kv_transfer import export_pages, head_maps
from jaxkv.engine.detokenizer import IncrementalDetokenizer
from jaxkv.engine.engine import Engine
from jaxkv.engine.request import RequestOutput
from jaxkv.runtime.batch import pow2
from jaxkv.runtime.page_copy import padded_parts
from jaxkv.sampling_params import SamplingParams

# Per-sample state that travels with a hand-off (the rest is rebuilt or belongs to one side).
CARRIED = ("sample_index", "key", "first_token_time", "finish_reason", "finish_time",
            "num_cached_tokens", "logprobs", "emitted", "bad_words_ids", "prompt_logprobs",
            "prompt_logprobs_sent", "kv_version", "token_versions", "num_preemptions")
HELLO_TIMEOUT_S = 120.0
_log = logging.getLogger(__name__)


def hello_message(engine: Engine, role: str, peer: KVPeer) -> dict:
    sizes = sorted({min(pow2(n), pow2(engine.max_pages_per_seq))
                    for n in (1, 4, 16, 64, engine.max_pages_per_seq)})
    return dict(op="hello", role=role, kv_address=peer.address, page_size=engine.page_size,
                kv_heads=engine.state.num_kv_heads, kv_cache_dtype=engine.kv_cache_dtype,
                vocab_size=engine.model.config.vocab_size, max_model_len=engine.max_model_len,
                num_pages=engine.num_pages, max_num_seqs=engine.max_num_seqs, sizes=sizes)


def page_bytes(state, heads: int) -> int:
    """Bytes of one page of a payload with ``heads`` kv heads (scale words included)."""
    per_token = 2 * state.head_dim * state.kv_pages.dtype.itemsize \
        + (0 if state.kv_scales is None else 4)
    return state.num_layers * heads * state.page_size * per_token


def detokenizer(tok, ids, sp) -> IncrementalDetokenizer | None:
    """A sample's detokenizer, made as `Engine.add_request` makes it."""
    return None if tok is None else IncrementalDetokenizer(
        tok, ids, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
        include_stop_str_in_output=sp.include_stop_str_in_output)


class Worker:
    """What both workers share: the engine, the transfer peer, the link and its hello."""

    role = ""

    def __init__(self, engine: Engine, peer: KVPeer, channel: Connection):
        if engine.has_unfinished_requests():
            raise ValueError(f"{type(self).__name__}: the engine must be idle")
        self.engine, self.peer, self.channel = engine, peer, channel
        self.hello = hello_message(engine, self.role, peer)
        self.other: dict | None = None  # the other side's hello, once read
        self.link_open = True  # False once the other side closed the link (it stopped)
        self.counters = dict(requests=0, pages=0, bytes=0, reused_pages=0, aborted=0,
                             recomputed=0, failed=0, drained_offers=0)
        channel.send(self.hello)

    def _other(self) -> dict:
        """The other side's hello (the first message on the link), read once."""
        if self.other is None:
            if not self.channel.poll(HELLO_TIMEOUT_S):
                raise TimeoutError(f"{type(self).__name__}: no hello on the link")
            self.accept_hello(self.channel.recv())
        return self.other

    def accept_hello(self, msg: dict) -> None:
        """Takes the other side's hello (read by the caller, or by `_other`); ValueError if
        the two sides cannot share pages."""
        if msg.get("op") != "hello" or msg.get("role") == self.role:
            raise ValueError(f"{type(self).__name__}: expected the other side's hello, got "
                             f"{msg!r}")
        for name in ("page_size", "kv_cache_dtype", "vocab_size"):
            if msg[name] != self.hello[name]:
                raise ValueError(f"{type(self).__name__}: {name} is {self.hello[name]!r} "
                                 f"here and {msg[name]!r} on the {msg['role']} side")
        head_maps(msg["kv_heads"], self.hello["kv_heads"])  # one a multiple of the other
        self.other = msg

    def _messages(self) -> list[dict]:
        self._other()
        got = []
        while self.link_open and self.channel.poll():
            try:
                got.append(self.channel.recv())
            except EOFError:  # the other side stopped (idle) before this one
                self.link_open = False
        return got

    def _step_engine(self) -> list[RequestOutput]:
        e = self.engine
        return e.step() if e.has_work() else []

    def report(self) -> dict:
        """Stats, transfer counters and the result of `check` (for a front end or a test)."""
        try:
            self.check()
            check = "ok"
        except AssertionError as err:
            check = f"AssertionError: {err}\n{traceback.format_exc()}"
        return dict(role=self.role, check=check, counters=dict(self.counters),
                    stats=dataclasses.asdict(self.engine.stats()),
                    local_reshards=self.peer.local_reshards)


class PrefillWorker(Worker):
    """Runs prompts and hands requests off to a `DecodeWorker` at the other end of ``channel``."""

    role = "prefill"

    def __init__(self, engine: Engine, peer: KVPeer, channel: Connection):
        super().__init__(engine, peer, channel)
        self.connector = PrefillConnector(engine.scheduler)
        engine.use_connector(self.connector)
        self._held: dict[str, Handoff] = {}  # handed off, pages held until "landed" or abort
        self._offered: set[str] = set()  # held hand-offs whose pages were offered (exported)
        self._handed: set[str] = set()  # ids handed off, until the decode side's "finished"
        self._next_uuid = 1

    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids=None,
                    sampling_params=None, cache_salt: str | None = None) -> None:
        """Queues a request; it must fit the decode side whole (prompt plus max_tokens).
        Raises ValueError naming the field."""
        # Handed off and not finished on the decode side (the engine checks the ones it holds).
        if isinstance(request_id, str) and request_id in self._handed:
            raise ValueError(f"request_id {request_id!r} is already used by an unfinished "
                             "request")
        d = self._other()
        sp = SamplingParams() if sampling_params is None else sampling_params
        ids = self.engine.prompt_ids(prompt, prompt_token_ids)
        if isinstance(sp, SamplingParams):  # (anything else: the engine says what is wrong)
            total = len(ids) + sp.max_tokens
            if total > d["max_model_len"] or -(-(total - 1) // d["page_size"]) > d["num_pages"]:
                raise ValueError(f"request {request_id!r}: prompt ({len(ids)} tokens) + "
                                 f"max_tokens ({sp.max_tokens}) does not fit the decode side "
                                 f"(max_model_len={d['max_model_len']}, {d['num_pages']} pages)")
            if sp.n > d["max_num_seqs"]:
                raise ValueError(f"SamplingParams.n={sp.n} exceeds the decode side's "
                                 f"max_num_seqs={d['max_num_seqs']}")
        self.engine.add_request(request_id, prompt, prompt_token_ids, sp, cache_salt)

    def abort(self, request_id: str) -> None:
        """Aborts it here if the engine holds it, else frees its held pages (an offer made for
        it is still pulled by the decode side) and forwards the abort to the decode side."""
        if self.engine.has_request(request_id):
            self.engine.abort(request_id)  # (the decode side never heard of it)
            return
        if self._drop_held(request_id):
            self.counters["aborted"] += 1
        self.channel.send(dict(op="abort", request_id=request_id))

    def _drop_held(self, rid: str) -> bool:
        """Frees the pages held for a hand-off (an export already dispatched reads before
        any later program); False if none are held."""
        h = self._held.pop(rid, None)
        if h is None:
            return False
        self._offered.discard(rid)
        self.connector.release(h)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while its engine or the decode side has a request it accepted unfinished."""
        return self.engine.has_unfinished_requests() or bool(self._held) or \
            (self.link_open and bool(self._handed))

    def step(self) -> list[RequestOutput]:
        """Handles the decode side's messages, runs one engine step, sends its hand-offs."""
        for msg in self._messages():
            self._handle(msg)
        resets = self.engine.state_resets
        outputs = self._step_engine()
        if self.engine.state_resets != resets:  # a failed step lost the pool: the held pages
            self._recompute_on_decode()         # not exported yet hold zeros
        known = {id(h) for h in self._held.values()}
        for h in self.connector.handoffs:
            if id(h) not in known:
                self._send_handoff(h)
        return outputs

    def _handle(self, msg: dict) -> None:
        op, rid = msg.get("op"), msg.get("request_id")
        if op == "finished":
            self._handed.discard(rid)
            self._drop_held(rid)  # (failed there before it landed: its pages are not wanted)
            return
        if op not in ("reserve", "landed"):
            _log.error("PrefillWorker: unexpected message %r (ignored)", msg)
            return
        h = self._held.get(rid)
        if h is None:  # aborted or recomputing meanwhile: nothing offered, nothing to free
            return
        if op == "landed":
            self._release(rid)
            return
        try:
            self._offer(rid, h, msg["first"], msg["shards"])
        except Exception as e:  # noqa: BLE001 - fail this request, keep serving the rest
            error = f"{type(e).__name__}: {e}"
            _log.error("PrefillWorker: offering request %r failed: %s", rid, error,
                       exc_info=e)
            self._drop_held(rid)
            self.counters["failed"] += 1
            self.channel.send(dict(op="abort", request_id=rid, error=error))

    def _recompute_on_decode(self) -> None:
        """Frees the pages of every held hand-off not offered yet (their KV was lost with
        the pool) and has the decode side recompute those requests from their tokens."""
        for rid in [r for r in self._held if r not in self._offered]:
            self._drop_held(rid)
            self.counters["recomputed"] += 1
            self.channel.send(dict(op="recompute", request_id=rid))
        for rid in list(self._held):  # offered: their pages were exported before the failure
            self._drop_held(rid)
        self.engine.radix.clear()  # what the held pages kept through the engine's clear: lost

    def _send_handoff(self, h: Handoff) -> None:
        rid = h.seqs[0].request_id
        entry = self.engine.take_request(rid)
        first = entry.samples[0]
        samples = [dict({k: getattr(s, k) for k in CARRIED}, status=s.status.value,
                        output_token_ids=s.output_token_ids) for s in entry.samples]
        self._held[rid] = h
        self._handed.add(rid)
        self.channel.send(dict(
            op="handoff", request_id=rid, prompt=entry.prompt,
            prompt_token_ids=first.prompt_token_ids, sampling_params=first.sampling_params,
            cache_salt=first.cache_salt, arrival_index=first.arrival_index,
            arrival_time=first.arrival_time, num_tokens=h.num_tokens, samples=samples))

    def _offer(self, rid: str, h: Handoff, first: int, shards: int) -> None:
        n = -(-h.num_tokens // self.engine.page_size)
        self.counters["reused_pages"] += first
        if first >= n:  # the decode side's prefix cache held every page: nothing moves
            self._release(rid)
            return
        d, state = self._other(), self.engine.state
        pick, _ = head_maps(state.num_kv_heads, d["kv_heads"])
        if shards > len(jax.local_devices()):  # too few devices for the decode layout: one
            shards = 1                          # block, resharded after the pull
        uuid, sizes = self._next_uuid, []
        for part, size in padded_parts(h.pages[first:n], d["sizes"]):
            sizes.append(size)
            src = np.full(size, state.num_pages, np.int32)  # out of range: zeros
            src[:len(part)] = part
            payload = export_pages(state, src, None if pick is None else jnp.asarray(pick))
            self.peer.offer(self._next_uuid, payload, shards=shards)  # held until pulled
            self._next_uuid += 1
        self.counters["pages"] += n - first
        self.counters["bytes"] += (n - first) * page_bytes(state, min(state.num_kv_heads,
                                                                        d["kv_heads"]))
        self._offered.add(rid)
        self.channel.send(dict(op="offer", request_id=rid, uuid=uuid, sizes=sizes))

    def _release(self, rid: str) -> None:
        self._drop_held(rid)
        self.counters["requests"] += 1

    def check(self) -> None:
        """The engine's invariants, and that its hand-offs are exactly the ones held here."""
        self.engine.check()
        assert {id(h) for h in self._held.values()} == \
            {id(h) for h in self.connector.handoffs}, "hand-offs out of step"
        assert self._offered <= set(self._held) <= self._handed, "hand-off books out of step"
