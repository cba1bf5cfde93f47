"""`Engine.warmup` compiles every program serving can need: afterwards a busy, varied
workload (chunked prefills, decodes, decode loops, forks, prefix copies, preemption, every
sampling mode, min_tokens masks, logprobs) compiles nothing new, counted by jax's own compile
events."""

import numpy as np
import pytest

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
