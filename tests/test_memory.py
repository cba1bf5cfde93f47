"""Tests for jaxkv.cache.memory and the `jaxkv memory` CLI."""

import dataclasses
import json

import pytest

from jaxkv.cache import memory
from jaxkv.cache.memory import (
    PRESETS,
    ModelShape,
    format_bytes,
    kv_bytes,
    kv_bytes_per_token,
    plan_capacity,
    resolve_model,
)
from jaxkv.memory_cli import main

pytestmark = pytest.mark.host  # no engine: `make test-fast`

LLAMA3_8B_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_llama2_70b_bytes_per_token():
    assert kv_bytes_per_token(PRESETS["llama-2-70b"], "bf16") == 327_680


def test_llama2_70b_4096_tokens():
    n = kv_bytes(PRESETS["llama-2-70b"], 4096, dtype="bfloat16")
    assert n == 1_342_177_280
    assert format_bytes(n).startswith("1.34 GB")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "float16", "bfloat16"])
def test_llama2_7b_128k_is_64_gib(dtype):
    assert kv_bytes(PRESETS["llama-2-7b"], 131_072, dtype=dtype) == 64 * 2**30 == 68_719_476_736


def test_kv_bytes_linear():
    shape = PRESETS["mistral-7b"]
    one = kv_bytes(shape, 100)
    assert kv_bytes(shape, 100, batch=3) == 3 * one
    assert kv_bytes(shape, 700, batch=2) == 14 * one
    assert kv_bytes(shape, 0) == 0


def test_dtype_changes_size_and_unknown_dtype():
    shape = PRESETS["llama-3-8b"]
    assert kv_bytes_per_token(shape, "fp32") == 2 * kv_bytes_per_token(shape, "bf16")
    # llama-3-8b: 32 layers x 8 kv heads; int8 holds 2 x 128 bytes plus a 4-byte scale word
    assert kv_bytes_per_token(shape, "bf16") == 32 * 8 * 512
    assert kv_bytes_per_token(shape, "int8") == 32 * 8 * (256 + 4)
    assert kv_bytes_per_token(shape, "fp8_e4m3") == kv_bytes_per_token(shape, "int8")
    with pytest.raises(ValueError, match="float64"):
        memory.dtype_bytes("float64")


@pytest.mark.parametrize("name,published", [("llama-2-7b", 6.74e9), ("llama-3-8b", 8.03e9)])
def test_param_counts(name, published):
    assert PRESETS[name].num_params() == pytest.approx(published, rel=0.01)
    assert memory.weight_bytes(PRESETS[name], "bf16") == 2 * PRESETS[name].num_params()


def test_attention_bias_adds_params():
    shape = PRESETS["qwen2.5-7b"]
    no_bias = dataclasses.replace(shape, attention_bias=False)
    H, K, D = shape.num_heads, shape.num_kv_heads, shape.head_dim
    assert shape.num_params() - no_bias.num_params() == shape.num_layers * (H * D + 2 * K * D)


def test_from_hf_config_dict_and_file(tmp_path):
    preset = PRESETS["llama-3-8b"]
    from_dict = ModelShape.from_hf_config(LLAMA3_8B_CONFIG, name="llama-3-8b")
    assert from_dict == preset
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    from_file = ModelShape.from_hf_config(tmp_path / "config.json")
    from_dir = ModelShape.from_hf_config(tmp_path)
    assert dataclasses.replace(from_file, name=preset.name) == preset
    assert from_dir == from_file
    assert dataclasses.replace(resolve_model(str(tmp_path)), name=preset.name) == preset


def test_from_hf_config_defaults_and_qwen_bias():
    cfg = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k not in ("num_key_value_heads",
                                                                  "tie_word_embeddings")}
    shape = ModelShape.from_hf_config(cfg)
    assert shape.num_kv_heads == 32 and shape.head_dim == 128
    assert shape.tie_word_embeddings is False and shape.attention_bias is False
    qwen = {
        "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "tie_word_embeddings": False,
    }
    assert ModelShape.from_hf_config(qwen, name="qwen2.5-7b") == PRESETS["qwen2.5-7b"]


def test_from_hf_config_missing_key(tmp_path):
    cfg = dict(LLAMA3_8B_CONFIG)
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelShape.from_hf_config(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="intermediate_size") as info:
        ModelShape.from_hf_config(path)
    assert str(path) in str(info.value)


def test_resolve_model_unknown():
    with pytest.raises(ValueError, match="llama-2-70b"):
        resolve_model("no-such-model")


def test_paged_fits_more_than_contiguous():
    plan = plan_capacity(PRESETS["llama-3-8b"], 80 * 2**30, max_model_len=8192,
                         avg_seq_len=1000)
    assert plan.paged_seqs >= plan.contiguous_seqs
    assert plan.paged_seqs > 4 * plan.contiguous_seqs > 0
    assert "paged" in plan.table()


def test_plan_hand_computed():
    # 1 layer, 1 KV head, head_dim 4, fp32: 2 * 1 * 1 * 4 * 4 = 32 bytes per token.
    tiny = ModelShape("tiny", num_layers=1, hidden_size=4, intermediate_size=8, num_heads=1,
                      num_kv_heads=1, head_dim=4, vocab_size=10, tie_word_embeddings=True)
    # params: embed 40, q/k/v/o 4*16=64, mlp 3*4*8=96, norms 8, final norm 4 -> 212.
    assert tiny.num_params() == 212
    weights = 212 * 4
    hbm = 10_000
    budget = int(hbm * 0.5) - weights  # 5000 - 848 = 4152
    assert budget == 4152
    plan = plan_capacity(tiny, hbm, dtype="fp32", max_model_len=64, avg_seq_len=20,
                         page_size=8, gpu_memory_utilization=0.5)
    assert plan.weight_bytes == 848
    assert plan.kv_budget_bytes == 4152
    assert plan.kv_bytes_per_token == 32
    assert plan.contiguous_seqs == 4152 // (64 * 32) == 2
    # 20 tokens -> 3 pages of 8 = 24 token slots = 768 bytes.
    assert plan.paged_seqs == 4152 // 768 == 5
    assert plan.paged_waste_fraction == pytest.approx(4 / 24, rel=1e-9)
    assert plan.contiguous_waste_fraction == pytest.approx(44 / 64, rel=1e-9)


def test_plan_budget_floors_at_zero():
    plan = plan_capacity(PRESETS["llama-2-70b"], 80 * 2**30, max_model_len=4096,
                         avg_seq_len=2048)
    assert plan.kv_budget_bytes == 0
    assert plan.contiguous_seqs == plan.paged_seqs == 0


@pytest.mark.parametrize("kwargs,field", [
    (dict(page_size=12), "page_size"),
    (dict(page_size=0), "page_size"),
    (dict(avg_seq_len=5000), "avg_seq_len"),
    (dict(avg_seq_len=0), "avg_seq_len"),
    (dict(hbm_bytes=0), "hbm_bytes"),
])
def test_plan_invalid(kwargs, field):
    args = dict(hbm_bytes=2**30, max_model_len=4096, avg_seq_len=100)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        plan_capacity(PRESETS["llama-2-7b"], args.pop("hbm_bytes"), **args)


def test_format_bytes():
    assert format_bytes(1_342_177_280) == "1.34 GB (1.25 GiB)"
    assert format_bytes(512) == "512 B"


def test_cli_prints_bytes_per_token(capsys):
    assert main(["llama-2-70b", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "327,680" in out
    assert "1,342,177,280" in out


def test_cli_plan_table(capsys):
    assert main(["llama-3-8b", "--context", "8192", "--hbm-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "paged seqs" in out and "contiguous seqs" in out


def test_cli_list(capsys):
    assert main(["list"]) == 0
    assert "qwen2.5-7b" in capsys.readouterr().out.split()


def test_cli_unknown_model(capsys):
    assert main(["gpt-17-zillion"]) == 2
    captured = capsys.readouterr()
    assert "jaxkv memory: error:" in captured.err
    assert "gpt-17-zillion" in captured.err
    assert captured.out == ""


def test_memory_module_has_no_jax_import():
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(memory.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names <= {"__future__", "dataclasses", "json", "math", "pathlib", "jaxkv"}
    assert "jax" not in names and "numpy" not in names


def test_memory_cli_counts_int8_scales(capsys):
    assert main(["llama-3-8b", "--kv-dtype", "int8", "--context", "1000",
                            "--hbm-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "KV per token (int8 (values + scales)): 66,560 bytes" in out  # 32 * 8 * 260
    assert "KV for 1,000 tokens x 1 seq: 66,560,000 bytes" in out
    assert "KV per token     66,560 bytes" in out  # the plan uses the KV dtype too
    assert "llama-3-8b (bfloat16, KV int8)" in out


def test_moe_parameters_count_dense_layers_apart():
    # Qwen3-MoE's mlp_only_layers / decoder_sparse_step: those layers hold a dense MLP, counted
    # as such (not as experts). Hand count for a 4-layer toy: with step 2, layers 1 and 3 hold
    # experts ((i + 1) % 2 == 0, as transformers decides) and layers 0 and 2 a dense MLP.
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 8,
              "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 4, "vocab_size": 10, "tie_word_embeddings": True,
              "num_experts": 3, "moe_intermediate_size": 5, "decoder_sparse_step": 2}
    shape = ModelShape.from_hf_config(config)
    assert shape.dense_layers == (0, 2)
    e, hd = 8, 2 * 4
    attention = e * hd * 4 + 2 * e + 2 * 4  # q, k, v, o; two norms; q/k norms
    dense, moe = 3 * e * 16, e * 3 + 3 * 3 * e * 5
    assert shape.num_params() == 10 * e + 4 * attention + 2 * dense + 2 * moe + e
