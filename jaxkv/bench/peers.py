"""jaxkv against the engines a user would pick instead, on one checkpoint, in one run.

Builds a ~125M-parameter fp32 Llama locally (12 layers, hidden 768, 12 heads / 4 kv heads,
vocab 32,000; random weights: speed does not depend on the values), saves it as an HF
checkpoint, and runs four engine-independent workloads through:

- transformers ``generate`` (KV cache, static batching: each workload's concurrent prompts in
  one left-padded, masked batch);
- transformers continuous batching (``generate_batch``, paged);
- jaxkv ``Engine`` tuned (the engine settings below: max_model_len 1024, 2,048 pages, 512
  tokens per step);
- jaxkv ``LLM(model)`` with every default.

Workloads (greedy, EOS ignored, every request generates exactly its new tokens):
  single         1 prompt of 128 tokens, 256 new
  batch          16 prompts of 32-512 tokens, 128 new each
  shared_prefix  16 prompts = one 512-token prefix + distinct 32-token suffixes, 32 new each
  multiturn      4 conversations x 4 turns: turn 1 = 64 user tokens, turn k = previous prompt
                 + previous output + 64 new user tokens, 32 new per turn; each turn's 4
                 requests submitted together

Reports generated tokens/s, mean TTFT and mean TPOT (medians over --repeats runs after a
warm-up run), the ratio to transformers generate, whether greedy tokens agree, and a PNG.

    jaxkv bench peers [--repeats 3] [--threads 2] [--workloads single batch ...]
                      [--engines hf hf_cb jaxkv llm generate] [--out out/bench_peers.png]
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import tempfile
import time

import numpy as np

import jaxkv
from jaxkv.bench import common, hf
from jaxkv.model.loading import save_params

WORKLOADS = ("single", "batch", "shared_prefix", "multiturn")
ENGINES = {"hf": "transformers generate", "hf_cb": "transformers continuous batching",
           "jaxkv": "jaxkv Engine (tuned)", "llm": "jaxkv LLM(model) defaults",
           "generate": "jaxkv.generate"}


def add_arguments(parser) -> None:
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--out", default="out/bench_peers.png")
    # the tuned jaxkv Engine's settings (the LLM column keeps every default)
    common.add_engine_args(parser, page_size=16, num_pages=2048, max_model_len=1024,
                           max_num_batched_tokens=512)


def make_workload(name: str, vocab: int, seed: int) -> list[tuple[list[list[int]], int]]:
    """Rounds of (prompts submitted together, new tokens each). Multiturn rounds depend on
    the previous round's outputs: a prompt entry of ("turn", conversation, user tokens) is
    filled in by `run_rounds`."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return rng.integers(3, vocab, n).tolist()

    if name == "single":
        return [([toks(128)], 256)]
    if name == "batch":
        lengths = np.linspace(32, 512, 16).round().astype(int)
        rng.shuffle(lengths)
        return [([toks(int(n)) for n in lengths], 128)]
    if name == "shared_prefix":
        prefix = toks(512)
        return [([prefix + toks(32) for _ in range(16)], 32)]
    if name == "multiturn":
        return [([("turn", c, toks(64)) for c in range(4)], 32) for _ in range(4)]
    raise ValueError(f"unknown workload {name!r}")


@dataclasses.dataclass
class Run:
    seconds: float
    generated: int
    ttft: list[float]
    tpot: list[float]
    tokens: list[list[int]]  # outputs in submission order, all rounds


def run_rounds(rounds, generate_round) -> Run:
    """Runs the rounds through `generate_round(prompts, new) -> (outputs, ttfts, tpots)`."""
    history: dict[int, list[int]] = {}
    ttft, tpot, tokens, generated = [], [], [], 0
    t0 = time.perf_counter()
    for prompts, new in rounds:
        real = []
        for p in prompts:
            if isinstance(p, tuple):  # a multiturn turn: history + the new user tokens
                _, conv, user = p
                real.append(history.get(conv, []) + user)
            else:
                real.append(p)
        outs, ttfts, tpots = generate_round(real, new)
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            if isinstance(p, tuple):
                history[p[1]] = real[i] + o
        tokens += outs
        ttft += ttfts
        tpot += tpots
        generated += sum(len(o) for o in outs)
    return Run(time.perf_counter() - t0, generated, ttft, tpot, tokens)


def jaxkv_round(engine, prompts, new, counter):
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    ids = []
    for p in prompts:
        rid = str(next(counter))
        engine.add_request(rid, prompt_token_ids=p, sampling_params=sp)
        ids.append(rid)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    outs = [list(done[r].outputs[0].token_ids) for r in ids]
    ttft = [done[r].metrics.ttft for r in ids]
    tpot = [done[r].metrics.tpot or 0.0 for r in ids]
    return outs, ttft, tpot


def generate_round(model, prompts, new):
    """One round through `jaxkv.generate` (no state kept between calls); TTFT is the first
    token's time for every prompt (they are prefilled together)."""
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    outs, stats = jaxkv.generate_with_stats(model, prompts, sp)
    first, last = stats.token_times[0], stats.token_times[-1]
    tpot = (last - first) / max(new - 1, 1)
    return outs, [first] * len(prompts), [tpot] * len(prompts)


def build_engines(names, model, folder, threads, tuned: dict):
    """name -> generate_round for each engine, and (programs, warmup seconds) of jaxkv's."""
    runners, setup = {}, {}
    if "hf" in names or "hf_cb" in names:
        model_hf = hf.load(folder, threads)
        if "hf" in names:
            runners["hf"] = lambda p, n: hf.generate_round(model_hf, p, n)
        if "hf_cb" in names:
            runners["hf_cb"] = lambda p, n: hf.continuous_batching_round(model_hf, p, n)
    counter = itertools.count()
    if "jaxkv" in names:
        t = time.perf_counter()
        engine = jaxkv.Engine(model, **tuned)
        setup["jaxkv"] = (engine.warmup(), time.perf_counter() - t)
        runners["jaxkv"] = lambda p, n: jaxkv_round(engine, p, n, counter)
    if "llm" in names:
        t = time.perf_counter()
        llm = jaxkv.LLM(model)  # warms itself up: every program compiled
        setup["llm"] = (len(llm.engine.programs()), time.perf_counter() - t)
        runners["llm"] = lambda p, n: jaxkv_round(llm.engine, p, n, counter)
    if "generate" in names:  # compiles in the warm-up round of each workload
        runners["generate"] = lambda p, n: generate_round(model, p, n)
    return runners, setup


def _draw(ax, table, workloads, engines) -> None:
    width = 0.8 / len(engines)
    for j, e in enumerate(engines):
        vals = [table[(w, e)].generated / table[(w, e)].seconds if (w, e) in table else 0
                for w in workloads]
        ax.bar(np.arange(len(workloads)) + j * width, vals, width, label=ENGINES[e])
    ax.set_xticks(np.arange(len(workloads)) + width * (len(engines) - 1) / 2, workloads)
    ax.set_ylabel("generated tokens / s")
    ax.set_title("jaxkv vs transformers, 125M fp32 Llama, CPU")
    ax.legend(fontsize=8)


def run(args) -> dict:
    config = common.peer_config(args.layers, args.hidden)
    model = jaxkv.random_model(config, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        save_params(model.module(), folder)
        runners, setup = build_engines(args.engines, model, folder, args.threads,
                                       common.engine_kwargs(args))

    table: dict[tuple[str, str], Run] = {}  # the median run
    first: dict[tuple[str, str], Run] = {}  # the run on seed 0, for comparing tokens
    for w in args.workloads:
        for e in args.engines:
            # Fresh tokens every run: no run reuses the prefix cache of an earlier one.
            run_rounds(make_workload(w, config.vocab_size, seed=100), runners[e])  # warm-up
            runs = [run_rounds(make_workload(w, config.vocab_size, seed=i), runners[e])
                    for i in range(args.repeats)]
            first[(w, e)] = runs[0]
            table[(w, e)] = sorted(runs, key=lambda r: r.generated / r.seconds)[len(runs) // 2]

    print(f"model: {config.num_params() / 1e6:.0f}M params, {config.num_layers} layers, hidden "
          f"{config.hidden_size}, vocab {config.vocab_size}, fp32; greedy, EOS ignored; torch "
          f"threads {args.threads}; medians of {args.repeats} after a warm-up")
    for e, (n, sec) in setup.items():
        print(f"{ENGINES[e]}: warmup compiled {n} programs in {sec:.1f} s")
    print("| workload | " + " | ".join(ENGINES[e] for e in args.engines) + " |")
    print("|" + "---|" * (len(args.engines) + 1))
    cells_json = {}
    for w in args.workloads:
        cells = []
        base = table.get((w, "hf"))
        for e in args.engines:
            r = table[(w, e)]
            tps = r.generated / r.seconds
            cells_json[(w, e)] = dict(tok_s=tps, ttft_s=statistics.mean(r.ttft),
                                      tpot_s=statistics.mean(r.tpot), seconds=r.seconds)
            cell = (f"{tps:.1f} tok/s (TTFT {statistics.mean(r.ttft):.2f} s, TPOT "
                    f"{1e3 * statistics.mean(r.tpot):.0f} ms)")
            if base is not None and e != "hf":
                cell += f" {tps / (base.generated / base.seconds):.2f}x"
            cells.append(cell)
        print(f"| {w} | " + " | ".join(cells) + " |")
    agree = {}
    if "hf" in args.engines:
        for e in args.engines:
            if e == "hf":
                continue
            same = total = 0
            for w in args.workloads:
                for a, b in zip(first[(w, "hf")].tokens, first[(w, e)].tokens, strict=True):
                    total += 1
                    same += a == b
            agree[e] = dict(identical=same, requests=total)
            print(f"greedy tokens, {ENGINES[e]} vs transformers generate: {same}/{total} "
                  "requests identical")
    common.save_plot(args.out, lambda fig, ax: _draw(ax, table, args.workloads, args.engines),
                     figsize=(9, 4.5))
    return dict(warmup={e: dict(programs=n, seconds=s) for e, (n, s) in setup.items()},
                table=cells_json, greedy_vs_hf=agree)
