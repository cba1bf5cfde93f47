"""Engine settings (`jaxkv.config`): validation that names the field, unknown keywords named
with the nearest setting, flat keywords onto sections and back, and `jaxkv serve`'s flags
generated from the fields (one per setting, its help the field's docstring)."""

import dataclasses

import pytest

import jaxkv
from jaxkv.cli import build_parser
from jaxkv.cli_settings import engine_settings
from jaxkv.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    KVPoolPlan,
    KVSpec,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    cdiv,
    config_fields,
)

pytestmark = pytest.mark.host  # no engine: `make test-fast`


@pytest.mark.parametrize("section, field, value", [
    (CacheConfig, "page_size", 0),
    (CacheConfig, "page_size", 24),
    (CacheConfig, "num_pages", -3),
    (CacheConfig, "kv_cache_memory_fraction", 1.5),
    (CacheConfig, "kv_cache_dtype", "int4"),
    (CacheConfig, "host_kv_cache_bytes", -1),
    (SchedulerConfig, "max_num_seqs", 0),
    (SchedulerConfig, "max_num_batched_tokens", 2.5),
    (SchedulerConfig, "max_model_len", 0),
    (SchedulerConfig, "async_scheduling", "yes"),
    (ParallelConfig, "tensor_parallel_size", 0),
    (DisaggConfig, "decode_tensor_parallel_size", True),
    (RuntimeConfig, "attention_impl", "flash"),
    (RuntimeConfig, "dtype", "float16"),
    (RuntimeConfig, "seed", -1),
])
def test_a_bad_value_is_refused_naming_its_field(section, field, value):
    with pytest.raises(ValueError, match=field):
        section(**{field: value})
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**{field: value})


def test_llm_refuses_a_bad_page_size_before_loading_anything():
    """LLM(page_size=24) fails in the config, naming the field and the rule, before a model is
    looked up (an unknown model name would fail differently, and later)."""
    from jaxkv import LLM

    with pytest.raises(ValueError, match=r"CacheConfig.page_size must be a power of two.*24"):
        LLM("no/such-model-is-ever-loaded", page_size=24)


def test_host_tier_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="host_kv_cache_bytes.*enable_prefix_caching"):
        CacheConfig(host_kv_cache_bytes=1 << 20, enable_prefix_caching=False)


def test_flat_keywords_land_in_their_sections_and_come_back():
    cfg = EngineConfig.from_kwargs(page_size=32, max_num_seqs=4, seed=7, data_parallel_size=2)
    assert cfg.cache.page_size == 32 and cfg.scheduler.max_num_seqs == 4
    assert cfg.runtime.seed == 7 and cfg.parallel.data_parallel_size == 2
    assert cfg.cache.kv_cache_dtype == "auto"  # the rest: defaults
    assert EngineConfig.from_kwargs(**cfg.flat()) == cfg
    assert EngineConfig.from_kwargs(cfg, seed=8).runtime == RuntimeConfig(seed=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.page_size = 8


def test_every_setting_has_one_flat_name_and_a_docstring():
    names = [f.name for _, f, _ in config_fields()]
    assert len(names) == len(set(names)) == len(EngineConfig().flat())
    undocumented = [f.name for _, f, doc in config_fields() if len(doc) < 20]
    assert not undocumented


@pytest.mark.parametrize("make", [
    lambda **kw: EngineConfig.from_kwargs(**kw),
    lambda **kw: jaxkv.LLM(**kw),
])
def test_an_unknown_keyword_names_the_nearest_setting(make):
    with pytest.raises(ValueError, match="'page_sise'.*did you mean 'page_size'"):
        make(page_sise=32)
    with pytest.raises(ValueError, match="'max_seqs'.*did you mean 'max_num_seqs'"):
        make(max_seqs=4)


def test_engine_refuses_the_settings_only_llm_reads(tiny_model):
    with pytest.raises(ValueError, match="Engine: unknown setting 'kv_cache_memory_bytes'"):
        jaxkv.Engine(tiny_model, num_pages=8, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="Engine: num_pages is required"):
        jaxkv.Engine(tiny_model)


def test_serve_has_a_flag_for_every_setting_with_the_fields_help(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for _, field, doc in config_fields():
        flag = "--" + field.name.replace("_", "-")
        assert flag in help_text, flag
        assert " ".join(doc.split())[:40] in help_text, field.name
    args = parser.parse_args(["serve"])
    # the defaults, bar one: a server warms its larger programs up in the background
    assert EngineConfig.from_kwargs(**engine_settings(args, args.settings)) == \
        EngineConfig.from_kwargs(background_warmup=True)


def test_serve_flags_parse_onto_the_fields():
    args = build_parser().parse_args(
        ["serve", "--page-size", "32", "--no-enable-prefix-caching", "--kv-cache-dtype", "int8",
         "--max-num-seqs", "3", "--seed", "5"])
    cfg = EngineConfig.from_kwargs(**engine_settings(args, args.settings))
    assert cfg.cache == CacheConfig(page_size=32, enable_prefix_caching=False,
                                    kv_cache_dtype="int8")
    assert cfg.scheduler.max_num_seqs == 3 and cfg.runtime.seed == 5
    with pytest.raises(SystemExit):  # a choice outside the field's: argparse says so
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


def test_kv_spec_counts_values_scales_and_shards():
    bf16 = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert bf16.bytes_per_token == 2 * 32 * 8 * 128 * 2  # Llama-3-8B: 131,072
    assert bf16.bytes_per_page(16) == 16 * bf16.bytes_per_token
    int8 = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=1, scale_bytes=4)
    assert int8.bytes_per_token == 32 * 8 * (2 * 128 + 4)  # 66,560, scales included
    assert bf16.per_shard(4) == bf16.bytes_per_token // 4
    assert bf16.per_shard(16) == bf16.bytes_per_token // 8  # 8 kv heads over 16: replicated


def test_pool_plan_and_cdiv():
    plan = KVPoolPlan(pages=10, page_size=16, kv_cache_dtype="auto", bytes_per_token=100,
                      max_model_len=40, source="test")
    assert plan.tokens == 160 and plan.bytes == 16_000 and plan.full_sequences == 4
    assert [cdiv(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
