"""jaxkv against the engines a user would pick instead, on one checkpoint, in one run.

Builds a ~125M-parameter fp32 Llama locally (12 layers, hidden 768, 12 heads / 4 kv heads,
vocab 32,000; random weights: speed does not depend on the values), saves it as an HF
checkpoint, and runs four engine-independent workloads through:

- transformers ``generate`` (KV cache, static batching: each workload's concurrent prompts in
  one left-padded, masked batch);
- transformers continuous batching (``generate_batch``, paged);
- jaxkv ``Engine`` tuned (max_model_len 1024, 2,048 pages, 512 tokens per step);
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

    python scripts/bench_peers.py [--repeats 3] [--threads 2] [--workloads single batch ...]
                                  [--engines hf hf_cb jaxkv llm] [--out out/bench_peers.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time

import numpy as np

import jaxkv
from jaxkv.model.loading import save_params

WORKLOADS = ("single", "batch", "shared_prefix", "multiturn")
ENGINES = {"hf": "transformers generate", "hf_cb": "transformers continuous batching",
           "jaxkv": "jaxkv Engine (tuned)", "llm": "jaxkv LLM(model) defaults"}


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


# ---- transformers ------------------------------------------------------------------------

def hf_generate_round(hf, prompts, new, pad_id=0):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    times = []

    class Clock:  # a streamer: the time each step's tokens come out (the first: the prompt)
        def put(self, _):
            times.append(time.perf_counter())

        def end(self):
            pass

    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id,
                          streamer=Clock())
    first = times[1] - t if len(times) > 1 else times[-1] - t
    tpot = (times[-1] - times[1]) / max(new - 1, 1) if len(times) > 2 else 0.0
    outs = [out[row, width:].tolist() for row in range(len(prompts))]
    return outs, [first] * len(prompts), [tpot] * len(prompts)


def hf_cb_round(hf, prompts, new):
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)
    res = hf.generate_batch(prompts, generation_config=config, record_timestamps=True,
                            progress_bar=False, warmup=False)
    by_prompt = sorted(res.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    outs, ttft, tpot = [], [], []
    for r in by_prompt:
        outs.append(list(r.generated_tokens)[:new])
        ts = r.timestamps or []
        if ts:
            ttft.append(ts[0] - r.created_time)
            tpot.append((ts[-1] - ts[0]) / max(len(ts) - 1, 1))
    return outs, ttft, tpot


# ---- jaxkv -------------------------------------------------------------------------------

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


def build_engines(names, model, folder, threads):
    import itertools

    runners, setup = {}, {}
    if "hf" in names or "hf_cb" in names:
        import torch
        import transformers

        torch.set_num_threads(threads)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        if "hf" in names:
            runners["hf"] = lambda p, n: hf_generate_round(hf, p, n)
        if "hf_cb" in names:
            runners["hf_cb"] = lambda p, n: hf_cb_round(hf, p, n)
    counter = itertools.count()
    if "jaxkv" in names:
        t = time.perf_counter()
        engine = jaxkv.Engine(model, page_size=16, num_pages=2048, max_model_len=1024,
                              max_num_batched_tokens=512)
        setup["jaxkv"] = (engine.warmup(), time.perf_counter() - t)
        runners["jaxkv"] = lambda p, n: jaxkv_round(engine, p, n, counter)
    if "llm" in names:
        t = time.perf_counter()
        llm = jaxkv.LLM(model)
        setup["llm"] = (llm.engine.warmup(), time.perf_counter() - t)
        runners["llm"] = lambda p, n: jaxkv_round(llm.engine, p, n, counter)
    return runners, setup


def save_plot(path, table, workloads, engines):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(engines)
    for j, e in enumerate(engines):
        vals = [table[(w, e)].generated / table[(w, e)].seconds if (w, e) in table else 0
                for w in workloads]
        ax.bar(np.arange(len(workloads)) + j * width, vals, width, label=ENGINES[e])
    ax.set_xticks(np.arange(len(workloads)) + width * (len(engines) - 1) / 2, workloads)
    ax.set_ylabel("generated tokens / s")
    ax.set_title("jaxkv vs transformers, 125M fp32 Llama, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--out", default="out/bench_peers.png")
    args = parser.parse_args(argv)

    heads = args.hidden // 64
    config = jaxkv.ModelConfig(vocab_size=32000, hidden_size=args.hidden,
                               intermediate_size=2048 * args.hidden // 768,
                               num_layers=args.layers, num_heads=heads,
                               num_kv_heads=max(1, heads // 3), head_dim=64,
                               tie_word_embeddings=False, max_position_embeddings=4096)
    model = jaxkv.random_model(config, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        save_params(model.module(), folder)
        runners, setup = build_engines(args.engines, model, folder, args.threads)

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
    head = "| workload | " + " | ".join(ENGINES[e] for e in args.engines) + " |"
    print(head)
    print("|" + "---|" * (len(args.engines) + 1))
    for w in args.workloads:
        cells = []
        base = table.get((w, "hf"))
        for e in args.engines:
            r = table[(w, e)]
            tps = r.generated / r.seconds
            cell = (f"{tps:.1f} tok/s (TTFT {statistics.mean(r.ttft):.2f} s, TPOT "
                    f"{1e3 * statistics.mean(r.tpot):.0f} ms)")
            if base is not None and e != "hf":
                cell += f" {tps / (base.generated / base.seconds):.2f}x"
            cells.append(cell)
        print(f"| {w} | " + " | ".join(cells) + " |")
    if "hf" in args.engines:
        for e in args.engines:
            if e == "hf":
                continue
            same = total = 0
            for w in args.workloads:
                for a, b in zip(first[(w, "hf")].tokens, first[(w, e)].tokens, strict=True):
                    total += 1
                    same += a == b
            print(f"greedy tokens, {ENGINES[e]} vs transformers generate: {same}/{total} "
                  "requests identical")
    save_plot(args.out, table, args.workloads, args.engines)
    print(f"plot: {args.out}")
    print("reproduce: python scripts/bench_peers.py " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
