"""The benchmark scripts run end to end in their CPU modes (numbers are not checked here)."""

from script_loader import load_script as _load


def test_bench_kernels_refuses_cpu_timings(capsys):
    assert _load("bench_kernels").main([]) == 0
    assert "interpret mode" in capsys.readouterr().out


def test_bench_kernels_smoke_agrees_across_implementations(capsys, tmp_path):
    assert _load("bench_kernels").main(["--smoke", "--out", str(tmp_path / "p.png")]) == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    errs = {ln[2]: float(ln[-1]) for ln in lines if len(ln) == 7 and ln[0] == "2"}
    assert set(errs) == {"jaxkv", "xla-reference", "jax-shipped"}
    assert max(errs.values()) < 2e-2  # bf16, all three compute the same attention


def test_bench_cache_small_run(capsys):
    assert _load("bench_cache").main(["--tokens", "4", "8", "--prompt-len", "8",
                                      "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "reproduce: python scripts/bench_cache.py" in out


def test_bench_peers_small_multiturn(capsys, tmp_path):
    """The peer benchmark's multiturn rounds (each turn's prompt = the previous prompt, its
    output and new user tokens) through jaxkv and transformers on a 1-layer model: greedy
    tokens must agree on every request (fp32, same checkpoint)."""
    assert _load("bench_peers").main(["--layers", "1", "--hidden", "64", "--repeats", "1",
                                      "--workloads", "multiturn", "--engines", "hf", "jaxkv",
                                      "--out", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "jaxkv Engine (tuned) vs transformers generate: 16/16 requests identical" in out
    assert (tmp_path / "p.png").exists()


def test_profile_runtime_attention_part(capsys):
    """The attention profile runs the reference and both gathers on a small pool."""
    assert _load("profile_runtime").main(["--parts", "attention", "--layers", "2",
                                          "--batch", "2", "--prompt-len", "60"]) == 0
    out = capsys.readouterr().out
    assert "reference attention" in out and "page-major pool" in out
    assert "reproduce: python scripts/profile_runtime.py --parts attention" in out


def test_bench_serve_small_run(capsys, tmp_path):
    """Clients against the in-process server and the offline column, on the embedded model."""
    from jaxkv.model.pretrained import DEFAULT_MODEL_DIR

    assert _load("bench_serve").main(["--model", str(DEFAULT_MODEL_DIR), "--num-prompts", "3",
                                      "--concurrency", "2", "--input-len", "8",
                                      "--output-len", "4", "--no-warmup",
                                      "--out", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("serve,", "offline"))]
    assert len(rows) == 2 and all(r[-7] == "3" for r in rows)  # 3 requests each
    assert (tmp_path / "s.png").exists()
