"""`Engine.warmup` compiles every step program serving can need: afterwards a busy, varied
workload (chunked prefills, decodes, forks, prefix copies, preemption) compiles nothing new."""

import numpy as np

from jaxkv import Engine, SamplingParams
from jaxkv.runtime.page_copy import copy_pages
from jaxkv.runtime.sampling import sample


def programs(engine):
    return (engine.steps.prefill._cache_size(), engine.steps.decode._cache_size(),
            sample._cache_size(), copy_pages._cache_size())


def test_after_warmup_serving_compiles_nothing(tiny_model, tiny_config):
    engine = Engine(tiny_model, page_size=4, num_pages=20, max_num_seqs=4, max_model_len=64,
                    max_num_batched_tokens=24)
    shapes = engine.warmup()
    assert shapes == len(engine.step_shapes()) and shapes > 10
    before = programs(engine)
    rng = np.random.default_rng(5)
    shared = rng.integers(4, tiny_config.vocab_size, 10).tolist()
    for i in range(40):
        tail = rng.integers(4, tiny_config.vocab_size, int(rng.integers(1, 30))).tolist()
        prompt = (shared if i % 2 else []) + tail
        sp = SamplingParams(n=int(rng.integers(1, 3)), temperature=0.7, seed=i,
                            max_tokens=int(rng.integers(1, 12)))
        engine.add_request(str(i), prompt_token_ids=prompt, sampling_params=sp)
        for _ in range(int(rng.integers(0, 4))):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
    assert engine.stats().preemptions > 0
    assert programs(engine) == before
