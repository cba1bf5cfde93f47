"""Offline throughput: jaxkv's LLM (continuous batching, paged KV) vs HF transformers generate.

Builds a ~110M-parameter Llama-shaped model locally (fp32, random weights: speed does not
depend on the values), saves it as an HF checkpoint, and runs the same workload through
`jaxkv.LLM` and through `transformers` `generate` on that checkpoint, in one process:
P prompts of mixed lengths (32-512 tokens, fixed seed), N new tokens each, greedy, no EOS.

transformers runs the CPU best practice: prompts batched with left padding and an attention
mask (each batch size given by --hf-batch is measured; with batches smaller than P the prompts
are grouped by length to cut padding), torch threads = --threads. Both engines are warmed up
first (jaxkv compiles every program on a same-shaped workload of other tokens; transformers
runs one short batch). jaxkv runs with prefix caching off: the prompts share no prefix, and
HF has no cross-request cache either.

Also reports jaxkv's KV memory at its peak (pages held x page bytes) against a contiguous
reservation of max_model_len per sequence, and how many greedy outputs agree exactly.

    jaxkv bench throughput [--prompts 16] [--new-tokens 128] [--layers 12] [--hidden 768]
                           [--hf-batch 16 8] [--out bench_throughput.png]
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

import numpy as np

import jaxkv
from jaxkv.bench import common, hf
from jaxkv.config import cdiv
from jaxkv.engine.llm import kv_bytes_per_token
from jaxkv.model.loading import save_params


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768,
                        help="hidden size; heads = hidden / 64, MLP = hidden * 8/3")
    parser.add_argument("--hf-batch", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--compare", type=int, default=4, help="prompts whose tokens are compared")
    parser.add_argument("--out", default="bench_throughput.png")
    # num_pages, by default: what the workload needs with all prompts running at once
    common.add_engine_args(parser, page_size=16, num_pages=None, max_num_batched_tokens=512,
                           enable_prefix_caching=False)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts, lengths spread evenly over [lo, hi] (shuffled), random token ids."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(lo, hi, n).round().astype(int) if n > 1 else np.array([hi])
    rng.shuffle(lengths)
    return [rng.integers(3, vocab, int(k)).tolist() for k in lengths]


class PeakTracker:
    """Wraps Engine.step: after every step records pages held and KV tokens stored."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step
        self.peak_pages = self.peak_tokens = self.peak_seqs = 0
        self.bound_ok = True  # every step: held slots - stored tokens < one page per sequence

    def __call__(self):
        out = self.step()
        running = self.engine.scheduler.running
        pages = self.engine.stats().kv_pages_used
        tokens = sum(r.num_computed_tokens for r in running)
        if pages * self.engine.page_size - tokens >= max(1, len(running)) * self.engine.page_size:
            self.bound_ok = False
        if pages > self.peak_pages:
            self.peak_pages, self.peak_tokens, self.peak_seqs = pages, tokens, len(running)
        return out


def run_jaxkv(model, prompts, warm_prompts, new_tokens, **engine_kw):
    """The prompts through `jaxkv.LLM(model, **engine_kw)` after a same-shaped warm-up:
    (outputs, tokens generated, seconds, the peak tracker, preemptions)."""
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm = jaxkv.LLM(model, **engine_kw)
    llm.generate(prompt_token_ids=warm_prompts, sampling_params=sp, use_tqdm=False)
    tracker = PeakTracker(llm.engine)
    llm.engine.step = tracker
    before = llm.stats().generated_tokens
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    seconds = time.perf_counter() - t
    generated = llm.stats().generated_tokens - before
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, generated, seconds, tracker, llm.stats().preemptions


def run_hf(folder, prompts, new_tokens, batches, threads):
    model = hf.load(folder, threads)
    hf.generate_batches(model, [p[:32] for p in prompts[:2]], 4, 2)  # first-call warm-up
    runs = {}
    for b in batches:
        t = time.perf_counter()
        tokens, generated = hf.generate_batches(model, prompts, new_tokens, b)
        runs[b] = (tokens, generated, time.perf_counter() - t)
    return runs


def _draw(axes, rows, kv_rows) -> None:
    ax1, ax2 = axes
    ax1.bar([r[0] for r in rows], [r[3] for r in rows],
            color=["tab:blue"] + ["tab:gray"] * (len(rows) - 1))
    ax1.set_ylabel("generated tokens / s")
    ax1.set_title("Throughput")
    ax1.tick_params(axis="x", labelrotation=15)
    ax2.bar([r[0] for r in kv_rows], [r[1] / 2**20 for r in kv_rows],
            color=["tab:blue"] + ["tab:gray"] * (len(kv_rows) - 1))
    ax2.set_ylabel("KV MiB")
    ax2.set_title("KV memory at peak")
    ax2.tick_params(axis="x", labelrotation=15)


def run(args) -> dict:
    config = jaxkv.ModelConfig.bench(num_layers=args.layers, hidden_size=args.hidden)
    config = dataclasses.replace(config, max_position_embeddings=max(
        config.max_position_embeddings, args.max_len + args.new_tokens))
    vocab = config.vocab_size
    max_len = max(args.min_len, args.max_len)
    prompts = make_prompts(args.prompts, args.min_len, max_len, vocab, seed=0)
    warm = [np.random.default_rng(1).integers(3, vocab, len(p)).tolist() for p in prompts]
    model = jaxkv.random_model(config, seed=0)
    page = args.page_size
    kw = common.engine_kwargs(
        args, num_pages=sum(cdiv(len(p) + args.new_tokens - 1, page) for p in prompts),
        max_num_seqs=max(len(prompts), 1),
        max_model_len=max(len(p) for p in prompts) + args.new_tokens)

    with tempfile.TemporaryDirectory() as folder:
        save_params(model.module(), folder)
        j_tokens, j_gen, j_sec, tr, preemptions = run_jaxkv(model, prompts, warm,
                                                            args.new_tokens, **kw)
        hf_runs = run_hf(folder, prompts, args.new_tokens, args.hf_batch, args.threads)

    rows = [("jaxkv LLM", j_gen, j_sec, j_gen / j_sec)]
    for b, (_, gen, sec) in hf_runs.items():
        rows.append((f"transformers b={b}", gen, sec, gen / sec))
    best_hf = max(rows[1:], key=lambda r: r[3])

    lens = [len(p) for p in prompts]
    print(f"model: {config.num_params() / 1e6:.0f}M params, {config.num_layers} layers, "
          f"hidden {config.hidden_size}, fp32; {args.prompts} prompts of {min(lens)}-{max(lens)} "
          f"tokens (sum {sum(lens)}), {args.new_tokens} new tokens each, greedy, ignore_eos; "
          f"{common.device_line()}, torch threads {args.threads}")
    print(f"jaxkv: page_size {page}, num_pages {kw['num_pages']}, max_model_len "
          f"{kw['max_model_len']}, max_num_batched_tokens {kw['max_num_batched_tokens']}, "
          f"max_num_seqs {kw['max_num_seqs']}, prefix caching "
          f"{'on' if kw['enable_prefix_caching'] else 'off'}, preemptions {preemptions}")
    print(f"\n{'engine':<20} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs best HF':>11}")
    for name, gen, sec, tps in rows:
        print(f"{name:<20} {gen:>7} {sec:>8.1f} {tps:>8.1f} {tps / best_hf[3]:>10.2f}x")
    print(f"jaxkv / best transformers ({best_hf[0]}): {rows[0][3] / best_hf[3]:.2f}x")

    # KV memory: paged (pages held at the peak step) vs a contiguous max-length reservation.
    token_bytes = kv_bytes_per_token(model)
    page_bytes = token_bytes * page
    stored = tr.peak_tokens
    kv_rows = [(f"paged (peak, {tr.peak_pages} pages)", tr.peak_pages * page_bytes,
                tr.peak_pages * page)]
    for length, label in ((kw["max_model_len"], "max_model_len"),
                          (config.max_position_embeddings, "model max")):
        kv_rows.append((f"contiguous {args.prompts}x{length} ({label})",
                        args.prompts * length * token_bytes, args.prompts * length))
    print(f"\nKV at jaxkv's peak: {tr.peak_seqs} sequences storing {stored} tokens; page = "
          f"{page} tokens x {token_bytes:,} B = {page_bytes:,} B")
    print(f"{'layout':<42} {'MiB':>9} {'wasted':>7}")
    for name, nbytes, slots in kv_rows:
        print(f"{name:<42} {nbytes / 2**20:>9.1f} {1 - stored / slots:>7.1%}")
    bound = tr.peak_seqs * (page - 1) / (tr.peak_pages * page) if tr.peak_pages else 0.0
    print(f"paging bound (one partial page per sequence): waste <= {bound:.1%} at the peak; "
          f"held every step: {'yes' if tr.bound_ok else 'NO'}")

    # Greedy agreement (fp32; padding and batch shapes can flip near-ties, so only reported).
    k = min(args.compare, len(prompts))
    agree = {}
    for b, (hf_tokens, _, _) in hf_runs.items():
        exact = sum(j_tokens[i] == hf_tokens[i] for i in range(k))
        prefix = [next((t for t, (a, c) in enumerate(zip(j_tokens[i], hf_tokens[i], strict=True))
                        if a != c), args.new_tokens) for i in range(k)]
        agree[b] = dict(identical=exact, compared=k, first_mismatch=prefix)
        print(f"greedy tokens vs transformers b={b}: {exact}/{k} prompts identical; "
              f"first mismatch at {prefix}")

    common.save_plot(args.out, lambda fig, axes: _draw(axes, rows, kv_rows), dpi=100,
                     ncols=2, figsize=(10, 4))
    keys = ("engine", "tokens", "seconds", "tok_s")
    return dict(engine=kw, preemptions=preemptions,
                rows=[dict(zip(keys, r, strict=True)) for r in rows],
                kv=[dict(layout=n, bytes=b, slots=s, stored=stored) for n, b, s in kv_rows],
                paging_bound=bound, bound_held_every_step=tr.bound_ok, greedy_vs_hf=agree)
