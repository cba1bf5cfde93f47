"""Bring your own model: examples/custom_model.py (a decoder jaxkv does not ship) served by
the engine, against the same module run without any KV cache (every token recomputes the
whole sequence with dense causal attention)."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from serving import drive

import jaxkv
from jaxkv.attention import dense_attention

_spec = importlib.util.spec_from_file_location(
    "custom_model", Path(__file__).resolve().parent.parent / "examples" / "custom_model.py")
custom = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(custom)

RNG = np.random.default_rng(5)
SHARED = RNG.integers(3, 256, 24).tolist()
PROMPTS = [SHARED + RNG.integers(3, 256, int(n)).tolist() for n in (4, 19)] + \
          [RNG.integers(3, 256, 31).tolist()]
NEW = 16


WIDTH = 64  # every recomputed sequence, padded at the end (causal: padding changes nothing)


@jax.jit
def _next_token(params, graphdef, tokens, length):
    module = nnx.merge(graphdef, params)
    hidden, _ = module(tokens, jnp.arange(WIDTH), dense_attention(module.config), None)
    return jnp.argmax(module.logits(hidden[length - 1]))


def _recompute_greedy(model, prompt, n):
    """n greedy tokens, each from a full forward pass over the whole sequence so far."""
    ids = list(prompt)
    for _ in range(n):
        tokens = jnp.asarray(ids + [0] * (WIDTH - len(ids)), jnp.int32)
        ids.append(int(_next_token(model.params, model.graphdef, tokens, len(ids))))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def model():
    return custom.build(seed=3)


def test_engine_serves_a_custom_decoder_like_recomputing_it(model):
    engine = jaxkv.Engine(model, page_size=8, num_pages=14, max_num_seqs=3,
                          max_num_batched_tokens=16, max_model_len=96, warmup=False)
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=sp)
    final = drive(engine)
    want = [_recompute_greedy(model, p, NEW) for p in PROMPTS]
    assert [final[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == want
    assert all(len(set(w)) > 4 for w in want)  # not a one-token loop
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.kv_pages_used == 0


def test_llm_generate_and_weight_updates(model):
    # New weights (a trainer's step) serve without reloading or recompiling anything.
    llm = jaxkv.LLM(model, max_model_len=96, max_num_seqs=4, warmup=False)
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=sp, use_tqdm=False)
    other = custom.build(seed=4)
    llm.update_params(other.params)
    again = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=sp, use_tqdm=False)
    assert first[0].outputs[0].token_ids == _recompute_greedy(model, PROMPTS[0], 8)
    assert again[0].outputs[0].token_ids == _recompute_greedy(other, PROMPTS[0], 8)


def test_a_module_missing_part_of_the_protocol_is_named():
    class NoLogits(nnx.Module):
        def __init__(self):
            self.config = custom.build().config
            self.dtype = jnp.float32

        def __call__(self, tokens, positions, attention, carry):
            return tokens, carry

    with pytest.raises(TypeError, match="logits"):
        jaxkv.Model.from_module(NoLogits())
