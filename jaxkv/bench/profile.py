"""Where a decode step's time goes: host work against device work, and the sampler's share.

1. Host profile: a batch of --batch requests decoding on the 125M-parameter fp32 Llama of
   `bench peers`; every `Engine.step` is split into host time (scheduling, batch building,
   reservation, dispatch, and applying the tokens) and the wait for the device's tokens.
   Reported per decode step (a decode loop runs several: --max-decode-steps).
2. Sampler: the same model with a 128,256-token vocabulary (Llama-3's), batch 32, one decode
   step of greedy rows against one of temperature-1 rows (inverse-CDF sampling), and top-p
   0.9 rows (candidate set), and `sample` alone on [32, 128256] logits.
3. Width: 8 sequences of <= 50 tokens decoding at max_model_len 64 and 8192.
4. Attention: the CPU decode reference over the model's 12 layers of paged KV (--batch rows
   of ~--prompt-len tokens), against gathering the same pages alone (from the head-major pool
   and from a page-major one), the C++ decode kernel reading them in place, and reading them
   once at the measured memory bandwidth.

    jaxkv bench profile [--parts host sampler width attention] [--batch 32]
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

import jaxkv
from jaxkv.bench import common
from jaxkv.config import cdiv
from jaxkv.runtime.sampling import SamplingArrays, sample
from pallas_kernels import paged_decode_attention_reference
from pallas_kernels.cpu_paged_attention import paged_decode_attention_cpu
from pallas_kernels.cpu_paged_attention import supports as cpu_supports


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--parts", nargs="+", default=["host", "sampler", "width"],
                        choices=["host", "sampler", "width", "attention"])
    # the host part's engine (the other parts fix theirs)
    common.add_engine_args(parser, num_pages=2048, max_model_len=1024, max_decode_steps=8)


def host_profile(args) -> dict:
    model = jaxkv.random_model(common.peer_config(args.layers), seed=0)
    kw = common.engine_kwargs(args)
    engine = jaxkv.Engine(model, **kw)
    engine.warmup()
    rng = np.random.default_rng(0)
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), prompt_token_ids=rng.integers(3, 32000, args.prompt_len)
                           .tolist(), sampling_params=sp)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or \
            engine.scheduler.waiting:  # prefill everything first
        engine.step()
    host = wait = 0.0
    steps_before = engine.stats().steps
    wall = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        step = engine.dispatch()
        t1 = time.perf_counter()
        if step.read is not None:
            kind, tokens = step.read()  # the wait for the device
            t2 = time.perf_counter()
            done = dataclasses.replace(step.read, fn=lambda kind=kind, tokens=tokens: (kind,
                                                                                    tokens))
            engine.collect(dataclasses.replace(step, read=done))
        else:
            t2 = t1
            engine.collect(step)
        t3 = time.perf_counter()
        host += (t1 - t0) + (t3 - t2)
        wait += t2 - t1
    wall = time.perf_counter() - wall
    steps = engine.stats().steps - steps_before
    print(f"host profile: batch {args.batch}, {args.layers} layers, prompts {args.prompt_len}, "
          f"{args.new_tokens} new tokens, max_decode_steps {kw.get('max_decode_steps')}, "
          f"async_scheduling {engine.async_scheduling}")
    print(f"  {steps} decode steps in {wall:.2f} s: {1e3 * wall / steps:.1f} ms per step")
    print(f"  host work      {1e3 * host / steps:7.2f} ms per step "
          f"({100 * host / wall:.1f}% of the wall time)")
    print(f"  device wait    {1e3 * wait / steps:7.2f} ms per step")
    return dict(steps=steps, wall_s=wall, host_s=host, wait_s=wait)


def sampler_profile(args) -> dict:
    vocab, b = 128256, 32
    model = jaxkv.random_model(common.peer_config(args.layers, vocab=vocab), seed=0)
    engine = jaxkv.Engine(model, num_pages=1024, max_model_len=512, max_num_seqs=b,
                          max_decode_steps=8)
    rng = np.random.default_rng(0)

    def per_step(sp):
        for i in range(b):
            engine.add_request(f"{sp.temperature}-{sp.top_p}-{i}", prompt_token_ids=rng.integers(
                3, vocab, 64).tolist(), sampling_params=sp)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()
        before, t = engine.stats().steps, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (time.perf_counter() - t) / (engine.stats().steps - before)

    n = 33
    modes = {"greedy": jaxkv.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
             "temperature 1": jaxkv.SamplingParams(temperature=1.0, max_tokens=n,
                                                   ignore_eos=True, seed=1),
             "top_p 0.9": jaxkv.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=n,
                                               ignore_eos=True, seed=1)}
    engine.warmup()
    per_step(modes["greedy"])  # warm
    times = {name: per_step(sp) for name, sp in modes.items()}
    logits = jax.numpy.asarray(rng.standard_normal((b, vocab)).astype(np.float32))
    keys = np.zeros((b, 2), np.uint32)
    alone = {}
    for name, (t, p) in {"greedy": (0.0, 1.0), "temperature 1": (1.0, 1.0),
                         "top_p 0.9": (1.0, 0.9)}.items():
        arrays = SamplingArrays.build([t] * b, [0] * b, [p] * b, [0] * b, b)
        sample(logits, keys, arrays).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(10):
            sample(logits, keys, arrays).block_until_ready()
        alone[name] = (time.perf_counter() - t0) / 10
    print(f"sampler: batch {b}, vocab {vocab}, {args.layers} layers")
    for name in modes:
        extra = times[name] - times["greedy"]
        print(f"  {name:<14} decode step {1e3 * times[name]:7.1f} ms (+{1e3 * extra:5.1f} ms vs "
              f"greedy: {100 * extra / times[name]:4.1f}%); sample() alone "
              f"{1e3 * alone[name]:5.1f} ms ({100 * alone[name] / times[name]:4.1f}%)")
    return dict(decode_step_s=times, sample_alone_s=alone)


def width_profile(args) -> dict:
    """Decode step time for short sequences against max_model_len (the page table's width)."""
    cfg = dataclasses.replace(common.peer_config(args.layers), max_position_embeddings=8192)
    model = jaxkv.random_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 32000, 30).tolist() for _ in range(8)]
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    print(f"width: 8 sequences of <= 50 tokens, {args.layers} layers")
    out = {}
    for max_len in (64, 8192):
        engine = jaxkv.Engine(model, num_pages=256, max_model_len=max_len, max_num_seqs=8)
        engine.warmup()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), prompt_token_ids=p, sampling_params=sp)
        engine.step()  # the prefill
        before, t = engine.stats().steps, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        out[max_len] = per = (time.perf_counter() - t) / (engine.stats().steps - before)
        print(f"  max_model_len {max_len:5d} (page table width {engine.max_pages_per_seq:4d}): "
              f"{1e3 * per:.1f} ms per decode step")
    return dict(decode_step_s=out)


def _best_of(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def attention_profile(args) -> dict:
    """Decode attention alone: the reference, the page gather inside it, and the bound."""
    cfg = common.peer_config(args.layers)
    layers, k, d, s = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16
    b, ctx = args.batch, args.prompt_len
    rng = np.random.default_rng(0)
    width = cdiv(ctx + 50, s)
    pages = rng.permutation(b * width + 16)[:b * width].reshape(b, width).astype(np.int32)
    pool = jax.numpy.asarray(rng.standard_normal((layers, k, b * width + 16, s, 2 * d),
                                                 dtype=np.float32))
    lengths = rng.integers(ctx - 50, ctx + 50, b).astype(np.int32)
    q = rng.standard_normal((layers, b, cfg.num_heads, d)).astype(np.float32)
    used = cdiv(lengths, s)
    kv_bytes = int(used.sum()) * layers * k * s * 2 * d * 4

    @jax.jit
    def reference(q, pool, table, lengths):
        return [paged_decode_attention_reference(q[i], pool, table, lengths, sm_scale=d ** -0.5,
                                                 layer=i) for i in range(layers)]

    @jax.jit
    def gather(pool, table):  # the pages each row holds, materialized as the reference does
        return [pool[i][:, table] for i in range(layers)]

    @jax.jit
    def gather_page_major(flat, table):  # the same pages from a [L, P, K*S*2D] pool
        return [flat[i].at[table].get(mode="promise_in_bounds") for i in range(layers)]

    @jax.jit
    def cpu_kernel(q, pool, table, lengths):  # the C++ decode kernel: pages read in place
        return [paged_decode_attention_cpu(q[i], pool, table, lengths, sm_scale=d ** -0.5,
                                           layer=i) for i in range(layers)]

    table = pages[:, :int(used.max())]
    t_ref = _best_of(reference, q, pool, pages, lengths)
    t_cpu = _best_of(cpu_kernel, q, pool, pages, lengths) if cpu_supports(pool) else None
    t_gather = _best_of(gather, pool, table)
    flat = pool.transpose(0, 2, 1, 3, 4).reshape(layers, pool.shape[2], -1)
    t_page_major = _best_of(gather_page_major, flat, table)
    bound = kv_bytes / common.memory_bandwidth()
    print(f"attention: decode, batch {b}, ~{ctx} tokens of context, {layers} layers, "
          f"{kv_bytes / 1e6:.0f} MB of KV")
    print(f"  reference attention {1e3 * t_ref:6.1f} ms; the page gather alone "
          f"{1e3 * t_gather:6.1f} ms; reading the KV once at the measured bandwidth "
          f"{1e3 * bound:5.1f} ms")
    print(f"  the same gather from a page-major pool [L, P, K*S*2D]: {1e3 * t_page_major:6.1f} ms")
    if t_cpu is not None:
        print(f"  the CPU decode kernel (head-major pool, pages read in place): "
              f"{1e3 * t_cpu:6.1f} ms")
    return dict(kv_bytes=kv_bytes, reference_s=t_ref, gather_s=t_gather,
                gather_page_major_s=t_page_major, cpu_kernel_s=t_cpu, bandwidth_bound_s=bound)


PARTS = {"host": host_profile, "sampler": sampler_profile, "width": width_profile,
         "attention": attention_profile}


def run(args) -> dict:
    return {part: PARTS[part](args) for part in args.parts}
