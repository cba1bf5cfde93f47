"""Host-memory KV tier off vs on: multi-turn chat with more conversations than the device keeps.

`--conversations` conversations x `--turns` turns; each turn's prompt = the conversation's whole
history (earlier prompts and replies) + a new user message of `--user-min`..`--user-max` random
tokens; every reply is `--new-tokens` greedy tokens (ignore_eos). Turns are interleaved: turn t
of every conversation runs before turn t + 1 of any (a barrier between turns), each turn's
requests through a closed loop of `--max-num-seqs` in flight. The device pool holds about
`--pool-convs` conversations' final histories (num_pages computed from the drawn lengths), so
by the time a conversation's next turn comes, the other conversations have pushed its history
out of the device prefix cache. Without the host tier (``host_kv_cache_bytes=0``) that history
is recomputed every turn; with it, the evicted pages wait in host memory and are copied back.

Both configurations run in one process on the same model and the same prompts (a turn's prompt
embeds the previous greedy replies, so the prompts match as long as the outputs do; the script
checks that every greedy output is identical). Each engine is warmed up (`Engine.warmup`:
every program compiled) before the clock starts. Reported per configuration: prompt tokens
recomputed (``computed_prompt_tokens``) and served from the device / host cache, TTFT per turn
(the engine's metric: first token - add_request, mean / p50 / p90 over the conversations),
wall time, output tokens/s and host bytes in use.

    jaxkv bench host-tier [--model smollm2] [--conversations 32] [--turns 6]
        [--new-tokens 32] [--kv-cache-dtype int8] [--host-gib 1] [--out out/bench_host_tier.png]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jaxkv
from jaxkv.bench import common
from jaxkv.config import cdiv
from jaxkv.engine.llm import kv_bytes_per_token
from jaxkv.runtime.compiles import count_compiles


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="tiny (the embedded model), smollm2, or a checkpoint path")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-min", type=int, default=24, help="shortest user message")
    parser.add_argument("--user-max", type=int, default=48, help="longest user message")
    parser.add_argument("--new-tokens", type=int, default=32, help="reply tokens per turn")
    parser.add_argument("--pool-convs", type=int, default=4,
                        help="the device pool holds this many conversations' final histories")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="host tier size (default: every conversation's history fits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="PNG plot path, e.g. out/bench_host_tier.png")
    # max_num_seqs is also the closed loop's requests in flight; num_pages and max_model_len
    # come from the drawn lengths (--pool-convs)
    common.add_engine_args(parser, max_num_seqs=4, page_size=16, max_num_batched_tokens=512,
                           kv_cache_dtype="auto", num_pages=None, max_model_len=None)


def serve(engine: jaxkv.Engine, users: list[list[list[int]]], args) -> dict:
    """Serves every turn (barrier between turns); per turn: TTFTs, prompt lengths, stat deltas."""
    sampling = jaxkv.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    history = [[] for _ in users]
    outputs, turns = {}, []
    start = time.perf_counter()
    for t in range(args.turns):
        before, ttft, lens = engine.stats(), [], []
        queue, inflight = list(range(len(users))), 0
        while queue or engine.has_unfinished_requests():
            while queue and inflight < args.max_num_seqs:  # closed loop: refill freed slots
                c = queue.pop(0)
                prompt = history[c] + users[c][t]
                lens.append(len(prompt))
                engine.add_request(f"c{c}t{t + 1}", prompt_token_ids=prompt,
                                   sampling_params=sampling)
                inflight += 1
            for out in engine.step():
                if out.finished:
                    inflight -= 1
                    c = int(out.request_id[1:].split("t")[0])
                    outputs[out.request_id] = reply = out.outputs[0].token_ids
                    history[c] = out.prompt_token_ids + reply
                    ttft.append(out.metrics.ttft)
        after = engine.stats()
        d = {k: getattr(after, k) - getattr(before, k) for k in (
            "computed_prompt_tokens", "cached_prompt_tokens", "device_hit_tokens",
            "host_hit_tokens", "prompt_tokens", "generated_tokens", "preemptions")}
        turns.append(dict(d, turn=t + 1, ttft=np.array(ttft), prompt_len=float(np.mean(lens)),
                          host_bytes=after.host_kv_bytes))
    return dict(turns=turns, outputs=outputs, wall=time.perf_counter() - start,
                stats=engine.stats(), host_bytes_max=max(t["host_bytes"] for t in turns))


def _draw(axes, res: dict) -> None:
    ax1, ax2 = axes
    colors = {"off": "tab:red", "on": "tab:green"}
    for mode, r in res.items():
        x = [t["turn"] for t in r["turns"]]
        ax1.plot(x, [t["ttft"].mean() * 1e3 for t in r["turns"]], "o-", color=colors[mode],
                 label=f"host tier {mode}: mean")
        ax1.plot(x, [np.percentile(t["ttft"], 90) * 1e3 for t in r["turns"]], "^--",
                 color=colors[mode], alpha=0.6, label=f"host tier {mode}: p90")
    ax1.set_xticks([t["turn"] for t in res["off"]["turns"]])
    ax1.set_xlabel("turn (history grows each turn)")
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("time to first token per turn")
    ax1.legend(fontsize=8)
    x = np.array([t["turn"] for t in res["off"]["turns"]])
    for i, mode in enumerate(res):
        turns = res[mode]["turns"]
        computed = [t["computed_prompt_tokens"] for t in turns]
        bars = ax2.bar(x + (i - 0.5) * 0.38, computed, 0.38, color=colors[mode],
                       label=f"host tier {mode}: recomputed")
        ax2.bar_label(bars, label_type="center", fontsize=7)
        if mode == "on":
            ax2.bar(x + (i - 0.5) * 0.38, [t["host_hit_tokens"] for t in turns], 0.38,
                    bottom=computed, color="none", edgecolor=colors[mode], hatch="//",
                    label="host tier on: copied back from host")
    ax2.set_xticks(x)
    ax2.set_xlabel("turn")
    ax2.set_ylabel("prompt tokens")
    ax2.set_title("prefill work per turn")
    ax2.legend(fontsize=8)


def _ms(x) -> str:  # seconds -> "12.3" ms
    return f"{x * 1e3:.1f}"


def run(args) -> dict:
    if not 0 < args.user_min <= args.user_max:
        raise common.UsageError("need 0 < --user-min <= --user-max")
    model, desc = common.load_model(args.model)
    cfg, ps = model.config, args.page_size
    rng = np.random.default_rng(args.seed)
    users = [[rng.integers(0, cfg.vocab_size, rng.integers(args.user_min, args.user_max + 1))
              .tolist() for _ in range(args.turns)] for _ in range(args.conversations)]
    final = sorted((sum(map(len, u)) + args.turns * args.new_tokens for u in users), reverse=True)
    pages_of = [cdiv(n, ps) for n in final]
    # The pool: the --pool-convs longest final histories, plus a page per slot for partial-page
    # copies; the host tier: every history, plus a page per turn for split pages.
    num_pages = sum(pages_of[:args.pool_convs]) + args.max_num_seqs
    page_bytes = kv_bytes_per_token(model, args.kv_cache_dtype) * ps
    host_bytes = int(args.host_gib * 2**30) if args.host_gib is not None else \
        (sum(pages_of) + args.conversations * args.turns) * page_bytes
    max_len = cdiv(final[0], ps) * ps
    if max_len > cfg.max_position_embeddings:
        raise common.UsageError(f"the longest conversation has {final[0]} tokens; the model's "
                                f"context is {cfg.max_position_embeddings}")

    kw = common.engine_kwargs(args, num_pages=num_pages, max_model_len=max_len)

    def engine(host: int) -> jaxkv.Engine:
        e = jaxkv.Engine(model, **kw, host_kv_cache_bytes=host)
        e.warmup()
        return e

    # Untimed: the first turns of a few other conversations on a throwaway engine (the compiled
    # programs are shared), so first-run costs do not land on whichever configuration is first.
    spare = [[u[::-1] for u in users[c][:2]] for c in range(min(len(users), args.max_num_seqs))]
    serve(engine(host_bytes), spare, argparse.Namespace(**dict(vars(args), turns=len(spare[0]))))
    res = {}
    for mode, host in (("off", 0), ("on", host_bytes)):
        engine_ = engine(host)
        with count_compiles() as compiles:
            res[mode] = serve(engine_, users, args)
        res[mode]["compiles"] = compiles.count

    print(f"model: {desc}, {np.dtype(model.dtype).name} compute, KV {args.kv_cache_dtype}; "
          f"{common.device_line()}")
    print(f"workload: {args.conversations} conversations x {args.turns} turns, user messages "
          f"{args.user_min}-{args.user_max} tokens, {args.new_tokens} new tokens (greedy); final "
          f"history {final[-1]}-{final[0]} tokens; turns interleaved, requests in flight: "
          f"{args.max_num_seqs}")
    print(f"device pool: {num_pages} pages x {ps} tokens = {num_pages * ps} tokens "
          f"({num_pages * page_bytes / 2**20:.2f} MiB: the {args.pool_convs} longest final "
          f"histories, of {sum(final)} tokens in all); host tier: {host_bytes / 2**20:.2f} MiB "
          f"({host_bytes // page_bytes} pages)")
    if args.conversations <= args.pool_convs:
        print("note: the device pool keeps every conversation; the host tier has little to do")

    print(f"\n{'host tier':<9} {'recomputed':>10} {'from device':>11} {'from host':>9} "
          f"{'hit rate':>8} {'preempt':>7} {'wall s':>7} {'out tok/s':>9} {'host MiB':>8} "
          f"{'host max':>8} {'compiles':>8}")
    for mode, r in res.items():
        s = r["stats"]
        print(f"{mode:<9} {s.computed_prompt_tokens:>10} {s.device_hit_tokens:>11} "
              f"{s.host_hit_tokens:>9} {s.prefix_hit_rate:>8.1%} {s.preemptions:>7} "
              f"{r['wall']:>7.2f} {s.generated_tokens / r['wall']:>9.1f} "
              f"{s.host_kv_bytes / 2**20:>8.2f} {r['host_bytes_max'] / 2**20:>8.2f} "
              f"{r['compiles']:>8}")

    print("\nTTFT per turn (ms; mean p50 p90 over the conversations), prompt tokens recomputed")
    print(f"{'turn':>4} {'prompt':>6} | {'off mean':>8} {'p50':>6} {'p90':>6} {'recomp':>6} | "
          f"{'on mean':>8} {'p50':>6} {'p90':>6} {'recomp':>6} {'host':>6} | {'off/on':>6}")
    for off, on in zip(res["off"]["turns"], res["on"]["turns"], strict=True):
        cols = []
        for t in (off, on):
            cols.append(f"{_ms(t['ttft'].mean()):>8} {_ms(np.median(t['ttft'])):>6} "
                        f"{_ms(np.percentile(t['ttft'], 90)):>6} "
                        f"{t['computed_prompt_tokens']:>6}")
        print(f"{off['turn']:>4} {off['prompt_len']:>6.0f} | {cols[0]} | {cols[1]} "
              f"{on['host_hit_tokens']:>6} | {off['ttft'].mean() / on['ttft'].mean():>5.2f}x")

    a, b = res["off"]["outputs"], res["on"]["outputs"]
    same = sum(a[k] == b.get(k) for k in a)
    print(f"\ngreedy outputs identical (host tier off vs on): {same == len(a) == len(b)} "
          f"({same}/{len(a)} requests)")
    c_off, c_on = (res[m]["stats"].computed_prompt_tokens for m in ("off", "on"))
    later = [sum(t["ttft"].sum() for t in res[m]["turns"][1:]) for m in ("off", "on")]
    print(f"prompt tokens recomputed, on / off: {c_on} / {c_off} = "
          f"{c_on / max(c_off, 1):.1%}; mean TTFT of turns 2+, off / on: "
          f"{later[0] / max(later[1], 1e-9):.2f}x; wall off / on: "
          f"{res['off']['wall'] / res['on']['wall']:.2f}x")

    if args.out:
        common.save_plot(args.out, lambda fig, axes: _draw(axes, res), ncols=2, figsize=(11, 4))
    return dict(engine=kw, host_bytes=host_bytes, outputs_identical=same == len(a) == len(b),
                identical=same, requests=len(a),
                **{mode: dict(wall_s=r["wall"], stats=r["stats"], compiles=r["compiles"],
                              host_bytes_max=r["host_bytes_max"],
                              turns=r["turns"])
                   for mode, r in res.items()})
