"""Prefill/decode disaggregation vs colocated serving, simulated: SLO attainment and goodput.

Splitwise/DistServe disaggregation against colocated serving: a discrete-event simulation
driven by step-time models, reporting TTFT/TPOT, SLO attainment and goodput.

This module holds the scenarios, the goodput search and the report (table + PNG) of
`jaxkv bench sim-disagg`; the event loop is `serving_sim`, the step-time models (and their
measurement) `step_models`.

    jaxkv bench sim-disagg                  # tables + docs/plots/sim_disagg.png
    jaxkv bench sim-disagg --measure        # refit scripts/data/step_models.json
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from jaxkv.bench import common
from jaxkv.bench.sim import step_models
from jaxkv.bench.sim.serving_sim import (
    WORKLOADS,
    Result,
    base_trace,
    parse_config,
    requests_at,
    simulate,
)
from jaxkv.bench.sim.step_models import DATA, StepModel, load_models

NAME = "sim-disagg"
PLOT = common.REPO / "docs" / "plots" / "sim_disagg.png"
TARGET = 0.9  # DistServe: goodput is the highest rate at which >= 90% of requests meet both SLOs

# Scenarios: workload, SLOs as multiples of the unloaded single-request times of the hardware
# (TTFT: prefill of a 1024-token prompt; TPOT: one decode step at 1024 tokens of context), the
# token budget of a step (None: --budget), link (None: the hardware's default; else GB/s).
SCENARIOS = {
    "sharegpt-loose": dict(workload="sharegpt", ttft_x=10.0, tpot_x=5.0, budget=None,
                           link_gbs=None),
    "long-tight": dict(workload="long", ttft_x=4.0, tpot_x=1.5, budget=None, link_gbs=None),
    "long-tight-2k": dict(workload="long", ttft_x=4.0, tpot_x=1.5, budget=2048, link_gbs=None),
    "long-2k-slowlink": dict(workload="long", ttft_x=4.0, tpot_x=1.5, budget=2048,
                             link_gbs=1.25),
}

# ---- goodput ---------------------------------------------------------------------------------


def goodput(attainment_at, lo: float, *, factor: float = 1.5, iters: int = 5,
            max_rate: float = 1e6) -> float:
    """Highest rate (req/s) before the first one, scanning up from ``lo`` by ``factor`` and then
    bisecting, whose attainment is below TARGET (scanning down first, at most 8 steps, when
    ``lo`` fails; 0 if all of those fail)."""
    good = lo
    while attainment_at(good) < TARGET:
        good /= factor
        if good < lo / factor**8:
            return 0.0
    while attainment_at(good * factor) >= TARGET:
        good *= factor
        if good > max_rate:
            raise RuntimeError(f"attainment stays >= {TARGET} past {max_rate} req/s")
    bad = good * factor
    for _ in range(iters):
        mid = math.sqrt(good * bad)
        good, bad = (mid, bad) if attainment_at(mid) >= TARGET else (good, mid)
    return good


def slos(model: StepModel, scenario: dict) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in seconds for a scenario on a hardware model."""
    return (scenario["ttft_x"] * model.prefill_time(1024),
            scenario["tpot_x"] * model.decode_time(1, 1024))


# ---- report ----------------------------------------------------------------------------------


def _ms(x: np.ndarray, q: float) -> str:
    return f"{1e3 * float(np.percentile(x, q)):.1f}"


def study(model: StepModel, scenario: dict, configs: list[str], *, requests: int, seed: int,
          budget: int, max_seqs: int):
    """Per config: goodput, and attainment at every rate simulated ({rate: Result})."""
    ttft_slo, tpot_slo = slos(model, scenario)
    base = base_trace(scenario["workload"], requests, seed)
    w = WORKLOADS[scenario["workload"]]
    # a low first rate: a tenth of what one chip decodes at batch 64
    lo = 0.1 * 64 / (w["output_mean"] * model.decode_time(64, 512))
    out = {}
    for config in configs:
        runs: dict[float, Result] = {}

        def attainment(rate, config=config, runs=runs):
            if rate not in runs:
                runs[rate] = simulate(model, config, requests_at(base, rate),
                                      budget=scenario["budget"] or budget, max_seqs=max_seqs,
                                      link_gbs=scenario["link_gbs"])
            return runs[rate].attainment(ttft_slo, tpot_slo)

        out[config] = (goodput(attainment, lo), runs, attainment)
    return (ttft_slo, tpot_slo), out


def _draw(fig, axes, panels) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    hws = sorted({hw for hw, _ in panels}, key=[hw for hw, _ in panels].index)
    scs = sorted({sc for _, sc in panels}, key=[sc for _, sc in panels].index)
    for (hw, sc), (slo, curves) in panels.items():
        ax = axes[hws.index(hw)][scs.index(sc)]
        for config, (rates, att) in curves.items():
            ax.plot(rates, att, marker=".", label=config,
                    linestyle="-" if config.startswith("colo") else "--")
        ax.axhline(TARGET, color="gray", linewidth=0.8)
        ax.set_xscale("log")
        # a 16x range holds one power of ten: label 1-2-5 steps, not the crowded minor ticks
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", which="both", labelsize=7)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{hw}: {sc}\nTTFT<={1e3 * slo[0]:.0f} ms, TPOT<={1e3 * slo[1]:.1f} ms",
                     fontsize=9)
        ax.set_xlabel("request rate (req/s)", fontsize=8)
        ax.set_ylabel("SLO attainment", fontsize=8)
        ax.legend(fontsize=7)


def report(args, data: Path) -> list[dict]:
    """Prints the goodput table (one row per hardware x scenario x config), draws the plot;
    returns the rows."""
    models = load_models(data)
    chips = sum(parse_config(args.configs[0]))
    print(f"| hw | scenario | SLO TTFT / TPOT ms | config | goodput req/s | per chip | "
          f"rate | attain | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms |\n|{'---|' * 10}")
    panels, rows = {}, []
    for hw in args.hardware:
        for sc in args.scenarios:
            slo, results = study(models[hw], SCENARIOS[sc], args.configs, requests=args.requests,
                                 seed=args.seed, budget=args.budget, max_seqs=args.max_seqs)
            ref = max(results[args.configs[0]][0], min(r for _, rs, _ in results.values()
                                                       for r in rs))
            top = 2 * max(g for g, *_ in results.values()) or 2 * ref
            grid = np.geomspace(top / 16, top, 8)
            curves = {}
            for config, (good, runs, attainment) in results.items():
                curves[config] = (grid, [attainment(float(r)) for r in grid])
                attainment(ref)
                res = runs[ref]
                rows.append(dict(hw=hw, scenario=sc, slo_s=slo, config=config, goodput=good,
                                 per_chip=good / chips, rate=ref,
                                 attainment=res.attainment(*slo),
                                 ttft_s={q: float(np.percentile(res.ttft, q))
                                         for q in (50, 90, 99)},
                                 tpot_s={q: float(np.percentile(res.tpot, q))
                                         for q in (50, 90, 99)}))
                print(f"| {hw} | {sc} | {1e3 * slo[0]:.0f} / {1e3 * slo[1]:.1f} | {config} | "
                      f"{good:.2f} | {good / chips:.2f} | {ref:.2f} | "
                      f"{res.attainment(*slo):.2f} | "
                      f"{'/'.join(_ms(res.ttft, q) for q in (50, 90, 99))} | "
                      f"{'/'.join(_ms(res.tpot, q) for q in (50, 90, 99))} |", flush=True)
            panels[(hw, sc)] = (slo, curves)
    out = PLOT if args.out is None else args.out
    if out:
        hws, scs = {hw for hw, _ in panels}, {sc for _, sc in panels}
        common.save_plot(out, lambda fig, axes: _draw(fig, axes, panels), dpi=90,
                         nrows=len(hws), ncols=len(scs),
                         figsize=(4.2 * len(scs), 3.2 * len(hws)), squeeze=False)
    return rows


def add_arguments(p) -> None:
    p.add_argument("--measure", action="store_true",
                   help="refit the step-time models into --data (about 4 minutes; needs a "
                        "source checkout with the aot extra: make test-aot)")
    p.add_argument("--data", type=Path, default=None,
                   help=f"the step-time models' JSON (default {DATA.relative_to(common.REPO)} "
                        "of the checkout)")
    p.add_argument("--hardware", nargs="+", default=["h200", "v5e", "cpu"],
                   choices=["h200", "v5e", "cpu"])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--configs", nargs="+", default=["colo4", "1p3d", "2p2d", "3p1d"],
                   help="colo<N> (N colocated chips) or <x>p<y>d; same chip count in all")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=512, help="tokens per step (jaxkv's default)")
    p.add_argument("--max-seqs", type=int, default=256)
    p.add_argument("--out", default=None,
                   help="PNG path (default docs/plots/sim_disagg.png of the checkout; '' for "
                        "none)")


def run(args) -> dict:
    data = args.data or DATA
    if args.measure:
        step_models.measure(Path(data), command=f"jaxkv bench {NAME} --measure")
        return {"measured": str(data)}
    for config in args.configs:
        try:
            parse_config(config)
        except ValueError as e:
            raise common.UsageError(str(e)) from None
    if len({sum(parse_config(c)) for c in args.configs}) != 1:
        raise common.UsageError(f"--configs must all use the same number of chips, got "
                                f"{args.configs}")
    for name in ("requests", "budget", "max_seqs"):
        if getattr(args, name) < 1:
            raise common.UsageError(f"--{name.replace('_', '-')} must be >= 1, got "
                                    f"{getattr(args, name)}")
    if args.max_seqs >= args.budget:
        raise common.UsageError("--max-seqs must be below --budget (decodes would leave no "
                                "room for prompts)")
    if not Path(data).is_file():
        raise common.UsageError(f"no step-time models at {data}: run with --measure first")
    return {"rows": report(args, data)}
