"""Prefill/decode disaggregation across processes: each worker of
`jaxkv.disagg.remote` in its own process, serving a front end.

A front end talks to both workers over `multiprocessing.connection` (pickled dicts; the
listener's authkey authenticates both ends):

    front -> either   {"op": "hello", "role": "frontend"}                  first message
    front -> prefill  {"op": "add", "args": {request_id, prompt | prompt_token_ids,
                       sampling_params, cache_salt}}                       `add_request`'s
    front -> prefill  {"op": "abort", "request_id"}    wherever the request is
    front -> either   {"op": "stop"}                   once idle: report and exit
    either -> front   {"op": "outputs", "outputs": [RequestOutput, ...]}
    prefill -> front  {"op": "rejected", "request_id", "error"}           add_request refused
    either -> front   {"op": "stopped", "report": {role, check, counters, stats, ...}}

The prefill worker's listener also takes the decode worker's link (its first message is the
decode side's hello); the decode worker connects to it.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Client, Connection, Listener, wait

from jaxkv.disagg.kv_remote import KVPeer
from jaxkv.disagg.remote import HELLO_TIMEOUT_S, PrefillWorker, Worker
from jaxkv.disagg.remote_decode import DecodeWorker
from jaxkv.engine.engine import Engine
from jaxkv.engine.request import RequestOutput


def _serve(worker: Worker, front: Connection) -> dict:
    """Runs ``worker`` for the front end at ``front`` until it says "stop" and the worker has
    nothing left in flight; returns (and sends) the worker's report."""
    stopping = False
    while True:
        while front.poll():
            msg = front.recv()
            if msg["op"] == "add":
                try:
                    worker.add_request(**msg["args"])
                except Exception as e:  # noqa: BLE001 - a bad request must not stop the worker
                    error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                    args = msg.get("args")
                    front.send(dict(op="rejected", error=error, request_id=args.get(
                        "request_id") if isinstance(args, dict) else None))
            elif msg["op"] == "abort":
                worker.abort(msg["request_id"])
            elif msg["op"] == "stop":
                stopping = True
        outputs = worker.step()
        if outputs:
            front.send(dict(op="outputs", outputs=outputs))
        links = [front, worker.channel] if worker.link_open else [front]
        if not worker.has_unfinished_requests():
            if stopping:
                report = worker.report()
                front.send(dict(op="stopped", report=report))
                return report
            wait(links, timeout=0.05)  # idle: until a message comes
        elif not worker.engine.has_unfinished_requests():
            # Only transfers: a decode worker polls its pulls; a prefill worker waits for the
            # decode side's messages (reservations, landings, finished requests).
            wait(links, timeout=0.002 if isinstance(worker, DecodeWorker) else 0.05)


def run_prefill_worker(engine: Engine, peer: KVPeer, listener: Listener) -> dict:
    """Serves the prefill side: accepts the decode worker and the front end on ``listener``
    (either order; each opens with a hello naming its role), then runs until the front end
    says "stop". Returns the worker's report."""
    worker = front = None
    while worker is None or front is None:
        conn = listener.accept()
        if not conn.poll(HELLO_TIMEOUT_S):
            raise TimeoutError("run_prefill_worker: a connection sent no hello")
        hello = conn.recv()
        if hello.get("role") == "decode":
            worker = PrefillWorker(engine, peer, conn)
            worker.accept_hello(hello)
        else:
            front = conn
    return _serve(worker, front)


def run_decode_worker(engine: Engine, peer: KVPeer, listener: Listener, prefill_address,
                      authkey: bytes) -> dict:
    """Serves the decode side: connects to the prefill worker at ``prefill_address``, accepts
    the front end on ``listener``, then runs until the front end says "stop"."""
    worker = DecodeWorker(engine, peer, Client(prefill_address, authkey=authkey))
    front = listener.accept()
    if not front.poll(HELLO_TIMEOUT_S):
        raise TimeoutError("run_decode_worker: the front end sent no hello")
    front.recv()
    return _serve(worker, front)


class FrontEnd:
    """A minimal front end: sends requests and aborts to the prefill worker, merges both
    workers' outputs, and stops them."""

    def __init__(self, prefill_address, decode_address, authkey: bytes):
        self.conns = [Client(a, authkey=authkey) for a in (prefill_address, decode_address)]
        for c in self.conns:
            c.send(dict(op="hello", role="frontend"))
        self.rejected: dict[str, str] = {}
        self.late: list[RequestOutput] = []  # outputs that came while stopping

    def add_request(self, request_id: str, **kw) -> None:
        """`Engine.add_request`'s arguments; a refusal arrives in `rejected`."""
        self.conns[0].send(dict(op="add", args=dict(kw, request_id=request_id)))

    def abort(self, request_id: str) -> None:
        self.conns[0].send(dict(op="abort", request_id=request_id))

    def outputs(self, timeout: float = 0.1) -> list[RequestOutput]:
        """What either worker reported within ``timeout`` seconds."""
        got = []
        for c in wait(self.conns, timeout):
            while c.poll():
                msg = c.recv()
                if msg["op"] == "outputs":
                    got += msg["outputs"]
                elif msg["op"] == "rejected":
                    self.rejected[msg["request_id"]] = msg["error"]
        return got

    def stop(self, timeout: float = 60.0) -> list[dict]:
        """Stops both workers once idle; their reports (prefill, decode)."""
        for c in self.conns:
            c.send(dict(op="stop"))
        reports = []
        for c in self.conns:
            deadline = time.monotonic() + timeout
            while True:
                if not c.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("FrontEnd.stop: a worker did not stop")
                msg = c.recv()
                if msg["op"] == "stopped":
                    reports.append(msg["report"])
                    break
                self.late += msg.get("outputs", [])
        return reports
