"""Prefill/decode disaggregation between two meshes of virtual CPU devices: tensor-parallel
sizes that differ between the sides (pages reshard by kv head, replicated heads picked or
spread), quantized pages with their scales, and greedy tokens equal to one colocated device
(up to near-ties of its logits: the model is random at its initialization scale)."""

import jax
import numpy as np
import pytest
from serving import assert_same_up_to_near_ties, drive

import jaxkv
from jaxkv import LLM, Engine, SamplingParams
from jaxkv.disagg import DisaggregatedEngine
from jaxkv.sharding import make_mesh

CONFIG = jaxkv.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16,
                           max_position_embeddings=256, eos_token_ids=(3,))
SHAPE = dict(page_size=8, num_pages=48, max_num_seqs=8, max_model_len=128,
             max_num_batched_tokens=32)
RNG = np.random.default_rng(3)
SHARED = RNG.integers(4, 128, 20).tolist()
PROMPTS = [SHARED + RNG.integers(4, 128, int(n)).tolist() for n in (3, 12)] + \
          [RNG.integers(4, 128, int(n)).tolist() for n in (5, 27)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return jaxkv.random_model(CONFIG, seed=2)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of one colocated device per kv_cache_dtype, with top-2 logprobs."""
    out = {}
    for kv in ("auto", "int8"):
        engine = Engine(model, kv_cache_dtype=kv, **SHAPE)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), prompt_token_ids=p, sampling_params=SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))
        done = drive(engine)
        out[kv] = [(done[str(i)].outputs[0].token_ids, done[str(i)].outputs[0].logprobs)
                   for i in range(len(PROMPTS))]
    return out




@pytest.mark.parametrize("tp_prefill, tp_decode, kv", [
    (1, 2, "auto"), (2, 4, "auto"), (4, 1, "auto"), (2, 2, "int8"), (4, 2, "int8")])
def test_tokens_equal_one_device_across_tensor_parallel_sizes(model, reference, tp_prefill,
                                                              tp_decode, kv):
    devices = jax.devices()
    engine = DisaggregatedEngine(
        Engine(model, mesh=make_mesh(tp_prefill, devices[:4]), kv_cache_dtype=kv, **SHAPE),
        Engine(model, mesh=make_mesh(tp_decode, devices[4:]), kv_cache_dtype=kv, **SHAPE))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    done = drive(engine)
    for i in range(len(PROMPTS)):
        assert_same_up_to_near_ties(done[str(i)].outputs[0].token_ids, reference[kv][i])
    # The decode pool stays split by kv head on its own devices, scales with it.
    state = engine.decode.state
    assert {d.id for d in state.kv_pages.sharding.device_set} == \
        {d.id for d in devices[4:4 + tp_decode]}
    if tp_decode > 1:
        assert tuple(state.kv_pages.sharding.spec)[:2] == (None, "tp")
        if kv == "int8":
            assert tuple(state.kv_scales.sharding.spec)[:2] == (None, "tp")
    # What moved: each prompt page either moved or was in the decode side's prefix cache (a
    # page streamed before a shared prefix landed there may have done both), with the kv heads
    # of the smaller side once each: 2 layers x min(K) heads x 8 tokens x bytes per token.
    pages = sum(-(-len(p) // 8) for p in PROMPTS)
    heads = min(max(2, tp_prefill), max(2, tp_decode))
    per_token = 2 * 16 * (4 if kv == "auto" else 1) + (0 if kv == "auto" else 4)
    stats = engine.stats()
    assert stats.kv_pages_transferred <= pages
    assert stats.kv_pages_transferred + engine.transfers.reused_pages >= pages
    assert stats.kv_bytes_transferred == stats.kv_pages_transferred * 2 * heads * 8 * per_token


def test_llm_with_prefill_and_decode_devices(model, reference):
    devices = jax.devices()
    # Each side's tensor-parallel size defaults to its device count (2 and 4 here).
    llm = LLM(model, prefill_devices=devices[:2], decode_devices=devices[2:6], **SHAPE,
              warmup=False)
    assert isinstance(llm.engine, DisaggregatedEngine)
    assert [e.runner.mesh.devices.size for e in llm.engine.engines] == [2, 4]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for out, ref in zip(outs, reference["auto"], strict=True):
        assert_same_up_to_near_ties(out.outputs[0].token_ids, ref)
    # A second round: the decode side's prefix cache holds every prompt but its last
    # partial page, so only those pages move.
    before = llm.engine.transfers.pages
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
        temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    partial = sum(1 for p in PROMPTS if len(p) % 8)
    assert llm.engine.transfers.pages - before == partial
    llm.engine.check()
