"""Gemma's local/global layers and mixtures of experts split over virtual CPU devices: the same
logprobs and greedy tokens as one device, tensor parallel (heads, and every expert by width)
and expert parallel (whole experts per device, the rows routed to them computed there)."""

import dataclasses

import numpy as np
import pytest

import jaxkv
from jaxkv import LLM, SamplingParams

# Gemma-3-like: q/k norms, sandwich norms, two local layers then a global one, local RoPE.
GEMMA = jaxkv.ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,),
    qk_norm=True, sandwich_norm=True, gemma_norm=True, scale_embeddings=True,
    hidden_act="gelu_tanh", query_pre_attn_scalar=16.0, sliding_window=8,
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    rope_theta=1e6, local_rope_theta=1e4, model_type="gemma3_text")
# Qwen3-MoE-like: 8 experts, top 2, a dense layer between two MoE ones.
MOE = jaxkv.ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,),
    qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    norm_topk_prob=False, dense_layers=(1,), model_type="qwen3_moe")
SHAPE = dict(page_size=8, num_pages=64, max_num_seqs=8, max_model_len=128,
             max_num_batched_tokens=64, warmup=False)
RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(4, 128, int(n)).tolist() for n in (30, 9, 17)]
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
# Splitting a sum over devices reorders fp32 additions: logprobs differ by ~1e-6.
ATOL = 1e-4


def _serve(model, **kw):
    outs = LLM(model, **SHAPE, **kw).generate(prompt_token_ids=PROMPTS, sampling_params=SP,
                                              use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(d.values())).logprob
                                      for d in o.outputs[0].logprobs]) for o in outs]


def _assert_same(got, want):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=True)) if a != b),
                 len(tokens))
        # Identical up to the first near-tie (none expected: then the whole reply).
        np.testing.assert_allclose(logprobs[:n], want_logprobs[:n], atol=ATOL, rtol=0)
        assert n == len(tokens), (tokens, want_tokens)


@pytest.mark.parametrize("config, scan", [(GEMMA, True), (MOE, False)],
                         ids=["gemma3-scan", "qwen3-moe"])
def test_tensor_parallel_equals_one_device(config, scan):
    model = jaxkv.random_model(config, seed=2, scan_layers=scan)
    _assert_same(_serve(model, tensor_parallel_size=2), _serve(model))


def test_window_only_kv_split_by_head_equals_one_device_keeping_every_token():
    # unrolled Gemma: its local layers keep only their window, in a pool split by kv head
    model = jaxkv.random_model(GEMMA, seed=2, scan_layers=False)
    llm = LLM(model, tensor_parallel_size=2, **SHAPE)
    window = llm.engine.state.window_pages
    assert llm.engine.window.num_slots < SHAPE["num_pages"]
    assert {s.data.shape[1] for s in window.addressable_shards} == {1}  # 2 kv heads, 2 devices
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    got = [(o.outputs[0].token_ids, [next(iter(d.values())).logprob
                                     for d in o.outputs[0].logprobs]) for o in outs]
    _assert_same(got, _serve(model, window_kv=False))


@pytest.mark.parametrize("tp, scan", [(2, False), (4, False), (2, True)])
def test_expert_parallel_equals_one_device(tp, scan):
    # scanned: every layer MoE, experts stacked [L, X, E, F] and split on X
    config = dataclasses.replace(MOE, dense_layers=()) if scan else MOE
    model = jaxkv.random_model(config, seed=2, scan_layers=scan)
    llm = LLM(model, tensor_parallel_size=tp, enable_expert_parallel=True, **SHAPE)
    experts = llm.engine.model.module().layers.param("experts_gate", 0)[...]
    assert {s.data.shape[int(scan)] for s in experts.addressable_shards} == {8 // tp}
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    got = [(o.outputs[0].token_ids, [next(iter(d.values())).logprob
                                     for d in o.outputs[0].logprobs]) for o in outs]
    _assert_same(got, _serve(model))


def test_a_custom_module_is_not_given_replicated_kv_heads():
    # jaxkv replicates kv heads (tp > num_kv_heads) only in its own model's params
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "custom_model", Path(__file__).resolve().parents[2] / "examples" / "custom_model.py")
    custom = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(custom)
    with pytest.raises(ValueError, match="replicates kv heads only in its own model"):
        LLM(custom.build(), tensor_parallel_size=4, **SHAPE)


def test_expert_parallel_needs_experts_and_a_divisible_count():
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(jaxkv.random_model(GEMMA, seed=0), tensor_parallel_size=2,
            enable_expert_parallel=True, **SHAPE)
    six = dataclasses.replace(MOE, num_experts=6)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide num_experts=6"):
        LLM(jaxkv.random_model(six, seed=0, scan_layers=False), tensor_parallel_size=4,
            enable_expert_parallel=True, **SHAPE)
