"""Several decode steps per host round trip (`decode_loop`): the same tokens and the same finish
reasons as one step at a time, with stop checks, min/max tokens and page reservation on device;
and no program copies the KV pool."""

import numpy as np
import pytest
from serving import drive

from jaxkv import Engine, SamplingParams
from jaxkv.engine.warmup import idle_decode_loop
from jaxkv.runtime.batch import padding_batch

SHAPE = dict(page_size=4, num_pages=40, max_num_seqs=4, max_model_len=96,
             max_num_batched_tokens=16)


def _serve(model, requests, **kw):
    engine = Engine(model, **dict(SHAPE, **kw))
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=sp)
    final = drive(engine)  # Engine.check() after every step
    assert engine.stats().kv_pages_used == 0
    return {rid: [(c.token_ids, c.finish_reason) for c in out.outputs]
            for rid, out in final.items()}, engine


def _requests(vocab, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(6):
        prompt = rng.integers(4, vocab, int(rng.integers(2, 20))).tolist()
        kinds = [dict(temperature=0, ignore_eos=True),
                 dict(temperature=0, stop_token_ids=[int(t) for t in rng.integers(4, vocab, 6)]),
                 dict(temperature=0, min_tokens=5, stop_token_ids=list(range(4, 34, 2))),
                 dict(temperature=0.8, top_k=8, seed=i),
                 dict(temperature=1.0, top_p=0.9, seed=i),
                 dict(temperature=0)]  # EOS (token 3) ends it
        out.append((f"r{i}", prompt,
                    SamplingParams(max_tokens=int(rng.integers(1, 30)), **kinds[i % len(kinds)])))
    return out


@pytest.mark.parametrize("seed, pipelined", [(0, True), (1, True), (1, False)])
def test_loop_gives_the_tokens_of_single_steps(tiny_model, tiny_config, seed, pipelined):
    requests = _requests(tiny_config.vocab_size, seed)
    one, e1 = _serve(tiny_model, requests, max_decode_steps=1)
    many, e8 = _serve(tiny_model, requests, max_decode_steps=8, async_scheduling=pipelined)
    # Greedy and sampled alike (the same seed and positions give the same draws), stop
    # reasons included.
    assert many == one
    reasons = {r for outs in one.values() for _, r in outs}
    assert {"stop", "length"} <= reasons  # the stop checks were exercised
    assert e8.stats().steps == e1.stats().steps  # device steps counted the same way


def test_stop_after_min_tokens_inside_the_loop(tiny_model):
    """The first greedy tokens are stop tokens: the loop must mask them (vLLM's min_tokens)
    until 6 tokens are out, exactly as single steps do, and may stop only after them."""
    greedy_ids = _serve(tiny_model, [("a", [5, 6, 7], SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))], max_decode_steps=1)[0]["a"][0][0]
    stops = list(dict.fromkeys(greedy_ids[:8]))  # at most 8: checked on device
    sp = SamplingParams(temperature=0, min_tokens=6, max_tokens=20, stop_token_ids=stops,
                        ignore_eos=True)
    one = _serve(tiny_model, [("a", [5, 6, 7], sp)], max_decode_steps=1)[0]["a"][0]
    out = _serve(tiny_model, [("a", [5, 6, 7], sp)], max_decode_steps=8)[0]["a"][0]
    assert out == one
    toks, reason = out
    assert toks[0] != greedy_ids[0] and not set(toks[:6]) & set(stops)
    assert reason == "length" or (toks[-1] in stops and len(toks) > 6)


def test_reservation_under_memory_pressure(tiny_model, tiny_config):
    """Too few free pages to reserve the loop's tokens: rows run the steps their pages hold,
    nothing is preempted for a reservation, and outputs still equal single steps."""
    rng = np.random.default_rng(4)
    reqs = [(f"r{i}", rng.integers(4, tiny_config.vocab_size, 9).tolist(),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for i in range(4)]
    one, _ = _serve(tiny_model, reqs, max_decode_steps=1, num_pages=24)
    many, _ = _serve(tiny_model, reqs, max_decode_steps=8, num_pages=24)
    assert many == one


def test_programs_update_the_pool_in_place(tiny_model):
    """The step and the decode loop alias the donated pool and make no copy of it
    (temporaries far below its size), on the CPU reference path."""
    engine = Engine(tiny_model, page_size=16, num_pages=16384, max_num_seqs=8,
                    max_model_len=512, max_num_batched_tokens=64)
    pool = engine.state.kv_pages.size * engine.state.kv_pages.dtype.itemsize
    keys, arrays = engine.runner.sampling([])
    step = engine.steps.step.lower(engine.model.params, engine.state,
                                   padding_batch(64, engine.runner.page_table), keys, arrays)
    loop = engine.steps.decode_loop.lower(engine.model.params, engine.state,
                                          idle_decode_loop(engine, 8))
    for lowered in (step, loop):
        mem = lowered.compile().memory_analysis()
        assert mem.alias_size_in_bytes >= pool
        assert mem.temp_size_in_bytes < 0.1 * pool


def test_pipelined_loops_abort_and_admission(tiny_model, tiny_config):
    """With a loop in flight: an abort ends its request (no page leaked, the others' tokens
    unchanged) and a new arrival is admitted within two steps."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(4, tiny_config.vocab_size, 6).tolist() for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = {f"r{i}": _serve(tiny_model, [(f"r{i}", p, sp)], max_decode_steps=1)[0][f"r{i}"]
             for i, p in enumerate(prompts)}
    engine = Engine(tiny_model, **dict(SHAPE, max_decode_steps=4))
    for i in (0, 1):
        engine.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=sp)
    for _ in range(3):
        engine.step()
        engine.check()
    assert engine.loop_in_flight() is not None  # a continuation was dispatched ahead
    engine.abort("r1")
    engine.check()
    engine.add_request("r2", prompt_token_ids=prompts[2], sampling_params=sp)
    engine.step()
    engine.step()
    assert engine.get_request("r2").samples[0].status.value == "running"
    final = drive(engine)
    assert final["r0"].outputs[0].token_ids == alone["r0"][0][0]
    assert final["r2"].outputs[0].token_ids == alone["r2"][0][0]
    assert engine.stats().kv_pages_used == 0
    engine.radix.clear()
    assert engine.allocator.num_free == engine.num_pages


def test_a_failed_continuation_fails_only_requests_still_running(tiny_model, tiny_config):
    """A loop in flight continues rows of which one has meanwhile finished and had its id
    reused: a device error reading it fails only the one still running."""
    rng = np.random.default_rng(9)
    engine = Engine(tiny_model, **dict(SHAPE, max_decode_steps=4))
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=rng.integers(4, 90, 5).tolist(),
                       sampling_params=short)
    engine.add_request("b", prompt_token_ids=rng.integers(4, 90, 5).tolist(),
                       sampling_params=long)
    finished = {}
    while "a" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.loop_in_flight() is not None and any(
        r.request.request_id == "a" for r in engine.loop_in_flight().plan.decode_rows)
    engine.add_request("a", prompt_token_ids=[5, 6, 7], sampling_params=short)  # id reused

    def broken():
        raise RuntimeError("device lost")
    engine.loop_in_flight().read = broken
    outs = {o.request_id: o for o in engine.step()}
    assert outs["b"].finished and outs["b"].outputs[0].finish_reason == "error"
    assert "a" not in outs  # the new "a" never ran in that loop: untouched
    engine.check()
    final = drive(engine)
    assert final["a"].outputs[0].finish_reason == "length"
    assert engine.stats().kv_pages_used == 0


def test_a_last_one_token_prompt_chunk_counts_as_prompt(tiny_model):
    """33 prompt tokens with a budget of 16: the last chunk is one token, which runs as a
    decode row (here in a decode loop) and still counts as a computed prompt token."""
    engine = Engine(tiny_model, num_pages=32, page_size=4, max_num_batched_tokens=16,
                    max_num_seqs=2, max_model_len=64)
    engine.add_request("a", prompt_token_ids=list(range(4, 37)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.prompt_tokens == 33
    assert stats.cached_prompt_tokens + stats.computed_prompt_tokens == 33, stats
