"""Prefill/decode disaggregation across processes (`jaxkv.disagg.remote`).

The end-to-end test runs the prefill worker and the decode worker as two processes
(tests/disagg_remote_worker.py: prefill on 1 virtual CPU device, decode tensor parallel on 2,
so pages reshard by kv head on the way), the test being their front end. The in-process test
steps both workers by hand (two transfer servers in one process) to abort a request at the
two points a timing-driven run cannot reach on purpose: before the decode side reserved it,
and after the offer was made; another loses the prefill pool in a failed step while a
hand-off waits for decode room (it recomputes on the decode side).

Greedy tokens must equal a colocated engine's up to near-ties of the reference's logits (the
model is random at its initialization scale; see tests/test_disagg.py).
"""

import os
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from multiprocessing import Pipe
from pathlib import Path

import pytest
from serving import assert_same_up_to_near_ties, greedy_reference

import jaxkv
from jaxkv import Engine, ModelConfig, SamplingParams
from jaxkv.disagg.kv_remote import KVPeer
from jaxkv.disagg.remote import PrefillWorker
from jaxkv.disagg.remote_decode import DecodeWorker
from jaxkv.disagg.serve import FrontEnd

HERE = Path(__file__).resolve().parent
WORKER = HERE / "disagg_remote_worker.py"
CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                     eos_token_ids=(3,))
COLOCATED = dict(page_size=4, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32,
                 num_pages=128)
PAGE_BYTES = 2 * 2 * 4 * (2 * 16 * 4)  # layers x kv heads x page_size x (2 D x 4 B)

A = list(range(4, 25))  # 21 tokens: 6 pages of 4
B = A[:16] + [100, 101, 102, 103, 104, 105]  # 22 tokens: 6 pages, the first 4 are A's
C = list(range(40, 50))  # 10 tokens: 3 pages
LONG = list(range(60, 68))  # 8 tokens: 2 pages
X = list(range(80, 92))


@pytest.fixture(scope="module")
def model():
    return jaxkv.random_model(CONFIG, seed=0)


def reference(model, prompt, max_tokens, n=1):
    return greedy_reference(model, prompt, max_tokens, n, **COLOCATED)


def greedy(max_tokens, n=1):
    return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)


# ---- two processes ---------------------------------------------------------------------

def _start(args, authkey):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXKV_TEST_AUTHKEY=authkey.hex())
    proc = subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], cwd=HERE.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, port = [], []

    def read():  # the port line, then everything else (kept for a failure message)
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("LISTEN ") and not port:
                port.append(int(line.split()[1]))
    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 60
    while not port:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"worker {args} did not start:\n{''.join(lines)[-4000:]}")
        time.sleep(0.05)
    return proc, port[0], lines


class _Outputs:
    """The front end's merged view: the latest output of each request, from either side."""

    def __init__(self, front):
        self.front, self.latest, self.sides = front, {}, {}

    def until(self, done, what, timeout=60):
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            for out in self.front.outputs(0.05):
                self.latest[out.request_id] = out

    def finished(self, *rids):
        return all(r in self.latest and self.latest[r].finished for r in rids)


def test_two_processes_move_only_missing_pages_and_match_colocated(model):
    authkey = secrets.token_bytes(16)
    procs = []
    try:
        prefill, pport, plog = _start(["prefill", 1], authkey)
        procs.append(prefill)
        decode, dport, dlog = _start(["decode", 2, pport], authkey)
        procs.append(decode)
        front = FrontEnd(("127.0.0.1", pport), ("127.0.0.1", dport), authkey)
        got = _Outputs(front)
        front.add_request("a", prompt_token_ids=A, sampling_params=greedy(6))
        front.add_request("c", prompt_token_ids=C, sampling_params=greedy(5, n=2))
        got.until(lambda: got.finished("a", "c"), "a and c")
        front.add_request("b", prompt_token_ids=B, sampling_params=greedy(6))  # A's pages cached
        got.until(lambda: got.finished("b"), "b")

        # "long" (n=2) takes both decode slots; "x" is handed off and waits for room there,
        # and is aborted then (its first token already out), before "long" can finish.
        front.add_request("long", prompt_token_ids=LONG, sampling_params=greedy(200, n=2))
        got.until(lambda: "long" in got.latest and
                  len(got.latest["long"].outputs[0].token_ids) > 1, "long decoding")
        front.add_request("long", prompt_token_ids=C, sampling_params=greedy(2))  # in use
        got.until(lambda: "long" in front.rejected, "the duplicate id refused")
        assert "request_id 'long'" in front.rejected["long"]
        front.add_request("x", prompt_token_ids=X, sampling_params=greedy(5))
        got.until(lambda: "x" in got.latest, "x's first token")
        front.abort("x")
        front.abort("long")
        got.until(lambda: got.finished("x", "long"), "the aborts")
        reports = front.stop()
        for proc in procs:
            proc.wait(timeout=30)
    except BaseException:
        for proc in procs:
            proc.kill()
        logs = "".join(plog if procs else []) + "".join(dlog if len(procs) > 1 else [])
        print(logs[-6000:])
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    p, d = reports
    assert [p["role"], d["role"]] == ["prefill", "decode"]
    for r in reports:
        assert r["check"] == "ok", r["check"]
        assert r["stats"]["kv_pages_used"] == 0, r
    # Pages moved: a 6, c 3, b 2 (4 of its 6 were in the decode side's prefix cache), long 2;
    # x none (aborted before the decode side had room): 13 of the 17 prompt pages of the
    # requests that landed.
    for r in reports:
        assert r["counters"]["pages"] == 13 and r["counters"]["reused_pages"] == 4, r
        assert r["counters"]["bytes"] == 13 * PAGE_BYTES
    assert p["counters"]["requests"] == 4 and d["counters"]["requests"] == 4
    assert p["counters"]["aborted"] == 1 and d["counters"]["aborted"] == 1  # x, in transfer
    assert d["local_reshards"] == 4  # one part each, pulled onto 1 device, split over 2
    assert p["stats"]["generated_tokens"] == 1 + 2 + 1 + 2 + 1  # first tokens only

    assert got.latest["x"].outputs[0].finish_reason == "abort"
    assert len(got.latest["x"].outputs[0].token_ids) == 1
    assert got.latest["long"].outputs[0].finish_reason == "abort"
    for rid, prompt, max_tokens, n in (("a", A, 6, 1), ("b", B, 6, 1), ("c", C, 5, 2)):
        outs = got.latest[rid].outputs
        assert len(outs) == n
        for c, want in zip(outs, reference(model, prompt, max_tokens, n), strict=True):
            assert c.finish_reason == "length"
            assert_same_up_to_near_ties(c.token_ids, want)


# ---- one process, stepped by hand ------------------------------------------------------

def _pair(model, **decode):
    shape = dict(page_size=4, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
                 num_pages=32)
    a, b = Pipe()
    return (PrefillWorker(Engine(model, **shape), KVPeer("127.0.0.1:0"), a),
            DecodeWorker(Engine(model, **dict(shape, **decode)), KVPeer("127.0.0.1:0"), b))


def _stepper(outs):
    def step(w):
        for o in w.step():
            outs[o.request_id] = o
        w.check()
    return step


def _in_use(engine):
    """Pages some request holds (running, handed off, reserved for an arrival): those whose
    refcount exceeds the prefix cache's references, counted from the allocator, not `stats`."""
    radix = Counter(engine.radix.held_pages()) if engine.radix is not None else Counter()
    return sum(engine.allocator.refcount(p) > radix[p] for p in range(engine.num_pages))


def _until(fn, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.002)  # pulls arrive in the background


def test_aborts_before_reservation_and_after_the_offer_free_both_sides(model):
    p, d = _pair(model, max_decode_steps=1)  # (one token a step: "after" lands, then decodes)
    outs = {}
    step = _stepper(outs)

    # 1. Handed off, the decode side has not seen it yet: the abort follows the hand-off.
    p.add_request("early", prompt_token_ids=A, sampling_params=greedy(4))
    _until(lambda: step(p) or "early" in p._held, "early handed off")
    assert _in_use(p.engine) == 6  # A's 21 tokens, held for the hand-off
    with pytest.raises(ValueError, match="request_id 'early'"):
        p.add_request("early", prompt_token_ids=C, sampling_params=greedy(2))
    p.abort("early")
    assert _in_use(p.engine) == 0
    step(d)
    assert not d._incoming and not d.connector.arrivals and _in_use(d.engine) == 0
    assert outs["early"].finished and outs["early"].outputs[0].finish_reason == "abort"
    assert len(outs["early"].outputs[0].token_ids) == 1
    assert "early" in p._handed  # until the decode side says it finished
    step(p)
    assert not p._handed and not p.has_unfinished_requests()

    # 2. Reserved and offered, the decode side told of the offer and the abort in one read:
    # it starts the pull anyway (else the offer would stay on the prefill side) and drops it.
    p.add_request("late", prompt_token_ids=C, sampling_params=greedy(4, n=2))
    _until(lambda: step(p) or "late" in p._held, "late handed off")
    step(d)  # reserves, answers with the missing pages
    assert d._incoming["late"].arrival is not None
    assert _in_use(d.engine) == 3  # C's 10 tokens: 3 pages the two samples share
    step(p)  # offers them
    assert _in_use(p.engine) == 3
    p.abort("late")
    assert _in_use(p.engine) == 0
    step(d)  # (the pull may even finish within this step)
    assert not d._incoming and not d.connector.arrivals and _in_use(d.engine) == 0
    assert d.counters["pages"] == p.counters["pages"] == 3  # late's pull was started
    _until(lambda: step(d) or not d._draining, "the drained pull")
    assert outs["late"].outputs[0].finish_reason == "abort" and len(outs["late"].outputs) == 2

    # 3. Both sides keep serving: a request after the aborts matches colocated serving. Its
    # id is refused while it decodes on the decode side, and free again once it finished.
    p.add_request("after", prompt_token_ids=B, sampling_params=greedy(5))
    _until(lambda: step(p) or "after" in p._held, "after handed off")
    step(d)  # reserves
    step(p)  # offers
    _until(lambda: step(d) or "after" in d.engine._requests, "after landed")
    step(p)  # reads "landed": its pages are freed, its id stays in use
    assert "after" not in p._held and not outs["after"].finished
    with pytest.raises(ValueError, match="request_id 'after'"):
        p.add_request("after", prompt_token_ids=C, sampling_params=greedy(2))
    _until(lambda: step(p) or step(d) or ("after" in outs and outs["after"].finished),
           "after finished")
    assert_same_up_to_near_ties(outs["after"].outputs[0].token_ids,
                                reference(model, B, 5)[0])
    _until(lambda: step(p) or not p.has_unfinished_requests(), "the decode side's finished")
    for w in (p, d):
        report = w.report()
        assert report["check"] == "ok" and report["stats"]["kv_pages_used"] == 0, report
        assert report["counters"]["aborted"] == 2, report
        assert _in_use(w.engine) == 0
    assert d.counters["pages"] == p.counters["pages"]
    p.add_request("after", prompt_token_ids=C, sampling_params=greedy(2))  # the id is free
    _until(lambda: step(p) or step(d) or outs["after"].finished, "the second after")
    assert outs["after"].prompt_token_ids == C


def test_a_failed_prefill_step_that_loses_the_pool_recomputes_waiting_handoffs(model):
    from test_faults import faulty

    p, d = _pair(model, max_num_seqs=2, max_decode_steps=1)  # "long" (n=2): both slots
    outs = {}
    step = _stepper(outs)
    p.add_request("long", prompt_token_ids=LONG, sampling_params=greedy(30, n=2))
    _until(lambda: step(p) or step(d) or "long" in d.engine._requests, "long decoding")
    p.add_request("stray", prompt_token_ids=X, sampling_params=greedy(3))
    p.add_request("next", prompt_token_ids=B, sampling_params=greedy(5))
    _until(lambda: step(p) or step(d) or {"stray", "next"} <= set(d._incoming),
           "both handed off, waiting for decode room")
    assert d._incoming["next"].arrival is None and set(p._held) == {"stray", "next"}
    assert _in_use(p.engine) == 3 + 6

    # An offer the decode side cannot act on (an unknown request; one it has no room for)
    # is logged and fails that request only; the prefill side frees its pages on "finished".
    p.channel.send(dict(op="offer", request_id="ghost", uuid=10**6))
    p.channel.send(dict(op="offer", request_id="stray", uuid=10**6))
    step(d)
    assert outs["stray"].finished and outs["stray"].outputs[0].finish_reason == "error"
    assert "no reservation" in outs["stray"].error
    step(p)
    assert set(p._held) == {"next"} and "stray" not in p._handed
    assert _in_use(p.engine) == 6

    # The prefill engine's next step ("doomed") fails and loses its pool: "next", not offered
    # yet, must not move zeroed pages; it recomputes on the decode side once "long" is done.
    p.engine.steps = faulty(p.engine.steps, fail_at=1, mode="consume")
    p.add_request("doomed", prompt_token_ids=C, sampling_params=greedy(3))
    step(p)
    assert outs["doomed"].outputs[0].finish_reason == "error"
    assert p.engine.state_resets == 1 and not p._held and _in_use(p.engine) == 0
    computed = d.engine.stats().computed_prompt_tokens
    step(d)
    assert "next" not in d._incoming and "next" in d.engine._requests
    assert not outs["long"].finished  # "next" waits for room (its tokens, to recompute)
    _until(lambda: step(p) or step(d) or not p.has_unfinished_requests(), "all finished")
    assert d.engine.stats().computed_prompt_tokens >= computed + len(B)  # recomputed
    assert_same_up_to_near_ties(outs["next"].outputs[0].token_ids, reference(model, B, 5)[0])
    long = outs["long"].outputs
    for c, want in zip(long, reference(model, LONG, 30, 2), strict=True):
        assert c.finish_reason == "length"
        assert_same_up_to_near_ties(c.token_ids, want)
    assert outs["next"].outputs[0].finish_reason == "length"
    assert p.counters["recomputed"] == d.counters["recomputed"] == 1
    assert not d.has_unfinished_requests() and not d._known
    for w in (p, d):
        assert w.report()["check"] == "ok"
        assert _in_use(w.engine) == 0 and w.engine.stats().kv_pages_used == 0


def test_an_offer_for_a_reservation_the_decode_side_cancelled_is_drained(model):
    """The decode side loses its pool after reserving for "r" but before r's offer comes: r
    recomputes there, and the offer that still arrives is pulled and dropped, not left on the
    prefill side's transfer server."""
    from test_faults import faulty

    p, d = _pair(model, max_decode_steps=1)
    outs = {}
    step = _stepper(outs)
    p.add_request("busy", prompt_token_ids=LONG, sampling_params=greedy(30))
    _until(lambda: step(p) or step(d) or "busy" in d.engine._requests, "busy decoding")
    p.add_request("r", prompt_token_ids=A, sampling_params=greedy(4))
    _until(lambda: step(p) or "r" in p._held, "r handed off")
    d.engine.steps = faulty(d.engine.steps, fail_at=1, mode="consume")
    step(d)  # reserves for r; then its step fails and loses the pool: r recomputes here
    assert d.engine.state_resets == 1 and "r" not in d._incoming and d.engine.has_request("r")
    step(p)  # reads the reservation: offers r's pages
    assert "r" in p._offered
    step(d)
    assert d.counters["drained_offers"] == 1
    _until(lambda: step(p) or step(d) or not p.has_unfinished_requests(), "all finished")
    _until(lambda: step(d) or not d._draining, "the drained offer")
    assert outs["busy"].outputs[0].finish_reason == "error"  # it was in the failed step
    assert outs["r"].outputs[0].finish_reason == "length"
    assert_same_up_to_near_ties(outs["r"].outputs[0].token_ids, reference(model, A, 4)[0])
    for w in (p, d):
        assert w.report()["check"] == "ok"
        assert _in_use(w.engine) == 0 and w.engine.stats().kv_pages_used == 0
