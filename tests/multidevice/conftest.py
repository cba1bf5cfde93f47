"""Tests on 8 virtual CPU devices. They run in their own process (tests/test_scaleout.py
starts it), because the device count is fixed when jax first initializes its backend."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: shared helpers

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402

# `make test` runs a representative part (every parallel shape once, the scanned layout for
# the engine-level checks); the rest runs under `-m slow` (tests/test_scaleout.py starts both).
SLOW = {
    "test_greedy_tokens_equal_one_device[gqa-2-2]",
    "test_greedy_tokens_equal_one_device[gqa-4-1]",
    "test_greedy_tokens_equal_one_device[gqa-scan-1-2]",
    "test_greedy_tokens_equal_one_device[gqa-scan-2-1]",
    "test_greedy_tokens_equal_one_device[mqa-1-2]",
    "test_prefix_caching_and_preemption_under_tp2[gqa]",
    "test_after_warmup_tp2_serving_compiles_nothing[gqa]",
    "test_int8_pages_and_scales_shard_by_kv_head[gqa-2]",
    "test_int8_pages_and_scales_shard_by_kv_head[gqa-4]",
    "test_int8_pages_and_scales_shard_by_kv_head[gqa-scan-4]",
    "test_int8_pages_and_scales_shard_by_kv_head[mqa-2]",
    "test_host_tier_under_tp2_with_int8_pages[gqa]",
    "test_host_tier_under_tp2_with_int8_pages[mqa]",
    "test_tokens_equal_one_device_across_tensor_parallel_sizes[1-2-auto]",
    "test_tokens_equal_one_device_across_tensor_parallel_sizes[4-1-auto]",
    "test_tokens_equal_one_device_across_tensor_parallel_sizes[2-2-int8]",
    # (make test's time: tp x dp stays in CI as gqa-scan-2-2, int8 shards as mqa-4, prefix
    # caching and warmup as gqa-scan)
    "test_greedy_tokens_equal_one_device[gqa-1-2]",
    "test_greedy_tokens_equal_one_device[mqa-2-2]",
    "test_int8_pages_and_scales_shard_by_kv_head[gqa-scan-2]",
    "test_prefix_caching_and_preemption_under_tp2[mqa]",
    "test_after_warmup_tp2_serving_compiles_nothing[mqa]",
    "test_pallas_kernels_run_per_device_inside_shard_map[interpret]",  # interpret-tpu stays
    "test_quantized_weights_split_and_serve_like_one_device[int8]",  # int4-g32 stays
    "test_tokens_equal_one_device_across_tensor_parallel_sizes[2-4-auto]",  # 4-2-int8 stays
    "test_expert_parallel_equals_one_device[4-False]",  # EP=2 stays, unrolled and scanned
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.name in SLOW:
            item.add_marker(pytest.mark.slow)
