"""Soak: thousands of requests through one `Engine`, with nothing lost and nothing leaking.

Serves the embedded model (`jaxkv.load_default()`) from a small page pool, so the prefix cache
evicts and running requests are preempted all the time. The workload, all token ids, seeded:

- prompts = one of `--prefixes` shared "system prompts" (or none) + a random tail;
- random prompt and output lengths; some requests with n = 2 (temperature 0.8, seeded);
- some requests aborted a few steps after they arrive (waiting, mid-prefill or decoding);
- some bad requests (a token id outside the vocabulary), which must be rejected at once;
- arrivals keep about 2 x max_num_seqs requests unfinished (a closed loop).

`Engine.check()` (every page's refcount equals its holders; the radix tree's invariants) runs
after every step. Reported: completed / aborted / rejected, preemptions, page leaks (pages not
free after the run once the prefix cache is emptied: must be 0), host RSS after warm-up and at
the end, and throughput per window of requests (flat: no slowdown that persists). Then a
preemption-storm check: decode throughput of a fixed batch before and after a storm.

    jaxkv bench soak [--requests 3000] [--num-pages 64] [--max-num-seqs 16]
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time

import jax
import numpy as np

import jaxkv
from jaxkv.bench import common
from jaxkv.config import cdiv


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--max-tail", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--abort-rate", type=float, default=0.05)
    parser.add_argument("--n2-rate", type=float, default=0.1)
    parser.add_argument("--bad-rate", type=float, default=0.01)
    parser.add_argument("--window", type=int, default=250, help="requests per throughput row")
    parser.add_argument("--seed", type=int, default=0, help="the workload's and the engine's")
    parser.add_argument("--verify", type=int, default=30,
                        help="greedy requests re-run alone with jaxkv.generate to compare")
    parser.add_argument("--no-storm", action="store_true")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip Engine.warmup(): programs compile during the soak")
    common.add_engine_args(parser, num_pages=64, page_size=16, max_num_seqs=16,
                           max_model_len=256, max_num_batched_tokens=256)


def rss_mb() -> float:
    """Resident set size now (Linux /proc), else the peak (getrusage), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024)


class Workload:
    """Draws the requests of the soak (all randomness comes from `seed`)."""

    def __init__(self, args, vocab: int):
        self.args, self.vocab = args, vocab
        self.rng = np.random.default_rng(args.seed)
        self.prefixes = [self.tokens(int(n)) for n in self.rng.integers(16, 97, args.prefixes)]
        self.count = 0

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(4, self.vocab, n).tolist()

    def next(self) -> tuple[str, list[int], jaxkv.SamplingParams, int | None]:
        """(request id, prompt, sampling params, abort after this many steps or None)."""
        a, rng = self.args, self.rng
        self.count += 1
        rid = f"r{self.count}"
        head = self.prefixes[rng.integers(len(self.prefixes))] if rng.random() < 0.7 else []
        prompt = head + self.tokens(int(rng.integers(1, a.max_tail + 1)))
        if rng.random() < a.bad_rate:
            prompt[rng.integers(len(prompt))] = self.vocab + int(rng.integers(100))
        max_tokens = int(rng.integers(1, a.max_new + 1))
        if rng.random() < a.n2_rate:
            sp = jaxkv.SamplingParams(n=2, temperature=0.8, seed=self.count, max_tokens=max_tokens)
        else:
            sp = jaxkv.SamplingParams(temperature=0, max_tokens=max_tokens)
        abort = int(rng.integers(0, 12)) if rng.random() < a.abort_rate else None
        return rid, prompt, sp, abort


def soak(engine: jaxkv.Engine, args) -> dict:
    """Runs the workload; returns the counters, RSS samples and per-window throughput."""
    work = Workload(args, engine.model.config.vocab_size)
    submitted = completed = aborted = rejected = 0
    reasons: dict[str, int] = {}
    aborts: dict[int, list[str]] = {}  # step -> request ids to abort then
    windows, window_tokens, window_start = [], 0, time.perf_counter()
    warmup = max(1, args.requests // 10)
    rss_warm, t0, step = None, time.perf_counter(), 0
    watched: dict[str, tuple] = {}  # greedy requests whose tokens are re-checked alone
    while submitted < args.requests or engine.has_unfinished_requests():
        while submitted < args.requests and engine.num_unfinished() < 2 * engine.max_num_seqs:
            rid, prompt, sp, abort = work.next()
            submitted += 1
            try:
                engine.add_request(rid, prompt_token_ids=prompt, sampling_params=sp)
            except ValueError:
                rejected += 1
                continue
            if abort is not None:
                aborts.setdefault(step + abort, []).append(rid)
            elif sp.temperature == 0 and len(watched) < args.verify and work.count % 7 == 0:
                watched[rid] = (prompt, sp, None)
        for rid in aborts.pop(step, []):
            if engine.has_request(rid):
                engine.abort(rid)
        for out in engine.step():
            window_tokens += sum(1 for c in out.outputs if c.finish_reason != "abort")
            if not out.finished:
                continue
            for c in out.outputs:
                reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
            if out.outputs[0].finish_reason == "abort":
                aborted += 1
                continue
            completed += 1
            if out.request_id in watched:
                watched[out.request_id] = (*watched[out.request_id][:2], out.outputs[0].token_ids)
            if completed % args.window == 0:
                now = time.perf_counter()
                windows.append((completed, window_tokens / (now - window_start), rss_mb(),
                                programs(engine)))
                window_tokens, window_start = 0, now
            if completed == warmup:
                rss_warm = rss_mb()
        engine.check()
        step += 1
    seconds = time.perf_counter() - t0
    used = engine.stats().kv_pages_used
    engine.radix.clear()
    leaks = engine.num_pages - engine.allocator.num_free
    rss_end = rss_mb()  # before the re-runs below, which compile programs of their own
    mismatched = sum(jaxkv.generate(engine.model, [prompt], sp)[0] != tokens
                     for prompt, sp, tokens in watched.values())
    return dict(submitted=submitted, completed=completed, aborted=aborted, rejected=rejected,
                verified=len(watched), mismatched=mismatched,
                reasons=reasons, used_at_end=used, leaks=leaks, seconds=seconds, steps=step,
                stats=engine.stats(), rss_warm=rss_warm or rss_mb(), rss_end=rss_end,
                windows=windows, warmup=warmup)


def programs(engine: jaxkv.Engine) -> int:
    """Step programs compiled so far (one per distinct batch shape)."""
    return sum(getattr(f, "_cache_size", lambda: 0)() for f in engine.steps)


def decode_rate(engine: jaxkv.Engine, prompts: list[list[int]], new: int) -> float:
    """Tokens per second of the decode steps in which all of `prompts` decode together (a
    fresh cache namespace each call: no prefix hit changes what is measured)."""
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    salt = f"decode-rate-{time.perf_counter_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{salt}-{i}", prompt_token_ids=p, sampling_params=sp,
                           cache_salt=salt)
    tokens, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = len(running) == len(prompts) and all(r.num_pending_tokens == 1 for r in running)
        t = time.perf_counter()
        outs = engine.step()
        if full:
            seconds += time.perf_counter() - t
            tokens += len(outs)
    return tokens / seconds


def storm(engine: jaxkv.Engine, args, vocab: int, new: int = 100, repeats: int = 5) -> dict:
    """Decode throughput of a fixed batch (median of `repeats` runs) before and after a
    preemption storm of requests whose page demand is ~10x the pool (same engine)."""
    rng = np.random.default_rng(args.seed + 1)
    pages_each = cdiv(24 + new, engine.page_size)
    fits = max(1, engine.num_pages // (pages_each + 1))  # all decode at once, with room
    batch = [rng.integers(4, vocab, 24).tolist() for _ in range(min(fits, 8))]
    decode_rate(engine, batch, new)  # compile and warm
    before = [decode_rate(engine, batch, new) for _ in range(repeats)]
    p0 = engine.stats().preemptions
    n = max(8, engine.num_pages * 10 // pages_each)
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"storm{i}", prompt_token_ids=rng.integers(4, vocab, 24).tolist(),
                           sampling_params=sp)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
    after = [decode_rate(engine, batch, new) for _ in range(repeats)]
    return dict(storm_requests=n, demand_pages=n * pages_each, rows=len(batch),
                preemptions=engine.stats().preemptions - p0,
                before=float(np.median(before)), after=float(np.median(after)))


def run(args) -> dict:
    model, _ = common.load_model("tiny")
    engine = jaxkv.Engine(model, **common.engine_kwargs(args), seed=args.seed)
    print(f"jaxkv soak on {platform.machine()} {jax.default_backend()} "
          f"({os.cpu_count()} cpus), embedded model {model.config.num_params() / 1e6:.2f}M "
          f"params; {args.num_pages} pages x {args.page_size} tokens, max_num_seqs "
          f"{args.max_num_seqs}")
    t = time.perf_counter()
    shapes = engine.warmup() if not args.no_warmup else 0
    print(f"warmup: {shapes} step shapes compiled in {time.perf_counter() - t:.0f} s, "
          f"RSS {rss_mb():.0f} MiB")
    r = soak(engine, args)
    s = r["stats"]
    print(f"\nrequests: {r['submitted']} submitted = {r['completed']} completed + "
          f"{r['aborted']} aborted + {r['rejected']} rejected (bad input)")
    print(f"finish reasons (per sample): {dict(sorted(r['reasons'].items()))}")
    print(f"steps {r['steps']} in {r['seconds']:.0f} s; preemptions {s.preemptions}; "
          f"generated {s.generated_tokens} tokens; prefix hit rate {s.prefix_hit_rate:.1%}")
    print(f"greedy requests re-run alone: {r['verified']}, tokens differing: {r['mismatched']}")
    print(f"page leaks: {r['leaks']} (pages held by requests at the end: {r['used_at_end']}; "
          "Engine.check() clean after every step)")
    growth = r["rss_end"] / r["rss_warm"] - 1
    print(f"host RSS: {r['rss_warm']:.0f} MiB after warm-up ({r['warmup']} requests), "
          f"{r['rss_end']:.0f} MiB at the end ({growth:+.1%})")
    print(f"\n{'requests done':>13} {'tok/s':>8} {'RSS MiB':>8} {'programs':>9}")
    for done, rate, rss, progs in r["windows"]:
        print(f"{done:>13} {rate:>8.0f} {rss:>8.0f} {progs:>9}")
    rates = [rate for done, rate, _, _ in r["windows"] if done > r["warmup"]]
    if len(rates) >= 2:
        print(f"throughput after warm-up: min/max {min(rates) / max(rates):.2f}, "
              f"last/first {rates[-1] / rates[0]:.2f}")
    ok = (r["leaks"] == 0 and r["used_at_end"] == 0 and r["mismatched"] == 0
          and r["completed"] + r["aborted"] + r["rejected"] == r["submitted"]
          and "error" not in r["reasons"])
    st = None
    if not args.no_storm:
        st = storm(engine, args, model.config.vocab_size)
        print(f"\npreemption storm: {st['storm_requests']} requests needing "
              f"{st['demand_pages']} pages on {args.num_pages} ({st['preemptions']} preemptions)")
        print(f"decode throughput of a fixed batch of {st['rows']} (median of 5): before "
              f"{st['before']:.0f} tok/s, after "
              f"{st['after']:.0f} tok/s ({st['after'] / st['before'] - 1:+.1%})")
        engine.radix.clear()
        ok = ok and engine.allocator.num_free == engine.num_pages
    print(f"\nresult: {'OK' if ok else 'FAILED'}")
    out = {k: v for k, v in r.items() if k != "stats"}
    return dict(out, ok=ok, stats=s, storm=st)
