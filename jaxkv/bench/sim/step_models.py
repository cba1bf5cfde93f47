"""Step-time models for `jaxkv bench sim-disagg`: what they compute, and how they are measured.

A step of T tokens over R rows, reading C cached tokens (sum of kv_len) with A attention pairs
(sum over rows of query x key positions, causal) takes, per step-time model in the JSON:
  measured ("cpu"):   a + b*T + c*R + d*C + e*A                     (least squares)
  roofline (h200, v5e): overhead + max(flops / peak, bytes / bandwidth), with
      flops = f0 + fT*T + fR*R (cost_analysis of the compiled step) + 4*H*D*L*A (attention)
      bytes = weights + kvb*(T + C) + 8*V*R (f32 logits written and sampled)

Measuring times jaxkv's step on this CPU and AOT-compiles it for v5e and H200 (cost_analysis,
in a child process, `tests/tools/step_flops.py`, with .venv/aot-site on its path: a source
checkout after `make test-aot`); about 4 minutes.

    jaxkv bench sim-disagg --measure                # refit scripts/data/step_models.json
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from jaxkv.bench.common import REPO
from jaxkv.config import cdiv

DATA = REPO / "scripts" / "data" / "step_models.json"

# ---- the models ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Seconds per step from (T tokens, R rows, C cached tokens read, A attention pairs)."""

    name: str
    kv_bytes_per_token: int
    kv_capacity_tokens: int  # KV tokens that fit next to the weights
    link_gbs: float  # default prefill -> decode link, GB/s
    link_latency_s: float
    time: dict | None = None  # measured: a, b, c, d, e
    roofline: dict | None = None  # f0 fT fR fA, bytes0 bT bR bC, peak_flops, bandwidth, overhead_s

    def step_time(self, tokens: int, rows: int, ctx: int, pairs: int) -> float:
        if self.time is not None:
            k = self.time
            return k["a"] + k["b"] * tokens + k["c"] * rows + k["d"] * ctx + k["e"] * pairs
        k = self.roofline
        flops = k["f0"] + k["fT"] * tokens + k["fR"] * rows + k["fA"] * pairs
        nbytes = k["bytes0"] + k["bT"] * tokens + k["bR"] * rows + k["bC"] * ctx
        return k["overhead_s"] + max(flops / k["peak_flops"], nbytes / k["bandwidth"])

    def prefill_time(self, n: int, start: int = 0) -> float:
        """One row of n prompt tokens after ``start`` cached ones, alone in a step."""
        return self.step_time(n, 1, start + n, chunk_pairs(start, n))

    def decode_time(self, rows: int, ctx_each: int) -> float:
        return self.step_time(rows, rows, rows * ctx_each, rows * ctx_each)


def chunk_pairs(start: int, n: int) -> int:
    """Causal (query, key) pairs of n new tokens after ``start`` cached ones."""
    return n * start + n * (n + 1) // 2


def load_models(path: Path = DATA) -> dict[str, StepModel]:
    raw = json.loads(Path(path).read_text())
    fields = {f.name for f in dataclasses.fields(StepModel)}
    return {hw: StepModel(name=hw, **{k: v for k, v in m.items() if k in fields})
            for hw, m in raw["models"].items()}


# ---- measuring them --------------------------------------------------------------------------

# Peak numbers from the vendors' spec sheets: H200 SXM 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e,
# 141 GB; TPU v5e 197 TFLOP/s bf16, 819 GB/s HBM2e, 16 GiB. Overhead per step: assumed.
HARDWARE = {
    "h200": dict(preset="llama-3-8b", peak_flops=989e12, bandwidth=4.8e12, hbm=141e9,
                 overhead_s=1e-3, link_gbs=50.0, link_latency_s=20e-6,
                 link="InfiniBand NDR 400 Gb/s, one NIC per chip"),
    "v5e": dict(preset="llama-3.2-1b", peak_flops=197e12, bandwidth=819e9, hbm=16 * 2**30,
                overhead_s=1e-3, link_gbs=200.0, link_latency_s=20e-6,
                link="ICI, 1,600 Gb/s per chip (all four links)"),
}
CPU_LINK = dict(link_gbs=1.25, link_latency_s=100e-6, link="10 Gb/s Ethernet")
# (layers, T, R): the compiled buckets; two layer counts split per-layer from per-step FLOPs.
BUCKETS = ((1, 16, 16), (1, 128, 16), (1, 512, 16), (1, 64, 64), (1, 256, 256),
           (2, 128, 16), (2, 512, 16), (2, 256, 256))


def _roofline_model(hw: str) -> dict:
    from jaxkv.cache.memory import PRESETS, kv_bytes_per_token, weight_bytes

    spec, shape = HARDWARE[hw], PRESETS[HARDWARE[hw]["preset"]]
    # The AOT helpers live in the checkout's tests/tools: a child process with them (and the
    # compilers of the `aot` extra) on its path; nothing of tests/ is imported here.
    if not (REPO / "tests" / "tools" / "step_flops.py").is_file():
        raise RuntimeError(f"measuring the roofline models needs a source checkout "
                           f"(tests/tools/step_flops.py under {REPO})")
    path = os.pathsep.join([str(REPO / ".venv" / "aot-site"), str(REPO / "tests")])
    env = dict(os.environ, PYTHONPATH=path, JAXKV_AOT="1")
    cmd = [sys.executable, "-m", "tools.step_flops", hw]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("FLOPS ")]
    if proc.returncode or not line:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(line[0][6:])
    # flops = c0 + cT*T + cR*R + layers*(l0 + lT*T): per-step parts and per-layer parts
    x = np.array([[1, t, r, n, n * t] for n, t, r, _ in rows], float)
    c0, cT, cR, l0, lT = np.linalg.lstsq(x, np.array([f for *_, f in rows]), rcond=None)[0]
    L, kvb = shape.num_layers, kv_bytes_per_token(shape)
    # bytes: every weight once (an untied input embedding is gathered by row, not read whole)
    weights = weight_bytes(shape) - (0 if shape.tie_word_embeddings
                                     else 2 * shape.vocab_size * shape.hidden_size)
    return dict(
        kind="roofline", preset=spec["preset"], kv_bytes_per_token=kvb,
        kv_capacity_tokens=int((0.9 * spec["hbm"] - weight_bytes(shape)) // kvb),
        link_gbs=spec["link_gbs"], link_latency_s=spec["link_latency_s"], link=spec["link"],
        roofline=dict(f0=c0 + L * l0, fT=cT + L * lT, fR=cR,
                      fA=4.0 * L * shape.num_heads * shape.head_dim,
                      bytes0=float(weights), bT=float(kvb + 2 * shape.hidden_size), bR=8.0 *
                      shape.vocab_size, bC=float(kvb), peak_flops=spec["peak_flops"],
                      bandwidth=spec["bandwidth"], overhead_s=spec["overhead_s"]),
        compiled_flops=rows,
        how=("FLOPs of jaxkv's ragged step at 1 and 2 unrolled layers x (T, R) buckets: "
             + ("cost_analysis() of the XLA:TPU compile for v5e (libtpu compile-only topology)"
                if hw == "v5e" else "cost_analysis() of the step lowered for CUDA (pallas-gpu; "
                "unoptimized HLO: FLOPs do not depend on fusion)")
             + "; attention FLOPs (a Pallas custom call, invisible to cost_analysis) and all "
               "bytes analytic: weights, KV written and read, f32 logits"))


def _cpu_model() -> dict:
    """Times jaxkv's ragged step on this CPU (embedded tiny model) and fits it."""
    import time

    import jax

    from jaxkv.kv import init_state, kv_bytes_per_token
    from jaxkv.model.pretrained import load_default
    from jaxkv.runtime.batch import PageTable, Row, build_batch, pow2
    from jaxkv.runtime.sampling import SamplingArrays
    from jaxkv.runtime.steps import make_steps

    model = load_default()
    slots, width, page = 64, 64, 16
    steps = make_steps(model.graphdef)
    state = init_state(model.config, slots * width, page, model.dtype)
    table = PageTable(slots, width, slots * width, page)
    keys, sampling = np.zeros((slots, 2), np.uint32), SamplingArrays.greedy(slots)
    cases = [("p", n, s) for n, s in ((16, 0), (64, 0), (128, 0), (256, 0), (512, 0), (128, 384),
                                      (128, 768), (256, 512))]
    cases += [("d", b, c) for b, c in ((1, 64), (8, 64), (32, 64), (64, 64), (8, 512),
                                       (32, 512), (64, 512), (64, 900))]
    rows_x, times = [], []
    for kind, n, c in cases:
        if kind == "p":
            rows = [Row(0, [1] * n, c, range(cdiv(c + n, page)))]
            x = (n, 1, c + n, chunk_pairs(c, n))
        else:
            rows = [Row(b, [1], c, range(b * width, b * width + c // page + 1)) for b in range(n)]
            x = (n, n, n * (c + 1), n * (c + 1))
        batch = jax.device_put(build_batch(rows, table, tokens_bucket=max(16, pow2(x[0]))))
        samples = []
        for _ in range(6):
            t0 = time.perf_counter()
            out = steps.step(model.params, state, batch, keys, sampling)
            jax.block_until_ready(out)
            state = out[3]
            samples.append(time.perf_counter() - t0)
        rows_x.append(x)
        times.append(float(np.median(samples[1:])))
    from scipy.optimize import nnls

    coef = nnls(np.array([[1, *x] for x in rows_x], float), np.array(times))[0]
    fit = np.array([[1, *x] for x in rows_x], float) @ coef
    return dict(
        kind="measured", preset="tiny-llama (jaxkv.model.pretrained.load_default, f32)",
        kv_bytes_per_token=kv_bytes_per_token(model.config, model.dtype),
        kv_capacity_tokens=4 * 2**30 // kv_bytes_per_token(model.config, model.dtype),
        link_gbs=CPU_LINK["link_gbs"], link_latency_s=CPU_LINK["link_latency_s"],
        link=CPU_LINK["link"], time=dict(zip("abcde", map(float, coef), strict=True)),
        samples=[dict(x=list(map(int, x)), seconds=t, fit=float(f))
                 for x, t, f in zip(rows_x, times, fit, strict=True)],
        how=f"median of 5 timed runs of jaxkv's step (attention 'auto', {jax.default_backend()}) "
            "per case; nonnegative least squares on (1, T, R, C, A)")


def measure(path: Path, command: str = "jaxkv bench sim-disagg --measure") -> None:
    """Measures every model and writes them to ``path``, with ``command`` (how to redo it)."""
    import jax

    models = {"cpu": _cpu_model(), **{hw: _roofline_model(hw) for hw in HARDWARE}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(
        command=command,
        date=datetime.date.today().isoformat(), jax=jax.__version__, models=models),
        indent=1) + "\n")
    print(f"wrote {path}")
