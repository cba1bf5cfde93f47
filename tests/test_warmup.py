"""`Engine.warmup` compiles every program serving can need: afterwards a busy, varied
workload (chunked prefills, decodes, decode loops, forks, prefix copies, preemption, every
sampling mode, min_tokens masks, logprobs) compiles nothing new, counted by jax's own compile
events."""

import dataclasses
import threading

import numpy as np
import pytest
from serving import drive

from jaxkv import Engine, SamplingParams
from jaxkv.runtime.compiles import count_compiles


def _serve_varied(engine, vocab, seed=5, n_requests=40):
    rng = np.random.default_rng(seed)
    shared = rng.integers(4, vocab, 10).tolist()
    modes = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=0.9, top_k=5),
             dict(temperature=1.0, top_p=0.8), dict(temperature=0.0, stop_token_ids=[7, 8]),
             dict(temperature=0.0, min_tokens=1, logprobs=2),
             dict(temperature=0.8, logprobs=0, min_tokens=1)]
    for i in range(n_requests):
        tail = rng.integers(4, vocab, int(rng.integers(1, 30))).tolist()
        prompt = (shared if i % 2 else []) + tail
        sp = SamplingParams(n=int(rng.integers(1, 3)), seed=i,
                            max_tokens=int(rng.integers(1, 12)), **modes[i % len(modes)])
        engine.add_request(str(i), prompt_token_ids=prompt, sampling_params=sp)
        for _ in range(int(rng.integers(0, 4))):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()


@pytest.mark.parametrize("debug", [False, True])
def test_after_warmup_serving_compiles_nothing(tiny_model, tiny_config, debug):
    engine = Engine(tiny_model, page_size=4, num_pages=20, max_num_seqs=4, max_model_len=64,
                    max_num_batched_tokens=24, debug_nan_freed_pages=debug)
    assert engine.warmup() == len(engine.programs())
    with count_compiles() as serving:
        _serve_varied(engine, tiny_config.vocab_size)
    assert engine.stats().preemptions > 0
    assert serving.count == 0


def test_default_config_has_few_programs(tiny_model):
    engine = Engine(tiny_model, num_pages=64)  # max_num_seqs 32, 512 tokens per step
    kinds = [kind for kind, _ in engine.programs()]
    assert len(kinds) <= 16
    assert kinds.count("step") == 6  # token buckets 16 ... 512
    assert kinds.count("decode_loop") == 4  # row buckets 1, 4, 16, 32
    assert kinds.count("logprobs") == 1


def test_llm_warms_up_by_default_so_its_first_calls_compile_nothing(tiny_model, tiny_config):
    """LLM(model) compiles every program as it is built: neither a first call nor the repeat
    of the same prompt (a prefix-cache hit, a page copy) compiles; warmup=False opts out."""
    import jaxkv

    shape = dict(page_size=4, num_pages=32, max_num_seqs=4, max_model_len=96,
                 max_num_batched_tokens=32)
    prompt = np.random.default_rng(2).integers(4, tiny_config.vocab_size, 30).tolist()
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = jaxkv.LLM(tiny_model, **shape)
    with count_compiles() as calls:
        first, again = (llm.generate(prompt_token_ids=[prompt], sampling_params=sp,
                                     use_tqdm=False)[0] for _ in range(2))
    assert calls.count == 0
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # a pool shape no other test compiles (40 pages is test_speculative.py's SHAPE, which
    # tests in the same process may have compiled)
    cold = jaxkv.LLM(tiny_model, **dict(shape, num_pages=37), warmup=False)
    with count_compiles() as calls:
        cold.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
    assert calls.count > 0


@pytest.fixture
def store(tmp_path):
    from jaxkv.runtime.stored_jit import program_store, use_program_store

    before = program_store()
    yield use_program_store(tmp_path / "programs")
    use_program_store(before)


def test_background_warmup_serves_at_once_within_what_is_compiled(tiny_model, tiny_config, store,
                                                                    monkeypatch):
    """With background_warmup the engine serves while its larger steps and decode loops
    compile: until each is ready no step takes more tokens than the largest token bucket
    compiled and no decode loop runs (so serving compiles nothing, before and after); the
    tokens are those of an engine that compiled everything first."""
    from jaxkv.engine import runner as runner_mod
    from jaxkv.engine import warmup as warmup_mod

    gate = threading.Event()
    held = {}
    deferred = {("step", 32), ("step", 64), ("decode_loop", 1), ("decode_loop", 4)}
    for kind in ("step", "decode_loop"):
        prog = warmup_mod.program(kind)

        def prepare(runner, size, prepare=prog.prepare, kind=kind):
            if (kind, size) in deferred and runner.config.runtime.background_warmup:
                assert gate.wait(300)  # (held until the engine has served)
            return prepare(runner, size)
        held[kind] = dataclasses.replace(prog, prepare=prepare)
    buckets, loops = [], []
    build = runner_mod.build_batch
    monkeypatch.setattr(runner_mod, "build_batch", lambda *a, **k: buckets.append(
        k["tokens_bucket"]) or build(*a, **k))
    shape = dict(page_size=4, num_pages=48, max_num_seqs=4, max_model_len=96,
                 max_num_batched_tokens=64)
    rng = np.random.default_rng(3)
    first, then = ([rng.integers(4, tiny_config.vocab_size, int(n)).tolist() for n in (50, 9, 33)]
                   for _ in range(2))  # (then: no prefix of the first, cached)
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
           SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True, logprobs=1),
           SamplingParams(temperature=0, max_tokens=8, n=2)]

    def serve(engine, prompts):
        for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
            engine.add_request(str(i), prompt_token_ids=p, sampling_params=sp)
        return {rid: [o.token_ids for o in out.outputs] for rid, out in drive(engine).items()}

    full = Engine(tiny_model, **shape)
    full.warmup()
    expected = serve(full, first), serve(full, then)
    monkeypatch.setattr(warmup_mod, "PROGRAMS", tuple(held.get(p.kind, p)
                                                      for p in warmup_mod.PROGRAMS))
    engine = Engine(tiny_model, **shape, background_warmup=True)
    monkeypatch.setattr(engine.runner, "launch_loop", lambda *a: loops.append(a) or
                        runner_mod.ModelRunner.launch_loop(engine.runner, *a))
    assert engine.warmup() == len(engine.programs())
    assert engine.runner.pending == deferred
    assert engine.stats().programs_compiling == 4 and engine.runner.ready_tokens() == 16
    assert not engine.wait_for_warmup(timeout=0.1)
    buckets.clear()
    with count_compiles() as serving:
        assert serve(engine, first) == expected[0]
    assert serving.count == 0
    assert buckets and set(buckets) == {16} and not loops  # 50 tokens: 16 at a time
    gate.set()
    assert engine.wait_for_warmup(timeout=300)
    assert engine.runner.pending == frozenset() and engine.stats().programs_compiling == 0
    assert engine.runner.ready_tokens() == 64
    buckets.clear()
    with count_compiles() as serving:
        assert serve(engine, then) == expected[1]
    assert serving.count == 0
    assert max(buckets) > 16 and loops  # the whole ladder and the decode loops in use


def test_a_stopped_background_warmup_starts_no_further_program(tiny_model, store,
                                                               monkeypatch):
    """`stop` (run at exit) waits for the programs compiling and starts none of those queued,
    so a server stopped early does not wait for its whole warmup."""
    import os

    from jaxkv.engine import warmup as warmup_mod

    gate, started = threading.Event(), []
    prog = warmup_mod.program("step")

    def prepare(runner, size):
        if runner.config.runtime.background_warmup and size != runner.token_buckets[0]:
            started.append(size)
            assert gate.wait(300)
        return prog.prepare(runner, size)
    monkeypatch.setattr(warmup_mod, "PROGRAMS", tuple(
        dataclasses.replace(p, prepare=prepare) if p.kind == "step" else p
        for p in warmup_mod.PROGRAMS))
    engine = Engine(tiny_model, page_size=4, num_pages=44, max_num_seqs=4, max_model_len=64,
                    max_num_batched_tokens=128, max_decode_steps=1, background_warmup=True)
    engine.warmup()
    assert engine.runner.pending == {("step", 32), ("step", 64), ("step", 128)}
    engine.runner.warming.cancel()  # (as `stop` does first)
    gate.set()
    engine.runner.warming.stop()
    workers = max(1, (os.cpu_count() or 1) - 1)
    assert len(started) == min(workers, 3)  # those compiling when it stopped, no more
    assert len(engine.runner.pending) == 3 - min(workers, 3)
    assert engine.wait_for_warmup(timeout=5) is (workers >= 3)


def test_background_warmup_needs_the_program_store(tiny_model, caplog):
    """Without a program store (or with speculation) a background compile would land where
    serving does not look: every program compiles first, and the log says why."""
    from jaxkv.runtime.stored_jit import program_store

    assert program_store() is None  # the suite runs without one (conftest)
    engine = Engine(tiny_model, page_size=4, num_pages=24, max_num_seqs=2, max_model_len=32,
                    max_num_batched_tokens=32, background_warmup=True)
    with caplog.at_level("INFO", logger="jaxkv.engine.warmup"):
        engine.warmup()
    assert engine.runner.warming is None and engine.runner.ready_tokens() == 32
    assert "background_warmup is off with no program store" in caplog.text


def test_serve_warms_up_in_the_background_unless_told_not_to():
    from jaxkv.cli import build_parser

    assert build_parser().parse_args(["serve"]).background_warmup is True
    assert build_parser().parse_args(["serve", "--no-background-warmup"]).background_warmup \
        is False
