"""Cache vs recompute: decode N new tokens with the paged KV cache and without any cache.

Builds a ~110M-parameter Llama-shaped model locally (fp32, random weights: speed does not
depend on the values), generates greedily from one prompt, and reports for each N the
tokens/s of both paths and their ratio. One run of each path to the largest N serves every
N: the time to the N-th token is read off the same run. Also reports single-stream decode
speed against the weight-read bound (model bytes / measured memory bandwidth).

    jaxkv bench cache [--tokens 64 128 256 512] [--prompt-len 64]
"""

from __future__ import annotations

import sys

import numpy as np

import jaxkv
from jaxkv.bench import common


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)


def time_to_tokens(stats, counts):
    """Seconds from the call's start until each requested token count was reached (a decode
    loop returns several tokens per read: the read that brought the n-th)."""
    return {n: next(t for t, c in zip(stats.token_times, stats.token_counts, strict=True)
                    if c >= n) for n in counts}


def run(args) -> dict:
    config = jaxkv.ModelConfig.bench(num_layers=args.layers)
    model = jaxkv.random_model(config, seed=0)
    n_max = max(args.tokens)
    prompt = [np.random.default_rng(0).integers(0, config.vocab_size, args.prompt_len).tolist()]
    sampling = jaxkv.SamplingParams(temperature=0, max_tokens=n_max, ignore_eos=True)

    # Warm-up compiles every program both paths will use, so timings exclude compilation.
    jaxkv.generate_with_stats(model, prompt, sampling)
    # The baseline pads only to a multiple of 16 tokens: its time is recomputation, not padding.
    jaxkv.generate_with_stats(model, prompt, sampling, recompute=True, exact_shapes=True)
    cached, cstats = jaxkv.generate_with_stats(model, prompt, sampling)
    recomputed, rstats = jaxkv.generate_with_stats(model, prompt, sampling, recompute=True,
                                                   exact_shapes=True)
    if cached != recomputed:
        print("error: cache and no-cache produced different tokens", file=sys.stderr)
        return {"ok": False, "error": "cache and no-cache produced different tokens"}
    t_cache = time_to_tokens(cstats, args.tokens)
    t_none = time_to_tokens(rstats, args.tokens)

    print(f"model: {config.num_params() / 1e6:.0f}M params, {config.num_layers} layers, "
          f"hidden {config.hidden_size}, fp32; prompt {args.prompt_len} tokens; batch 1; "
          f"{common.device_line()}")
    print(f"\n{'N new':>6} {'cache tok/s':>12} {'no-cache tok/s':>15} {'speedup':>8}")
    rows = []
    for n in sorted(args.tokens):
        a, b = n / t_cache[n], n / t_none[n]
        rows.append(dict(new_tokens=n, cache_tok_s=a, no_cache_tok_s=b, speedup=a / b))
        print(f"{n:>6} {a:>12.1f} {b:>15.2f} {a / b:>7.1f}x")

    # Steady-state decode against the bandwidth bound: every step reads all weights once.
    times, counts = cstats.token_times, cstats.token_counts
    per_token = (times[-1] - times[0]) / (counts[-1] - counts[0])
    bw = common.memory_bandwidth()
    weight_bytes = config.num_params() * 4
    bound = bw / weight_bytes
    print(f"\nsingle-stream decode: {1 / per_token:.1f} tokens/s ({per_token * 1e3:.1f} ms/token)")
    print(f"weight-read bound: {weight_bytes / 1e6:.0f} MB / {bw / 1e9:.1f} GB/s measured = "
          f"{bound:.1f} tokens/s -> {100 / per_token / bound:.0f}% of bound")
    return dict(rows=rows, decode_s_per_token=per_token, bandwidth_bytes_s=bw,
                weight_bytes=weight_bytes, bound_tok_s=bound)
