"""Speculative decoding on an H200 and a TPU v5e, estimated: the roofline step-time models of
the compiled steps' cost analysis, with the acceptance measured on this machine.

No device runs here. The step-time models are `jaxkv bench sim-disagg --measure`'s
(scripts/data/step_models.json): FLOPs from ``cost_analysis()`` of jaxkv's ragged step
compiled for v5e (XLA:TPU, libtpu's compile-only topology) and lowered for CUDA for the H200,
at 1 and 2 layers over (T, R) buckets, and bytes counted (weights, KV written and read, f32
logits); a step takes ``max(FLOPs / peak, bytes / bandwidth)`` plus a host round trip
(``overhead_s``, assumed). The targets are the models' presets: Llama-3-8B on the H200,
Llama-3.2-1B on the v5e, bf16.

Per verification round of a batch of R rows at context C, with k drafts and E tokens emitted
per verification (the mean accepted length `jaxkv bench spec` measured, at batch 1):

- off: one decode step per host round trip (``max_decode_steps`` defaults to 1 on GPU/TPU);
- verification: one ragged step of R(k + 1) tokens, one round trip;
- ngram: proposals on the host (no device time);
- self: k steps of the target's first half of the layers and its LM head (the layers' FLOPs
  from the 1- and 2-layer compiles, their weights and KV in proportion);
- draft: k steps of the target's int4-g32 copy (0.625 bytes per layer weight with its scales,
  an int8 LM head and embedding; the target's FLOPs), or, on the H200 only, of Llama-3.2-1B in
  int4-g32 (the v5e compile's FLOPs for it), the first over the tokens accepted last round;

speedup = E x (one decode step) / (proposal + verification). "no overhead" sets the round trip
to 0 (the pure roofline). Acceptance at batch 4 and 16 is taken equal to batch 1's.

    jaxkv bench spec-roofline [--spec-json PATH] [--batches 1 4 16] [--context 512]
"""

from __future__ import annotations

import json

import numpy as np

from jaxkv.bench.sim.step_models import StepModel

NAME = "spec-roofline"
# (method, workload) -> (k, tokens per verification): `jaxkv bench spec --model smollm2
# --methods off ngram self draft --workloads grounded chat --batches 1` on the 2-core CPU,
# 2026-12-06 (docs/BENCHMARKS.md#speculative-decoding-issue-29); --spec-json replaces them.
MEASURED = {
    ("ngram", "grounded"): (7, 6.82), ("ngram", "chat"): (7, 4.19),
    ("self", "grounded"): (3, 1.25), ("self", "chat"): (3, 1.00),
    ("draft", "grounded"): (3, 4.00), ("draft", "chat"): (3, 3.64),
}
INT4_G32 = 0.5 + 4 / 32  # bytes per weight: 4 bits, a bf16 scale and offset per 32


def add_arguments(parser) -> None:
    parser.add_argument("--spec-json", default=None,
                        help="the acceptance of a `jaxkv bench spec --json` run (its batch-1 "
                             "rows) instead of the measured defaults")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=512,
                        help="tokens each row holds (prompt and output so far)")
    parser.add_argument("--data", default=None, help="the step-time models' JSON")


def decode(model, rows: int, ctx: int, tokens_per_row: int = 1) -> float:
    """Seconds of a step of ``tokens_per_row`` tokens on each of ``rows`` rows holding ``ctx``
    tokens (a `StepModel` of no host round trip: `round_seconds` adds that once)."""
    t = rows * tokens_per_row
    return model.step_time(t, rows, rows * ctx, t * ctx)


def models(entry: dict, shape, chip: dict | None = None) -> dict[str, StepModel]:
    """The target of a step-time model entry and its drafts: "self" (half the layers), "int4"
    (the target's int4-g32 copy). ``chip`` (peak_flops, bandwidth) moves the entry's FLOPs to
    another chip (a draft measured as another chip's target)."""
    r = dict(entry["roofline"])
    if chip:
        r.update(chip)
    rows = entry["compiled_flops"]  # [layers, T, R, flops]: per-step and per-layer parts
    x = np.array([[1, t, rr, n, n * t] for n, t, rr, _ in rows], float)
    c0, cT, cR, l0, lT = np.linalg.lstsq(x, np.array([f for *_, f in rows]), rcond=None)[0]
    L, head = shape.num_layers, 2.0 * shape.vocab_size * shape.hidden_size
    layers = r["bytes0"] - head  # bf16 layer weights (bytes0 holds them and the LM head)
    r["overhead_s"] = 0.0
    half = L // 2
    kv_share = half / L
    drafts = {
        "target": {},
        "self": dict(f0=c0 + half * l0, fT=cT + half * lT, fA=r["fA"] * kv_share,
                     bytes0=head + layers * half / L, bT=r["bT"] * kv_share,
                     bC=r["bC"] * kv_share),
        # bf16 -> int4-g32 layer weights; the LM head (tied or not) int8 per row
        "int4": dict(bytes0=layers / 2 * INT4_G32 + head / 2),
    }
    return {name: StepModel(name, 0, 0, 0.0, 0.0, roofline={**r, **edits})
            for name, edits in drafts.items()}


def _acceptance(path: str | None) -> dict:
    if path is None:
        return dict(MEASURED)
    data = json.loads(open(path).read())
    k = data["args"].get("k")
    got = {}
    for row in data["results"]["rows"]:
        if row["batch"] == 1 and row["mean_accepted_length"]:
            default_k = 7 if row["method"] == "ngram" else 3
            got[row["method"], row["workload"]] = (k or default_k, row["mean_accepted_length"])
    return got


def round_seconds(draft: str | None, k: int, mean: float, rows: int, ctx: int, m: dict,
                  overhead: float) -> float:
    """Seconds of one verification round: the proposal by ``m[draft]`` (None: on the host),
    the verification, one host round trip."""
    verify = decode(m["target"], rows, ctx, k + 1)
    if draft is None:
        propose = 0.0
    else:
        draft = m[draft]
        # the first draft step reads the tokens accepted last round (about `mean` per row)
        propose = decode(draft, rows, ctx, max(1, round(mean))) + \
            (k - 1) * decode(draft, rows, ctx)
    return propose + verify + overhead


def run(args) -> dict:
    from jaxkv.bench.sim.step_models import DATA
    from jaxkv.cache.memory import PRESETS

    raw = json.loads(open(args.data or DATA).read())["models"]
    chips = {
        "h200": models(raw["h200"], PRESETS["llama-3-8b"]),
        "v5e": models(raw["v5e"], PRESETS["llama-3.2-1b"]),
    }
    h200 = {k: raw["h200"]["roofline"][k] for k in ("peak_flops", "bandwidth")}
    small = models(raw["v5e"], PRESETS["llama-3.2-1b"], chip=h200)["int4"]
    chips["h200"]["draft-1b"] = small  # Llama-3.2-1B int4-g32 drafting for the 8B target
    measured = _acceptance(args.spec_json)
    print(f"estimated, not measured: roofline step models of {args.data or DATA.name} "
          f"(cost_analysis of the compiled steps), context {args.context}, acceptance from "
          f"{args.spec_json or 'jaxkv bench spec on the 2-core CPU, batch 1 (MEASURED)'}")
    print(f"{'chip':<5} {'target':<13} {'workload':<9} {'method':<9} {'k':>2} {'E':>5} "
          f"{'batch':>5} {'decode ms':>9} {'round ms':>8} {'speedup':>8} {'no overhead':>11}")
    rows_out = []
    for chip, m in chips.items():
        entry = raw[chip]
        overhead = entry["roofline"]["overhead_s"]
        for (method, workload), (k, mean) in sorted(measured.items(), key=lambda x: x[0][1]):
            drafts = {"ngram": [None], "self": ["self"]}.get(method, ["int4", "draft-1b"])
            for draft in (d for d in drafts if d is None or d in m):
                name = method if draft in (None, "self", "int4") else draft
                for b in args.batches:
                    step = decode(m["target"], b, args.context)
                    per_round = {o: round_seconds(draft, k, mean, b, args.context, m, o)
                                 for o in (overhead, 0.0)}
                    speed = {o: mean * (step + o) / per_round[o] for o in per_round}
                    rows_out.append(dict(chip=chip, target=entry["preset"], workload=workload,
                                         method=name, k=k, mean_accepted_length=mean, batch=b,
                                         decode_ms=1e3 * step,
                                         round_ms=1e3 * per_round[overhead],
                                         speedup=speed[overhead], speedup_no_overhead=speed[0.0]))
                    print(f"{chip:<5} {entry['preset']:<13} {workload:<9} {name:<9} {k:>2} "
                          f"{mean:>5.2f} {b:>5} {1e3 * step:>9.3f} "
                          f"{1e3 * per_round[overhead]:>8.3f} {speed[overhead]:>7.2f}x "
                          f"{speed[0.0]:>10.2f}x")
    return {"rows": rows_out, "overhead_s": {c: raw[c]["roofline"]["overhead_s"] for c in chips}}
