"""Engine and LLM: continuous batching equals per-request generation, prefix caching reuses
exactly what it should, forks share pages, and bad requests fail with the field named.

Most tests share one engine shape (SMALL) with the tiny model, so they share compiled programs.
"""

import numpy as np
import pytest
from serving import drive as run

import jaxkv
from jaxkv import LLM, Engine, SamplingParams
from jaxkv.engine.llm import kv_bytes_per_token

SMALL = dict(page_size=16, num_pages=8, max_num_seqs=4, max_model_len=128,
             max_num_batched_tokens=16)
# The embedded model: a 512-token shared prefix, and the LLM facade.
LARGE = dict(page_size=16, num_pages=64, max_num_seqs=16, max_model_len=544,
             max_num_batched_tokens=512)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(rng, n, vocab):
    return rng.integers(4, vocab, size=n).tolist()


def complete(engine, rid, ids, sp, **kw):
    engine.add_request(rid, prompt_token_ids=ids, sampling_params=sp, **kw)
    return run(engine)[rid]


@pytest.fixture(scope="module")
def default_model():
    return jaxkv.load_default()


def test_equals_generate_alone_under_preemption_and_chunked_prefill(tiny_model, tiny_config):
    rng = np.random.default_rng(0)
    lens, max_tokens = [25, 27, 29, 31, 32], [24, 30, 20, 33, 17]
    prompts = [tokens(rng, n, tiny_config.vocab_size) for n in lens]
    sps = [greedy(m) for m in max_tokens]
    assert min(lens) > SMALL["max_num_batched_tokens"]  # every prompt is chunked
    engine = Engine(tiny_model, **SMALL)
    for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=sp)
    final = run(engine)
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.kv_pages_used == 0 and not engine.has_unfinished_requests()
    assert stats.kv_pages_cached + stats.kv_pages_free == stats.kv_pages_total
    assert stats.generated_tokens == sum(max_tokens)
    for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
        out = final[str(i)]
        assert out.outputs[0].token_ids == jaxkv.generate(tiny_model, [p], sp)[0], i
        assert out.outputs[0].finish_reason == "length" and out.prompt_token_ids == p
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.finish_time
        assert m.ttft >= 0 and m.tpot >= 0


def test_stop_tokens_and_min_tokens(tiny_model, tiny_config):
    prompt = tokens(np.random.default_rng(1), 20, tiny_config.vocab_size)
    engine = Engine(tiny_model, **SMALL)
    base = complete(engine, "base", prompt, greedy(12)).outputs[0].token_ids
    stop = base[5]
    first = base.index(stop)
    out = complete(engine, "stop", prompt, greedy(12, stop_token_ids=(stop,))).outputs[0]
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop  # vLLM: the stop_token_ids id that ended it
    # vLLM's min_tokens: the stop token is masked until min_tokens tokens are out, so the
    # output follows greedy up to where it would have stopped, then takes another token.
    out = complete(engine, "min", prompt,
                   greedy(12, stop_token_ids=(stop,), min_tokens=first + 2)).outputs[0]
    assert out.token_ids[:first] == base[:first] and out.token_ids[first] != stop
    assert stop not in out.token_ids[:first + 2]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop and len(out.token_ids) > first + 2


def test_seeds_use_all_64_bits(tiny_model, tiny_config):
    """vLLM accepts any 64-bit seed: seeds >= 2**32 must not alias their low word (and must
    not raise from inside add_request); -1 is 2**64 - 1, as torch takes it."""
    prompt = tokens(np.random.default_rng(3), 12, tiny_config.vocab_size)
    engine = Engine(tiny_model, **SMALL)

    def draw(seed):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        return complete(engine, f"s{seed}", prompt, sp).outputs[0].token_ids

    low, high, top = draw(5), draw(2**32 + 5), draw(2**64 - 1)
    assert low != high and low == draw(5)
    assert draw(-1) == top
    with pytest.raises(ValueError, match=r"SamplingParams\.seed=18446744073709551616"):
        SamplingParams(seed=2**64)


def test_multi_turn_chat_reuses_the_whole_previous_turn(tiny_model, tiny_config):
    rng = np.random.default_rng(2)
    turn1 = tokens(rng, 20, tiny_config.vocab_size)
    engine = Engine(tiny_model, **SMALL)
    reply = complete(engine, "t1", turn1, greedy(10)).outputs[0].token_ids
    turn2 = turn1 + reply + tokens(rng, 7, tiny_config.vocab_size)
    before = engine.stats().computed_prompt_tokens
    out = complete(engine, "t2", turn2, greedy(10))
    assert out.num_cached_tokens >= len(turn1) + len(reply) - 1
    # Only the new message (and the last reply token, whose KV was never computed) runs.
    assert engine.stats().computed_prompt_tokens - before == len(turn2) - out.num_cached_tokens
    cold = Engine(tiny_model, enable_prefix_caching=False, **SMALL)
    assert complete(cold, "t2", turn2, greedy(10)).outputs[0].token_ids == out.outputs[0].token_ids


def test_shared_prefix_is_computed_once(default_model):
    rng = np.random.default_rng(3)
    vocab = default_model.config.vocab_size
    prefix = tokens(rng, 512, vocab)
    prompts = [prefix + tokens(rng, 8, vocab) for _ in range(16)]
    engine = Engine(default_model, **LARGE)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=greedy(2))
    final = run(engine)
    stats = engine.stats()
    assert stats.computed_prompt_tokens == 512 + 16 * 8  # the prefix once, each suffix once
    assert stats.cached_prompt_tokens == 15 * 512
    assert sorted(o.num_cached_tokens for o in final.values()) == [0] + [512] * 15
    cold = Engine(default_model, enable_prefix_caching=False, **LARGE)
    assert complete(cold, "7", prompts[7], greedy(2)).outputs == final["7"].outputs


@pytest.mark.parametrize("page_size,num_pages", [(1, 128), (16, 8), (64, 2)])
def test_mid_page_prefix_match_equals_no_cache(tiny_model, tiny_config, page_size, num_pages):
    rng = np.random.default_rng(4)
    first = tokens(rng, 40, tiny_config.vocab_size)
    second = first[:37] + tokens(rng, 5, tiny_config.vocab_size)  # match ends inside a page
    results = {}
    for caching in (True, False):
        engine = Engine(tiny_model, enable_prefix_caching=caching,
                        **dict(SMALL, page_size=page_size, num_pages=num_pages))
        complete(engine, "a", first, greedy(8))
        results[caching] = complete(engine, "b", second, greedy(8))
    assert results[True].num_cached_tokens == 37 and results[False].num_cached_tokens == 0
    assert results[True].outputs[0].token_ids == results[False].outputs[0].token_ids


def test_n_samples_share_prompt_pages_and_are_reproducible(tiny_model, tiny_config):
    rng = np.random.default_rng(5)
    prompt = tokens(rng, 40, tiny_config.vocab_size)  # 3 pages, the last partly filled
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    engine = Engine(tiny_model, **SMALL)
    engine.add_request("x", prompt_token_ids=prompt, sampling_params=sp)
    while not (outs := engine.step()):
        engine.check()
    engine.check()
    assert [len(c.token_ids) for c in outs[0].outputs] == [1] * 4
    assert engine.stats().kv_pages_used == 3  # not 4 x 3: the samples share the prompt
    final = run(engine)["x"]
    samples = [c.token_ids for c in final.outputs]
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples}) > 1
    assert all(len(s) == 8 for s in samples)
    # The same seed gives the same samples in another batch (other requests beside it).
    other = Engine(tiny_model, **SMALL)
    for i in range(2):
        other.add_request(f"o{i}", prompt_token_ids=tokens(rng, 9 + 11 * i,
                                                           tiny_config.vocab_size),
                          sampling_params=SamplingParams(max_tokens=6, seed=i))
    other.add_request("x", prompt_token_ids=prompt, sampling_params=sp)
    assert [c.token_ids for c in run(other)["x"].outputs] == samples


def test_interpret_mode_kernels_give_the_reference_tokens(tiny_model, tiny_config):
    """The engine's shapes (full-width page table, padding rows, ragged decode+prefill rows)
    through the GPU-style Pallas kernels, interpreted on CPU."""
    rng = np.random.default_rng(8)
    prompts = [tokens(rng, n, tiny_config.vocab_size) for n in (25, 18)]
    results = []
    for impl in ("reference", "interpret"):
        engine = Engine(tiny_model, attention_impl=impl, **SMALL)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), prompt_token_ids=p, sampling_params=greedy(6))
        engine.add_request("n", prompt_token_ids=prompts[0][:20],
                           sampling_params=SamplingParams(n=2, seed=1, max_tokens=6))
        results.append({k: v.outputs for k, v in run(engine).items()})
    assert results[0] == results[1]


def test_cache_salt_namespaces_the_prefix_cache(tiny_model, tiny_config):
    prompt = tokens(np.random.default_rng(6), 30, tiny_config.vocab_size)
    engine = Engine(tiny_model, **SMALL)
    a = complete(engine, "a", prompt, greedy(4), cache_salt="alice")
    b = complete(engine, "b", prompt, greedy(4), cache_salt="bob")
    c = complete(engine, "c", prompt, greedy(4), cache_salt="alice")
    d = complete(engine, "d", prompt, greedy(4))
    assert (a.num_cached_tokens, b.num_cached_tokens, d.num_cached_tokens) == (0, 0, 0)
    assert c.num_cached_tokens == len(prompt) - 1
    assert a.outputs == b.outputs == c.outputs == d.outputs


def test_abort_frees_pages_at_once(tiny_model, tiny_config):
    rng = np.random.default_rng(7)
    engine = Engine(tiny_model, enable_prefix_caching=False, **SMALL)
    engine.add_request("a", prompt_token_ids=tokens(rng, 30, tiny_config.vocab_size),
                       sampling_params=greedy(20))
    engine.add_request("b", prompt_token_ids=tokens(rng, 10, tiny_config.vocab_size),
                       sampling_params=greedy(20))
    for _ in range(4):
        engine.step()
    used = engine.stats().kv_pages_used
    held_by_a = {p for r in engine.scheduler.running if r.request_id == "a" for p in r.pages}
    assert len(held_by_a) >= 2  # 30 prompt tokens and some output, at 16 per page
    engine.abort("a")
    engine.check()
    assert engine.stats().kv_pages_used == used - len(held_by_a)
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    with pytest.raises(ValueError, match="'nope'"):
        engine.abort("nope")
    assert run(engine)["b"].outputs[0].finish_reason == "length"
    assert engine.stats().kv_pages_used == 0


@pytest.fixture(scope="module")
def llm(default_model):
    memory = LARGE["num_pages"] * LARGE["page_size"] * kv_bytes_per_token(default_model)
    kw = {k: v for k, v in LARGE.items() if k != "num_pages"}
    return LLM(default_model, kv_cache_memory_bytes=memory, **kw, warmup=False)


def test_llm_generate_keeps_order_and_per_prompt_params(llm, default_model):
    assert llm.stats().kv_pages_total == LARGE["num_pages"]  # sized from the memory budget
    prompts = ["Once upon a time", "The little cat", "def fib(n):"]
    sps = [greedy(m) for m in (3, 7, 5)]
    outs = llm.generate(prompts, sps, use_tqdm=True)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 5]
    for p, o in zip(prompts, outs, strict=True):
        assert o.prompt_token_ids == default_model.encode(p)
        assert o.outputs[0].text == default_model.decode(o.outputs[0].token_ids)
    alone = llm.generate(prompts[1], sps[1], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    by_ids = llm.generate(prompt_token_ids=outs[2].prompt_token_ids, sampling_params=sps[2],
                          use_tqdm=False)
    assert by_ids[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate(prompts, sps[:2])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]: prompt_token_ids\[0\]"):
        llm.generate(prompt_token_ids=[[5, 6], [10**6]])
    assert not llm.engine.has_unfinished_requests()


def test_llm_chat_uses_the_chat_template(llm, default_model):
    conv = [{"role": "user", "content": "Hello!"}]
    rendered = "<|user|>\nHello!<|eos|>\n<|assistant|>\n"
    assert default_model.tokenizer.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True) == rendered
    (out,) = llm.chat(conv, greedy(4), use_tqdm=False)
    assert out.prompt == rendered and out.prompt_token_ids == default_model.encode(rendered)
    assert len(out.outputs[0].token_ids) == 4
    second = conv + [{"role": "assistant", "content": out.outputs[0].text},
                     {"role": "user", "content": "And then?"}]
    outs = llm.chat([conv, second], greedy(4), use_tqdm=False)
    assert outs[0].outputs == out.outputs and outs[1].prompt.startswith(rendered)
    with pytest.raises(ValueError, match=r"conversations\[0\]"):
        llm.chat([{"role": "user"}])
