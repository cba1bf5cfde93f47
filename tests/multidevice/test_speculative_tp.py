"""Speculative decoding under tensor parallelism (issue 29): on a tp = 2 mesh, n-gram lookup,
self-speculation and a draft model (the target's int8 copy, its weights and pool split like
the target's) serve the greedy tokens of the same mesh without speculation, and accept."""

import jax
import pytest

import jaxkv
from jaxkv import LLM, SamplingParams

CONFIG = jaxkv.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                           eos_token_ids=(3,))
SHAPE = dict(page_size=8, num_pages=64, max_num_seqs=4, max_model_len=128,
             max_num_batched_tokens=64, warmup=False, tensor_parallel_size=2)
CYCLE = [11, 12, 13, 14, 15, 16]
PROMPTS = [CYCLE * 3 + [20 + i] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "min_draft_tokens": 1},
    "self": {"method": "self", "num_draft_layers": 1, "min_acceptance_rate": 0.0},
    "draft": {"method": "draft_model", "quantization": "int8", "min_acceptance_rate": 0.0},
}


@pytest.fixture(scope="module")
def model():
    return jaxkv.random_model(CONFIG, seed=1)  # its initialization scale: no sharpening


@pytest.fixture(scope="module")
def plain(model):
    outs = LLM(model, **SHAPE).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", list(METHODS))
def test_speculation_under_tp2_serves_the_same_greedy_tokens(model, plain, method):
    spec = dict(METHODS[method], disable_by_batch_size=None)
    llm = LLM(model, **SHAPE, speculative_config=spec)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.stats()
    assert stats.spec_verifications > 0
    if method != "self":  # a random model's first layer rarely agrees with both
        assert stats.spec_accepted_tokens > 0
    drafter = llm.engine.runner.draft_model
    if drafter is not None:  # its weights and pool on both devices, split by kv head
        pages = drafter.state.kv_pages
        assert len(pages.sharding.device_set) == 2
        assert pages.addressable_shards[0].data.size * 2 == pages.size
        assert all(len(x.sharding.device_set) == 2
                   for x in jax.tree.leaves(drafter.model.params))
