"""`jaxkv bench sim-disagg` and the modules it drives (step_models: step times; serving_sim:
TTFT/TPOT of single requests worked out by hand from the model's coefficients, decode isolation
under disaggregation), the goodput search, the CLI."""

import math

import numpy as np
import pytest
from numpy.testing import assert_allclose

from jaxkv.bench.cli import main as bench
from jaxkv.bench.sim import disagg as sim
from jaxkv.bench.sim import serving_sim as core
from jaxkv.bench.sim import step_models

pytestmark = pytest.mark.host  # no engine: `make test-fast`

# a measured-kind model: t = a + b*T + c*R + d*C + e*A
COEF = dict(a=0.01, b=1e-4, c=2e-3, d=1e-6, e=1e-8)
MODEL = step_models.StepModel(name="hand", kv_bytes_per_token=1000, kv_capacity_tokens=10**6,
                              link_gbs=1.0, link_latency_s=1e-4, time=COEF)
PREFILL_300 = 0.01 + 1e-4 * 300 + 2e-3 + 1e-6 * 300 + 1e-8 * (300 * 301 // 2)  # 0.0427515 s
TRANSFER_300 = 1000 * 300 / 1e9 + 1e-4  # 0.0004 s


def _decode_step(ctx):
    """One decode row at kv_len ``ctx`` alone in a step."""
    return 0.01 + 1e-4 + 2e-3 + 1e-6 * ctx + 1e-8 * ctx


def _one(config, prompt=300, output=5, **kw):
    req = core.Request(0, 0.0, prompt, output)
    core.simulate(MODEL, config, [req], **kw)
    return req


def test_single_request_colocated_matches_hand_arithmetic():
    r = _one("colo1")
    assert_allclose(r.first_token, PREFILL_300, rtol=1e-12, atol=0)
    # 4 decode steps at kv_len 301..304 (prompt + tokens sampled so far)
    decodes = sum(_decode_step(c) for c in (301, 302, 303, 304))
    assert_allclose(r.finish, PREFILL_300 + decodes, rtol=1e-12, atol=0)


def test_single_request_disaggregated_adds_the_transfer_before_decoding():
    r = _one("1p1d")
    assert_allclose(r.first_token, PREFILL_300, rtol=1e-12, atol=0)  # sent at prefill's end
    decodes = sum(_decode_step(c) for c in (301, 302, 303, 304))
    assert_allclose(r.finish, PREFILL_300 + TRANSFER_300 + decodes, rtol=1e-12, atol=0)
    res = core.simulate(MODEL, "1p1d", [core.Request(0, 0.0, 300, 5)])
    assert_allclose(res.tpot, [(TRANSFER_300 + decodes) / 4], rtol=1e-12, atol=0)


def test_long_prompt_is_chunked_by_the_budget():
    r = _one("colo1", prompt=700, output=2, budget=512, max_seqs=8)
    first = 0.01 + 1e-4 * 512 + 2e-3 + 1e-6 * 512 + 1e-8 * (512 * 513 // 2)
    second = 0.01 + 1e-4 * 188 + 2e-3 + 1e-6 * 700 + 1e-8 * (188 * 512 + 188 * 189 // 2)
    assert_allclose(r.first_token, first + second, rtol=1e-12, atol=0)


def test_roofline_step_is_the_slower_of_compute_and_memory():
    k = dict(f0=0.0, fT=2e9, fR=0.0, fA=0.0, bytes0=1e9, bT=0.0, bR=0.0, bC=1e5,
             peak_flops=1e15, bandwidth=1e12, overhead_s=1e-3)
    m = step_models.StepModel("r", 1, 10**6, 1.0, 0.0, roofline=k)
    # overhead + the slower of FLOPs and bytes: 1 GB / 1 TB/s; 4 TFLOP; 1 GB + 2 GB of KV
    assert_allclose(m.step_time(1, 1, 0, 0), desired=1e-3 + 1e-3, rtol=1e-12, atol=0)
    assert_allclose(m.step_time(2000, 1, 0, 0), desired=1e-3 + 4e-3, rtol=1e-12, atol=0)
    assert_allclose(m.step_time(1, 1, 20_000, 0), desired=1e-3 + 3e-3, rtol=1e-12, atol=0)


def _decoder_and_intruder(config):
    """A long decode, and a 1-token request whose 400-token prompt arrives while it decodes."""
    reqs = [core.Request(0, 0.0, 100, 50), core.Request(1, 0.2, 400, 1)]
    core.simulate(MODEL, config, reqs)
    alone = core.Request(0, 0.0, 100, 50)
    core.simulate(MODEL, config, [alone])
    return reqs[0], alone


def test_disaggregated_decode_is_not_slowed_by_a_prefill():
    with_prefill, alone = _decoder_and_intruder("1p1d")
    assert with_prefill.finish == alone.finish
    assert with_prefill.first_token == alone.first_token


def test_colocated_decode_is_slowed_by_a_prefill():
    with_prefill, alone = _decoder_and_intruder("colo1")
    # one decode step shares the 400-token chunk: it costs the chunk's part of the step
    extra = 1e-4 * 400 + 2e-3 + 1e-6 * 400 + 1e-8 * (400 * 401 // 2)
    assert_allclose(with_prefill.finish - alone.finish, extra, rtol=1e-9, atol=0)


def test_goodput_search_brackets_the_threshold():
    calls = []

    def attainment(rate):
        calls.append(rate)
        return 1.0 if rate < 37.0 else 0.5

    g = sim.goodput(attainment, 1.0)
    assert 37.0 / 1.5 ** (1 / 32) <= g < 37.0
    assert 0.5 / 1.5 ** (1 / 32) <= sim.goodput(lambda r: float(r < 0.5), 1.0) < 0.5
    assert sim.goodput(lambda r: 0.0, 1.0) == 0.0


def test_goodput_is_consistent_with_attainment_and_slo():
    model = step_models.load_models()["h200"]
    base = core.base_trace("sharegpt", 1500, 0)
    ttft, tpot = sim.slos(model, sim.SCENARIOS["long-tight"])

    def search(tpot_slo):
        runs = {}

        def attainment(rate):
            if rate not in runs:
                runs[rate] = core.simulate(model, "1p1d", core.requests_at(base, rate))
            return runs[rate].attainment(ttft, tpot_slo)
        return sim.goodput(attainment, 5.0), attainment

    tight, att_tight = search(tpot)
    loose, att_loose = search(3 * tpot)
    assert 0 < tight <= loose
    assert att_tight(tight) >= sim.TARGET and att_loose(loose) >= sim.TARGET
    assert att_tight(tight * 1.5 ** (1 / 32)) < sim.TARGET  # the failing end of the bracket


def test_trace_is_seeded_and_matches_the_quoted_means():
    a, b = core.base_trace("sharegpt", 20_000, 3), core.base_trace("sharegpt", 20_000, 3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    times, prompts, outputs = a
    assert_allclose(times[-1] / len(times), 1.0, rtol=0.03, atol=0)  # unit-rate Poisson
    assert_allclose(prompts.mean(), 161, rtol=0.05, atol=0)
    assert_allclose(outputs.mean(), 338, rtol=0.05, atol=0)
    long_prompts = core.base_trace("long", 20_000, 3)[1]
    assert_allclose(np.median(long_prompts), 1020, rtol=0.05, atol=0)


def test_checked_in_flops_match_the_parameter_count():
    """The compiled steps' FLOPs per token are 2 x the non-embedding parameters, per row of
    logits 2 x hidden x vocab (counted here from the preset's shape, not by the script)."""
    from jaxkv.cache.memory import PRESETS

    for hw, preset in (("h200", "llama-3-8b"), ("v5e", "llama-3.2-1b")):
        s = PRESETS[preset]
        per_layer = (2 * s.hidden_size * s.num_heads * s.head_dim
                     + 2 * s.hidden_size * s.num_kv_heads * s.head_dim
                     + 3 * s.hidden_size * s.intermediate_size)
        k = step_models.load_models()[hw].roofline
        assert_allclose(k["fT"], 2 * s.num_layers * per_layer, rtol=0.02, atol=0)
        assert_allclose(k["fR"], 2 * s.hidden_size * s.vocab_size, rtol=0.02, atol=0)
        assert_allclose(k["fA"], 4 * s.num_layers * s.num_heads * s.head_dim, rtol=0, atol=0)


@pytest.mark.parametrize("argv, message", [
    (["--configs", "colo4", "2p1d"], "same number of chips"),
    (["--configs", "4x"], "expected colo<N> or <x>p<y>d"),
    (["--configs", "0p4d"], "expected colo<N> or <x>p<y>d"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--hardware", "a100"], "invalid choice"),
    (["--max-seqs", "600"], "--max-seqs must be below --budget"),
])
def test_bad_arguments_are_refused_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench(["sim-disagg", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_small_run_prints_table_and_command(capsys, tmp_path):
    out = tmp_path / "p.png"
    assert bench(["sim-disagg", "--hardware", "cpu", "--scenarios", "sharegpt-loose", "--configs",
                     "colo2", "1p1d", "--requests", "300", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [ln for ln in text.splitlines() if ln.startswith("| cpu |")]
    assert len(rows) == 2 and out.exists()
    goodputs = [float(r.split("|")[5]) for r in rows]
    assert all(g > 0 and math.isfinite(g) for g in goodputs)
    assert "reproduce: jaxkv bench sim-disagg --hardware cpu" in text
