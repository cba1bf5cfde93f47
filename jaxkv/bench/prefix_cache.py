"""Prefix caching on vs off: time to first token (TTFT) and prompt tokens computed, with `Engine`.

Builds the ~110M-parameter benchmark model (`ModelConfig.bench()`) locally (fp32, random
weights: speed does not depend on the values; `--layers` / `--hidden` shrink it) and serves two
workloads of token ids through `jaxkv.Engine`, once with ``enable_prefix_caching=True`` and once
with False, on fresh engines:

(a) shared system prompt: `--requests` requests sharing one `--prefix`-token prefix, each with a
    distinct `--suffix`-token tail (distinct from its first token on). The first request runs
    alone (cold: it computes the prefix), then the other requests arrive together. Reusable at
    most: the prefix, once per later request = (requests - 1) * prefix tokens (matching is
    token-exact, so no page rounding is lost; the tails differ at their first token).
(b) multi-turn chat: `--convs` conversations x `--turns` turns, each turn's prompt = previous
    prompt + previous reply + a new `--user`-token message; every turn's requests (one per
    conversation) arrive together. A finished request leaves its prompt + reply in the cache
    minus the last sampled token, whose KV is never computed, so turn k > 1 can reuse at most
    len(prompt_{k-1}) + len(reply_{k-1}) - 1 tokens per conversation, and turn 1 nothing.

TTFT is the engine's own metric (first token time - add_request time), queueing included.
Every workload runs once untimed first on a same-shaped engine, so compilation is excluded.

    jaxkv bench prefix-cache [--layers 12] [--hidden 768] [--prefix 512] [--suffix 16]
        [--requests 16] [--convs 4] [--turns 6] [--user 32] [--reply 32]
        [--out bench_prefix_cache.png]
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

import jaxkv
from jaxkv.bench import common
from jaxkv.config import cdiv


def add_arguments(parser) -> None:
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768,
                        help="hidden size (heads = hidden / 64, MLP = hidden * 8/3)")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated in (a)")
    parser.add_argument("--convs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user", type=int, default=32, help="tokens of each user message")
    parser.add_argument("--reply", type=int, default=32, help="tokens of each reply in (b)")
    parser.add_argument("--out", default="bench_prefix_cache.png")
    # num_pages, max_num_seqs and max_model_len, by default: room for every workload's KV
    # with nothing evicted; prefix caching is what the bench turns on and off
    common.add_engine_args(parser, page_size=16, max_num_batched_tokens=512, num_pages=None,
                           max_num_seqs=None, max_model_len=None)


@dataclasses.dataclass
class Served:
    """One request's result."""

    prompt: list[int]
    reply: list[int]
    ttft: float
    cached: int  # prompt tokens served by the prefix cache


def serve(engine: jaxkv.Engine, prompts: dict[str, list[int]],
          sampling: jaxkv.SamplingParams) -> dict[str, Served]:
    """Submits every prompt at once and steps the engine until all finished."""
    for rid, ids in prompts.items():
        engine.add_request(rid, prompt_token_ids=ids, sampling_params=sampling)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = Served(out.prompt_token_ids, out.outputs[0].token_ids,
                                              out.metrics.ttft, out.num_cached_tokens)
    return done


def shared_prefix(engine, args, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, args.prefix).tolist()
    firsts = rng.choice(vocab, args.requests, replace=False)  # tails differ at token 0
    prompts = {f"r{i}": prefix + [int(firsts[i])] + rng.integers(0, vocab, args.suffix - 1)
               .tolist() for i in range(args.requests)}
    sampling = jaxkv.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ids = list(prompts)
    cold = serve(engine, {ids[0]: prompts[ids[0]]}, sampling)
    s0 = engine.stats()
    warm = serve(engine, {r: prompts[r] for r in ids[1:]}, sampling)
    s1 = engine.stats()
    return dict(cold=cold[ids[0]], warm=[warm[r] for r in ids[1:]],
                computed=s1.computed_prompt_tokens, cached=s1.cached_prompt_tokens,
                computed_warm=s1.computed_prompt_tokens - s0.computed_prompt_tokens,
                cached_warm=s1.cached_prompt_tokens - s0.cached_prompt_tokens,
                prompt_tokens=s1.prompt_tokens, preemptions=s1.preemptions,
                max_cached=(args.requests - 1) * args.prefix)


def multi_turn(engine, args, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    sampling = jaxkv.SamplingParams(temperature=0, max_tokens=args.reply, ignore_eos=True)
    history = {f"c{c}": [] for c in range(args.convs)}  # previous prompt + reply
    turns = []
    for k in range(1, args.turns + 1):
        prompts = {f"{c}t{k}": h + rng.integers(0, vocab, args.user).tolist()
                   for c, h in history.items()}
        before = engine.stats()
        done = serve(engine, prompts, sampling)
        after = engine.stats()
        res = [done[f"{c}t{k}"] for c in history]
        max_cached = sum(len(h) - 1 for h in history.values() if h)
        history = {c: r.prompt + r.reply for c, r in zip(history, res, strict=True)}
        turns.append(dict(
            turn=k, prompt_len=statistics.mean(len(r.prompt) for r in res),
            ttft=statistics.mean(r.ttft for r in res),
            computed=after.computed_prompt_tokens - before.computed_prompt_tokens,
            cached=after.cached_prompt_tokens - before.cached_prompt_tokens,
            prompt_tokens=after.prompt_tokens - before.prompt_tokens,
            preemptions=after.preemptions - before.preemptions, max_cached=max_cached))
    return turns


def _pct(a, b) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def report(a: dict, b: dict, args) -> dict:
    """Prints the tables of (a) and (b), caching on against off; returns their numbers."""
    print(f"\n(a) shared prefix: {args.requests} requests = {args.prefix}-token prefix + "
          f"{args.suffix}-token distinct suffix, max_tokens {args.max_tokens}; request 1 "
          f"alone (cold), then {args.requests - 1} at once")
    print(f"{'mode':<11} {'cold TTFT':>10} {'mean TTFT':>10} {'median TTFT':>12} "
          f"{'computed':>9} {'cached':>7} {'max cached':>11} {'hit rate':>9} {'max rate':>9}")
    for mode in ("on", "off"):
        r = a[mode]
        t = [x.ttft for x in r["warm"]]
        total = r["computed"] + r["cached"]
        print(f"caching {mode:<3} {r['cold'].ttft * 1e3:>8.0f}ms {statistics.mean(t) * 1e3:>8.0f}"
              f"ms {statistics.median(t) * 1e3:>10.0f}ms {r['computed']:>9} {r['cached']:>7} "
              f"{r['max_cached']:>11} {_pct(r['cached'], total):>9} "
              f"{_pct(r['max_cached'], r['prompt_tokens']):>9}")
    mean = {m: statistics.mean(x.ttft for x in a[m]["warm"]) for m in ("on", "off")}
    median = {m: statistics.median(x.ttft for x in a[m]["warm"]) for m in ("on", "off")}
    print(f"TTFT ratio (off / on, mean over the {args.requests - 1} concurrent requests): "
          f"{mean['off'] / mean['on']:.1f}x; median {median['off'] / median['on']:.1f}x")
    print(f"cached tokens = theoretical max with caching on: "
          f"{a['on']['cached'] == a['on']['max_cached']} ({a['on']['cached']} / "
          f"{a['on']['max_cached']})")

    print(f"\n(b) multi-turn chat: {args.convs} conversations x {args.turns} turns, user message "
          f"{args.user} tokens, reply {args.reply} tokens; each turn's {args.convs} requests "
          f"at once")
    print(f"{'turn':>4} {'prompt':>6} {'TTFT on':>9} {'TTFT off':>9} {'off/on':>7} "
          f"{'computed on':>12} {'computed off':>13} {'cached on':>10} {'max cached':>11} "
          f"{'hit rate on':>12} {'hit rate off':>13}")
    for on, off in zip(b["on"], b["off"], strict=True):
        print(f"{on['turn']:>4} {on['prompt_len']:>6.0f} {on['ttft'] * 1e3:>7.0f}ms "
              f"{off['ttft'] * 1e3:>7.0f}ms {off['ttft'] / on['ttft']:>6.1f}x "
              f"{on['computed']:>12} {off['computed']:>13} {on['cached']:>10} "
              f"{on['max_cached']:>11} {_pct(on['cached'], on['prompt_tokens']):>12} "
              f"{_pct(off['cached'], off['prompt_tokens']):>13}")
    tot = {m: (sum(t["cached"] for t in b[m]), sum(t["prompt_tokens"] for t in b[m]))
           for m in ("on", "off")}
    max_b = sum(t["max_cached"] for t in b["on"])
    print(f"all turns: hit rate on {_pct(*tot['on'])} (max {_pct(max_b, tot['on'][1])}), "
          f"off {_pct(*tot['off'])}; cached tokens = theoretical max with caching on: "
          f"{tot['on'][0] == max_b} ({tot['on'][0]} / {max_b})")
    ttft_on = [t["ttft"] for t in b["on"]]
    print(f"TTFT with caching on, last turn / first turn: {ttft_on[-1] / ttft_on[0]:.2f}x "
          f"(prompt {b['on'][-1]['prompt_len']:.0f} vs {b['on'][0]['prompt_len']:.0f} tokens)")
    pre = sum(a[m]["preemptions"] + sum(t["preemptions"] for t in b[m]) for m in ("on", "off"))
    if pre:
        print(f"note: {pre} preemptions happened (the cache was too small)")
    counts = {m: {k: v for k, v in a[m].items() if k not in ("cold", "warm")} for m in a}
    return dict(shared_prefix={m: dict(counts[m], cold_ttft=a[m]["cold"].ttft,
                                       warm_ttft=[x.ttft for x in a[m]["warm"]]) for m in a},
                multi_turn=b, preemptions=pre)


def _draw(axes, a: dict, b: dict) -> None:
    ax1, ax2 = axes
    means = [statistics.mean(r.ttft for r in a[m]["warm"]) * 1e3 for m in ("on", "off")]
    bars = ax1.bar(["caching on", "caching off"], means, color=["tab:green", "tab:red"])
    ax1.bar_label(bars, fmt="%.0f ms")
    ax1.set_ylabel("mean TTFT (ms)")
    ax1.set_title(f"(a) shared prefix: {len(a['on']['warm'])} concurrent requests")
    for mode, color in (("on", "tab:green"), ("off", "tab:red")):
        turns = b[mode]
        ax2.plot([t["turn"] for t in turns], [t["ttft"] * 1e3 for t in turns], "o-",
                 color=color, label=f"caching {mode}")
    ax2.set_xticks([t["turn"] for t in b["on"]])
    ax2.set_xlabel("turn (history grows each turn)")
    ax2.set_ylabel("mean TTFT (ms)")
    ax2.set_title("(b) multi-turn chat")
    ax2.set_ylim(bottom=0)
    ax2.legend()


def run(args) -> dict:
    config = jaxkv.ModelConfig.bench(num_layers=args.layers, hidden_size=args.hidden)
    model = jaxkv.random_model(config, seed=0)
    vocab, ps = config.vocab_size, args.page_size
    longest = args.user * args.turns + args.reply * args.turns
    # Room for every workload's KV with nothing evicted (each sequence may copy one page).
    num_pages = max(args.requests * (cdiv(args.prefix + args.suffix + args.max_tokens, ps) + 1),
                    2 * args.convs * (cdiv(longest, ps) + 1) * args.turns) + 8
    max_len = max(args.prefix + args.suffix + args.max_tokens, longest)
    kw = common.engine_kwargs(args, num_pages=num_pages,
                              max_num_seqs=max(args.requests, args.convs),
                              max_model_len=cdiv(max_len, ps) * ps)

    def engine(caching: bool) -> jaxkv.Engine:
        return jaxkv.Engine(model, **kw, enable_prefix_caching=caching)

    a, b = {}, {}
    for mode, caching in (("on", True), ("off", False)):
        # Untimed pass: same shapes on a same-shaped engine (the jitted steps are shared).
        shared_prefix(engine(caching), args, vocab, seed=1)
        multi_turn(engine(caching), args, vocab, seed=1)
        a[mode] = shared_prefix(engine(caching), args, vocab, seed=0)
        b[mode] = multi_turn(engine(caching), args, vocab, seed=0)

    print(f"model: {config.num_params() / 1e6:.0f}M params, {config.num_layers} layers, "
          f"hidden {config.hidden_size}, fp32; page_size {ps}, max_num_batched_tokens "
          f"{kw['max_num_batched_tokens']}; {common.device_line()}")
    results = report(a, b, args)
    common.save_plot(args.out, lambda fig, axes: _draw(axes, a, b),
                     ncols=2, figsize=(11, 4))
    return dict(results, engine=kw)
