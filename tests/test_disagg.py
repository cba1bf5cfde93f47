"""Prefill/decode disaggregation (`DisaggregatedEngine`) on one device: the two engines, the
hand-off, the page transfer, aborts at every stage, and tokens equal to colocated serving.

The model is random at its initialization scale (no sharpened logits): greedy tokens must
equal the colocated engine's, except where the two part at a near-tie of the reference's
logits (prefill chunks differ between the two, and logits differ in their last bits across
step shapes; see tests/test_determinism.py).
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import assert_same_up_to_near_ties, drive, greedy_reference

import jaxkv
from jaxkv import Engine, SamplingParams
from jaxkv.disagg import DisaggregatedEngine, kv_transfer
from jaxkv.disagg.transport import FakeTransport

SHAPE = dict(page_size=4, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16)
PREFILL = dict(SHAPE, num_pages=24)
DECODE = dict(SHAPE, num_pages=14)  # small: decode-side preemption and waiting arrivals
COLOCATED = dict(SHAPE, num_pages=32)


def disaggregated(model, lockstep=False, transport=kv_transfer.PageMover, **kw):
    """The engines step independently unless ``lockstep`` (a reproducible interleaving, for
    tests that need one stage to be reached before another)."""
    return DisaggregatedEngine(Engine(model, **dict(PREFILL, **kw)),
                               Engine(model, **dict(DECODE, **kw)), lockstep=lockstep,
                               transport=transport)


_REF: dict = {}


def reference(model, prompt: tuple, max_tokens: int, n: int):
    """Greedy tokens (and top-2 logprobs) of a request served alone by a colocated engine
    (memoized across examples)."""
    key = (prompt, max_tokens, n)
    if key not in _REF:
        _REF[key] = greedy_reference(model, prompt, max_tokens, n, **COLOCATED)
    return _REF[key]


@st.composite
def traces(draw):
    prefixes = [draw(st.lists(st.integers(4, 96), min_size=4, max_size=14)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(2, 6))):
        head = draw(st.sampled_from([[], *prefixes]))
        tail = draw(st.lists(st.integers(4, 96), min_size=1, max_size=10))
        requests.append(dict(
            rid=f"r{i}", prompt=head + tail, max_tokens=draw(st.integers(1, 20)),
            n=draw(st.sampled_from([1, 1, 2])),
            arrive=draw(st.integers(0, 6)),
            abort=draw(st.one_of(st.none(), st.integers(0, 10))),  # steps after arrival
        ))
    return requests


def run_trace(model, trace, engine) -> tuple[dict, set]:
    finished, aborted, added = {}, set(), set()
    for step in range(400):
        for r in trace:
            if r["arrive"] == step:
                engine.add_request(r["rid"], prompt_token_ids=r["prompt"],
                                   sampling_params=SamplingParams(
                                       temperature=0, max_tokens=r["max_tokens"], n=r["n"],
                                       ignore_eos=True))
                added.add(r["rid"])
            if r["abort"] is not None and r["arrive"] + r["abort"] == step \
                    and r["rid"] in added and r["rid"] not in finished:
                engine.abort(r["rid"])
                aborted.add(r["rid"])
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                finished[out.request_id] = out
        engine.check()
        if len(added) == len(trace) and not engine.has_unfinished_requests():
            return finished, aborted
    raise AssertionError("the trace did not finish")


def check_trace(model, trace):
    engine = disaggregated(model)
    finished, aborted = run_trace(model, trace, engine)
    # every request that finished past its first token decoded on the decode side
    assert engine.transfers.requests >= sum(r["max_tokens"] > 1 for r in trace
                                            if r["rid"] not in aborted)
    for r in trace:
        if r["rid"] in aborted:
            continue
        outs = finished[r["rid"]].outputs
        ref = reference(model, tuple(r["prompt"]), r["max_tokens"], r["n"])
        assert len(outs) == r["n"]
        for c, want in zip(outs, ref, strict=True):
            assert c.finish_reason == "length"
            assert_same_up_to_near_ties(c.token_ids, want)
    return engine


def leftovers(engine) -> tuple[int, int, int, int]:
    """Once idle: (pages in use on either side, pages neither cached nor free, hand-offs
    held, arrivals reserved); all 0 when nothing leaked."""
    per = [side.stats() for side in (engine.prefill, engine.decode)]
    return (sum(s.kv_pages_used for s in per),
            sum(s.kv_pages_total - s.kv_pages_cached - s.kv_pages_free for s in per),
            len(engine.handoffs.handoffs), len(engine.arrivals.arrivals))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_random_traces_match_colocated_and_keep_both_books(plain_model, trace):
    assert leftovers(check_trace(plain_model, trace)) == (0, 0, 0, 0)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces())
def test_random_traces_match_colocated_and_keep_both_books_long(plain_model, trace):
    assert leftovers(check_trace(plain_model, trace)) == (0, 0, 0, 0)


def test_the_trace_shape_preempts_on_the_decode_side_and_makes_arrivals_wait(plain_model):
    # The pools above must force decode-side preemption and waiting hand-offs for the trace
    # property to cover them.
    rng = np.random.default_rng(0)
    engine = disaggregated(plain_model, lockstep=True)
    waited = False
    for i in range(5):
        engine.add_request(str(i), prompt_token_ids=rng.integers(4, 96, 14).tolist(),
                           sampling_params=SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
        waited |= bool(engine.handoffs.handoffs)  # handed off, no decode room yet
    assert engine.decode.stats().preemptions > 0
    assert waited


def test_only_the_pages_the_decode_side_lacks_move(plain_model):
    engine = disaggregated(plain_model)
    rng = np.random.default_rng(1)
    first = rng.integers(4, 96, 21).tolist()  # 6 pages of 4 (the last holds 1 token)
    second = first[:16] + rng.integers(4, 96, 6).tolist()  # shares 4 whole pages
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=first, sampling_params=greedy)
    drive(engine)
    assert (engine.transfers.pages, engine.transfers.reused_pages) == (6, 0)
    engine.add_request("b", prompt_token_ids=second, sampling_params=greedy)
    drive(engine)
    # 22 prompt tokens = 6 pages, 4 of them in the decode side's prefix cache: 2 move.
    assert (engine.transfers.pages, engine.transfers.reused_pages) == (8, 4)
    stats = engine.stats()
    assert stats.kv_transfers == 2 and stats.kv_pages_transferred == 8
    # bytes per page: 2 layers x 2 kv heads x 4 tokens x (2 x 16 x 4 B)
    assert stats.kv_bytes_transferred == 8 * 2 * 2 * 4 * 128


def test_a_prompt_that_fits_only_the_prefill_pool_whole_is_accepted(plain_model):
    # The prefill side holds a request until its first token: prompt + 1 must fit there, and
    # prompt + max_tokens on the decode side.
    engine = DisaggregatedEngine(Engine(plain_model, **dict(SHAPE, num_pages=6)),
                                 Engine(plain_model, **dict(SHAPE, num_pages=12)))
    prompt = list(range(4, 24))  # 20 tokens: 5 pages
    engine.add_request("a", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=26, ignore_eos=True))  # 45 tokens: 12 pages
    out = drive(engine)["a"].outputs[0]
    assert len(out.token_ids) == 26
    with pytest.raises(ValueError, match="needs 15 KV pages"):  # the decode pool: 12
        engine.add_request("b", prompt_token_ids=prompt, sampling_params=SamplingParams(
            max_tokens=40, ignore_eos=True))
    assert not engine.has_unfinished_requests()


def _stuck_handoff(model):
    """An engine whose decode side has one slot, held by a request decoding 200 tokens (so
    the next hand-off waits for room), and a second request just handed off."""
    engine = DisaggregatedEngine(
        Engine(model, **dict(SHAPE, num_pages=24)),
        Engine(model, **dict(SHAPE, num_pages=64, max_num_seqs=1, max_model_len=256)),
        lockstep=True)
    engine.add_request("long", prompt_token_ids=list(range(4, 12)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=200,
                                                      ignore_eos=True))
    while engine.location("long") != "decode":
        engine.step()
    engine.add_request("next", prompt_token_ids=list(range(30, 52)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=4,
                                                      ignore_eos=True))
    while engine.location("next") == "prefill":
        engine.step()
        engine.check()
    return engine


def test_abort_of_a_handoff_waiting_for_decode_room_frees_its_prefill_pages(plain_model):
    engine = _stuck_handoff(plain_model)
    assert len(engine.handoffs.handoffs) == 1
    assert engine.prefill.stats().kv_pages_used == 6  # 22 prompt tokens held for the copy
    held = engine.prefill.stats().kv_pages_free
    engine.abort("next")
    engine.check()
    assert not engine.handoffs.handoffs
    # its pages stay only in the prefill prefix cache (evictable), none held for it
    assert engine.prefill.stats().kv_pages_used == 0
    assert engine.prefill.stats().kv_pages_free + engine.prefill.stats().kv_pages_cached \
        == engine.prefill.num_pages and held < engine.prefill.num_pages
    outs = {o.request_id: o for o in engine.step()}
    assert outs["next"].finished and outs["next"].outputs[0].finish_reason == "abort"
    drive(engine)
    assert engine.decode.stats().kv_pages_used == 0
    with pytest.raises(ValueError, match="request_id"):
        engine.abort("next")


def test_abort_of_a_transfer_in_flight_frees_its_decode_pages(plain_model):
    engine = disaggregated(plain_model, lockstep=True, transport=FakeTransport)
    engine.mover.hold = True  # nothing lands
    engine.add_request("a", prompt_token_ids=list(range(4, 30)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=5, n=2,
                                                      ignore_eos=True))
    engine.add_request("b", prompt_token_ids=list(range(40, 50)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True))
    for _ in range(20):
        engine.step()
        engine.check()
        if len(engine.arrivals.arrivals) == 2:
            break
    assert len(engine.arrivals.arrivals) == 2  # both reserved, neither landed
    assert engine.decode.stats().kv_pages_free < engine.decode.num_pages
    engine.abort("a")
    engine.check()
    assert len(engine.arrivals.arrivals) == 1
    engine.mover.hold = False
    outs = drive(engine)
    assert outs["a"].outputs[0].finish_reason == "abort" and len(outs["a"].outputs) == 2
    assert outs["b"].outputs[0].finish_reason == "length"
    assert engine.decode.stats().kv_pages_used == 0 and engine.transfers.aborted == 1


def test_streamed_outputs_arrive_from_both_sides_in_order(plain_model):
    engine = disaggregated(plain_model)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                        output_kind=jaxkv.RequestOutputKind.DELTA)
    engine.add_request("a", prompt_token_ids=list(range(4, 15)), sampling_params=sp)
    got = []
    while engine.has_unfinished_requests():
        got += [t for o in engine.step() for t in o.outputs[0].token_ids]
        engine.check()
    want, _ = reference(plain_model, tuple(range(4, 15)), 6, 1)[0]
    assert got == want


@pytest.mark.parametrize("field, value", [("page_size", 8), ("kv_cache_dtype", "int8")])
def test_engines_that_cannot_share_pages_are_refused(plain_model, field, value):
    with pytest.raises(ValueError, match=field):
        DisaggregatedEngine(Engine(plain_model, **PREFILL),
                            Engine(plain_model, **dict(DECODE, **{field: value})))


def test_head_maps_pick_and_spread_copies_of_the_same_original_head():
    # A pool of Kp heads holds original head j * K // Kp at head j (jaxkv.sharding.shard).
    original = 2
    for kp, kd in [(2, 4), (4, 2), (2, 8), (8, 4), (4, 4)]:
        pick, spread = kv_transfer.head_maps(kp, kd)
        sent = np.arange(kp) if pick is None else pick
        landed = sent if spread is None else sent[spread]
        assert [h * original // kp for h in landed] == \
            [j * original // kd for j in range(kd)], (kp, kd)
    with pytest.raises(ValueError, match="multiple"):
        kv_transfer.head_maps(4, 6)


def test_llm_disaggregation_arguments_are_checked():
    import jax
    one = jax.devices()[:1]
    with pytest.raises(ValueError, match="decode_devices"):
        jaxkv.LLM(None, prefill_devices=one)
    with pytest.raises(ValueError, match="overlap"):
        jaxkv.LLM(None, prefill_devices=one, decode_devices=one)
    with pytest.raises(ValueError, match="prefill_devices lists 1 devices for "
                       "prefill_tensor_parallel_size=2"):
        jaxkv.LLM(None, prefill_devices=one, decode_devices=one, prefill_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        jaxkv.LLM(None, prefill_devices=one, decode_devices=one, data_parallel_size=2)


def test_a_failed_prefill_step_that_loses_the_pool_sends_waiting_handoffs_to_recompute(
        plain_model):
    from test_faults import faulty

    engine = _stuck_handoff(plain_model)  # "next" holds prefill pages, waiting for room
    calls = engine.prefill.steps
    engine.prefill.steps = faulty(calls, fail_at=1, mode="consume")  # its next step loses it
    engine.add_request("doomed", prompt_token_ids=list(range(60, 70)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=3))
    outs = drive(engine)
    assert outs["doomed"].outputs[0].finish_reason == "error"
    assert engine.prefill.state_resets == 1
    assert not engine.handoffs.handoffs
    want = reference(plain_model, tuple(range(30, 52)), 4, 1)[0]
    assert_same_up_to_near_ties(outs["next"].outputs[0].token_ids, want)
    assert engine.decode.stats().computed_prompt_tokens >= 22  # recomputed there
    assert outs["long"].outputs[0].finish_reason == "length"
    # The prefill prefix cache kept no entry of the lost pool (the hand-off held its pages
    # through the engine's own clear): the same prompt again is computed afresh.
    engine.add_request("again", prompt_token_ids=list(range(30, 52)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=4,
                                                      ignore_eos=True))
    again = drive(engine)["again"]
    assert again.num_cached_tokens == 0
    assert_same_up_to_near_ties(again.outputs[0].token_ids, want)


def test_update_params_swaps_both_sides_recomputes_transfers_and_compiles_nothing(
        plain_model, tiny_config):
    from jaxkv.runtime.compiles import count_compiles

    new = jaxkv.random_model(tiny_config, seed=1)
    prompt = list(range(4, 26))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = disaggregated(plain_model, transport=FakeTransport)
    engine.add_request("warm", prompt_token_ids=prompt, sampling_params=greedy)
    drive(engine)  # compiles what the repeat below runs
    hits = engine.prefill.stats().cached_prompt_tokens
    with count_compiles() as compiles:
        engine.update_params(new)
        assert engine.weight_version == 1 == engine.prefill.weight_version
        engine.add_request("again", prompt_token_ids=prompt, sampling_params=greedy)
        out = drive(engine)["again"].outputs[0]
    assert compiles.count == 0
    assert engine.prefill.stats().cached_prompt_tokens == hits  # no stale hit on either side
    assert engine.transfers.reused_pages == 0
    assert out.weight_versions == [1] * 6
    fresh = Engine(new, **COLOCATED)
    fresh.add_request("x", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=2))
    got = drive(fresh)["x"].outputs[0]
    assert_same_up_to_near_ties(out.token_ids, (got.token_ids, got.logprobs))

    # A request whose KV is in transfer when the weights change recomputes it on the decode
    # side: its first token came from version 1, the rest from version 2.
    engine.mover.hold = True
    engine.add_request("moving", prompt_token_ids=prompt[:13], sampling_params=greedy)
    while not engine.arrivals.arrivals:
        engine.step()
    engine.mover.hold = False
    engine.update_params(plain_model.params)  # version 2: the first weights again
    engine.check()
    assert not engine.arrivals.arrivals and not engine.num_in_transfer()
    moved = drive(engine)["moving"].outputs[0]
    assert moved.weight_versions == [1] + [2] * 5
    first = moved.token_ids[0]
    tail = reference(plain_model, tuple(prompt[:13] + [first]), 5, 1)[0]
    assert_same_up_to_near_ties(moved.token_ids[1:], tail)


def test_after_warmup_disaggregated_serving_compiles_nothing(plain_model):
    from jaxkv.runtime.compiles import count_compiles

    engine = disaggregated(plain_model)
    assert engine.warmup() > 0  # both engines' programs and the transfer's
    rng = np.random.default_rng(5)
    with count_compiles() as compiles:
        for i in range(5):
            engine.add_request(str(i), prompt_token_ids=rng.integers(
                4, 96, int(rng.integers(3, 30))).tolist(), sampling_params=SamplingParams(
                temperature=0, max_tokens=int(rng.integers(1, 20)), n=1 + i % 2,
                ignore_eos=True))
        drive(engine)
    assert compiles.count == 0
    assert engine.transfers.requests == 5


def test_both_engines_keep_stepping_while_a_transfer_is_in_flight(plain_model):
    engine = disaggregated(plain_model, lockstep=True, transport=FakeTransport)
    engine.add_request("c", prompt_token_ids=list(range(4, 12)), sampling_params=SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))
    while engine.location("c") != "decode":
        engine.step()
    engine.mover.hold = True  # a slow link
    engine.add_request("a", prompt_token_ids=list(range(20, 40)), sampling_params=SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("b", prompt_token_ids=list(range(50, 80)), sampling_params=SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True))
    progress, done = {"a": 0, "b": 0, "c": 0}, {}
    for _ in range(6):
        for out in engine.step():
            progress[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = out
        engine.check()
    # "a" and "b" were prefilled (first tokens out) and wait in flight; "c" decoded meanwhile.
    assert engine.location("a") == engine.location("b") == "move"
    assert len(engine.arrivals.arrivals) == 2 and progress["c"] > 1
    assert progress["a"] == progress["b"] == 1
    engine.mover.hold = False
    done.update(drive(engine))
    assert [len(done[r].outputs[0].token_ids) for r in "abc"] == [3, 3, 12]


@pytest.mark.parametrize("stream", [True, False])
def test_pages_of_a_prompt_still_prefilling_stream_to_the_decode_side(plain_model, stream):
    engine = DisaggregatedEngine(Engine(plain_model, **PREFILL), Engine(plain_model, **DECODE),
                                 stream_pages=stream)
    prompt = list(range(4, 44))  # 40 tokens, 10 pages; chunks of 16 end at 16, 32, 40
    engine.add_request("a", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.transfers.streamed_pages == (4 if stream else 0)  # chunk 1's pages
    out = drive(engine)["a"].outputs[0]
    assert engine.transfers.streamed_pages == (8 if stream else 0)  # chunk 3's go at hand-off
    assert engine.transfers.pages == 10 and engine.transfers.reused_pages == 0
    assert_same_up_to_near_ties(out.token_ids, reference(plain_model, tuple(prompt), 4, 1)[0])
    # A second prompt (50 tokens, 13 pages) sharing 5 whole pages: the prefill side's cache
    # serves them, the decode side's holds them, so neither the stream (pages 5-8, after the
    # chunk ending at 36) nor the hand-off (pages 9-12) sends them.
    second = prompt[:20] + list(range(60, 90))
    engine.add_request("b", prompt_token_ids=second, sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True))
    out = drive(engine)["b"].outputs[0]
    assert engine.transfers.streamed_pages == (8 + 4 if stream else 0)
    assert engine.transfers.pages == 10 + 8 and engine.transfers.reused_pages == 5
    assert_same_up_to_near_ties(out.token_ids, reference(plain_model, tuple(second), 4, 1)[0])


def test_a_prompt_whose_last_chunk_is_one_token_is_handed_off(plain_model):
    # 17 tokens at a budget of 16: the last chunk is a single token, a "decode-shaped" row;
    # the prefill engine must not run it as a decode loop and keep the request.
    engine = disaggregated(plain_model)
    prompt = list(range(4, 21))
    engine.add_request("a", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))
    out = drive(engine)["a"].outputs[0]
    assert engine.transfers.requests == 1
    assert engine.prefill.stats().generated_tokens == 1  # only the first token
    assert_same_up_to_near_ties(out.token_ids, reference(plain_model, tuple(prompt), 12, 1)[0])


class _Gated:
    """A dispatched step's reader that reports "not finished" until the gate opens."""

    def __init__(self, read, gate):
        self.read, self.gate = read, gate

    def __call__(self):
        return self.read()

    def ready(self):
        return self.gate["open"] and self.read.ready()


def gated(side: Engine) -> dict:
    """Makes ``side``'s dispatched steps look unfinished until ``gate["open"]`` is set."""
    gate, dispatch = {"open": False}, side.dispatch

    def slow():
        d = dispatch()
        return d if d.read is None else dataclasses.replace(d, read=_Gated(d.read, gate))

    side.dispatch = slow
    return gate


def test_decode_steps_do_not_wait_for_a_prefill_step_in_flight(plain_model):
    engine = disaggregated(plain_model)
    engine.add_request("c", prompt_token_ids=list(range(4, 12)), sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True))
    while engine.location("c") != "decode":
        engine.step()
    gate = gated(engine.prefill)  # its steps look unfinished while the gate is shut
    engine.add_request("a", prompt_token_ids=list(range(20, 60)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=3,
                                                      ignore_eos=True))
    seen = []
    for _ in range(3):  # a decode loop per step; the prefill step stays in flight
        seen += [len(o.outputs[0].token_ids) for o in engine.step() if o.request_id == "c"]
        assert engine.has_step_in_flight(engine.prefill)
        engine.check()
    assert len(seen) == 3 and seen[-1] > seen[0]
    gate["open"] = True
    done = drive(engine)
    assert len(done["a"].outputs[0].token_ids) == 3


def test_a_failed_decode_step_that_loses_the_pool_recomputes_reserved_arrivals(
        plain_model):
    from test_faults import faulty

    engine = disaggregated(plain_model, lockstep=True, transport=FakeTransport)
    shared = list(range(4, 20))  # 4 whole pages, cached on the decode side once "c" lands
    engine.add_request("c", prompt_token_ids=shared + [30, 31], sampling_params=SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True))
    while engine.location("c") != "decode":
        engine.step()
    engine.mover.hold = True
    prompt = shared + list(range(40, 46))
    engine.add_request("a", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True))
    while not engine.arrivals.arrivals:
        engine.step()
    assert engine.arrivals.arrivals[0].num_shared == 4  # pages of the decode pool
    engine.decode.steps = faulty(engine.decode.steps, fail_at=1, mode="consume")
    engine.mover.hold = False
    done = drive(engine)
    assert engine.decode.state_resets == 1
    assert done["c"].outputs[0].finish_reason == "error"
    assert_same_up_to_near_ties(done["a"].outputs[0].token_ids,
                                reference(plain_model, tuple(prompt), 5, 1)[0])
    assert engine.decode.stats().kv_pages_used == 0


def test_an_abort_deferred_by_a_step_in_flight_spares_a_new_request_with_the_same_id(
        plain_model):
    engine = disaggregated(plain_model)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("x", prompt_token_ids=list(range(4, 12)), sampling_params=greedy)
    while engine.location("x") != "decode":
        engine.step()
    gate = gated(engine.decode)  # its steps look unfinished while the gate is shut
    engine.add_request("busy", prompt_token_ids=list(range(20, 50)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    assert engine.has_step_in_flight(engine.decode)
    engine.abort("x")  # deferred: the decode engine's step holding "x" is in flight
    new = list(range(60, 70))
    engine.add_request("x", prompt_token_ids=new, sampling_params=SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True))
    gate["open"] = True
    ends = []
    while engine.has_unfinished_requests():
        ends += [o for o in engine.step() if o.finished and o.request_id == "x"]
        engine.check()
    reasons = [o.outputs[0].finish_reason for o in ends]
    assert reasons == ["abort", "length"]  # the old one aborted, the new one served whole
    (tokens, _), = greedy_reference(plain_model, new, 5, **COLOCATED)
    assert ends[1].outputs[0].token_ids == tokens
    assert engine.prefill.stats().kv_pages_used == engine.decode.stats().kv_pages_used == 0
