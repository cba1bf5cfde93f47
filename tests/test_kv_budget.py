"""The KV pool `LLM` sizes when given no size: from the device's memory (stubbed here, as no
accelerator is present), from available RAM on CPU, capped by what max_num_seqs can use."""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.engine import kv_budget as kb
from jaxkv.engine.pool_plan import weights_to_place

pytestmark = pytest.mark.host  # no engine: `make test-fast`

GiB = 2**30


class FakeGPU:
    platform, device_kind = "gpu", "NVIDIA H200"

    def __init__(self, limit, used):
        self.stats = {"bytes_limit": limit, "bytes_in_use": used, "peak_bytes_in_use": used}

    def memory_stats(self):
        return self.stats


def test_device_budget_is_the_fraction_less_weights_and_activations(tiny_config):
    act = kb.activation_bytes(tiny_config, 512, 32, 4)
    got = kb.kv_budget(tiny_config, fraction=0.9, max_num_batched_tokens=512, max_num_seqs=32,
                       dtype_bytes=4, device=FakeGPU(limit=80 * GiB, used=16 * GiB))
    assert got.bytes == int(0.9 * 80 * GiB) - 16 * GiB - act
    assert "H200" in got.source
    with pytest.raises(ValueError, match="kv_cache_memory_fraction=0.2 leaves no room"):
        kb.kv_budget(tiny_config, fraction=0.2, max_num_batched_tokens=512, max_num_seqs=32,
                     dtype_bytes=4, device=FakeGPU(limit=80 * GiB, used=16 * GiB))


def test_weights_still_on_the_host_count_against_the_device_budget(tiny_config):
    # A model loaded on the host (tensor parallelism, or a prefill/decode pair) reaches the
    # device only when its engine is built, after the pools are sized: its share counts.
    act = kb.activation_bytes(tiny_config, 512, 32, 4)
    got = kb.kv_budget(tiny_config, fraction=0.9, max_num_batched_tokens=512, max_num_seqs=32,
                       dtype_bytes=4, device=FakeGPU(limit=80 * GiB, used=1 * GiB),
                       pending_bytes=8 * GiB)
    assert got.bytes == int(0.9 * 80 * GiB) - 9 * GiB - act
    model = jaxkv.random_model(tiny_config, seed=0)  # on jax.devices()[0]
    nbytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    assert weights_to_place(model, jax.devices()[0], 2) == 0
    on_host = dataclasses.replace(model, params=jax.tree.map(np.asarray, model.params))
    assert weights_to_place(on_host, jax.devices()[0], 2) == nbytes // 2


@pytest.mark.parametrize("fraction", [0, 1.5, "0.9"])
def test_fraction_out_of_range_is_named(tiny_config, fraction):
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
        kb.kv_budget(tiny_config, fraction=fraction, max_num_batched_tokens=16,
                     max_num_seqs=1, dtype_bytes=4)


def test_cpu_default_is_capped_by_ram_and_by_what_sequences_can_use(caplog):
    model = jaxkv.load_default()
    with caplog.at_level(logging.INFO, logger="jaxkv"):
        llm = jaxkv.LLM(model, max_num_seqs=4, warmup=False)
    pool = llm.kv_pool
    # 4 sequences of the model's 1,024 positions at 16 tokens a page, plus one spare page
    assert pool.pages == 4 * 1024 // 16 + 1
    assert pool.max_model_len == 1024 and pool.full_sequences == 4
    assert "available RAM" in pool.source
    assert kb.kv_budget(model.config, fraction=0.9, max_num_batched_tokens=512,
                        max_num_seqs=4, dtype_bytes=4).bytes <= kb.CPU_KV_CACHE_BYTES
    assert any("KV cache: 257 pages x 16 tokens" in r.getMessage() for r in caplog.records)


def test_max_model_len_defaults_to_what_a_small_pool_holds():
    llm = jaxkv.LLM(jaxkv.load_default(), num_pages=8, warmup=False)
    assert llm.kv_pool.max_model_len == 8 * 16
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[list(range(3, 200))],
                     sampling_params=jaxkv.SamplingParams(max_tokens=4), use_tqdm=False)
