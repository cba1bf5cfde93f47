"""Scale-out capacity under tensor parallelism, and a paper estimate for Llama-3-70B.

Bytes per device, sequences that fit, and step time under tensor parallelism; plus a paper
estimate for Llama-3-70B on a TPU v5e-16 slice and on 8 x H200.

Part 1 measures on virtual CPU devices (`--devices`, set before jax starts its backend: run it
in a process of its own): a small Llama (`--layers`, `--hidden`, `--heads`, `--kv-heads`)
served by `Engine(mesh=make_mesh(tp))` for each tp; per-device weight and KV bytes are read
from the arrays' shards, the sequences that fit come from those bytes and `--hbm-gib` per
device, and the step time is one decode step of `--rows` sequences (virtual devices share this
machine's cores: the time shows overhead, not speedup). Part 2 is arithmetic
(`jaxkv.cache.memory.plan_sharded`) on published specs.

    jaxkv bench scaleout [--devices 8] [--layers 4] [--hidden 256] [--heads 8] [--kv-heads 4]
        [--hbm-gib 16]
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

import jaxkv
from jaxkv.bench import common
from jaxkv.cache.memory import PRESETS, plan_sharded
from jaxkv.sharding import bytes_per_device, kv_replication, make_mesh


def add_arguments(parser) -> None:
    parser.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="sequences decoding (max_num_seqs)")
    parser.add_argument("--avg-len", type=int, default=1024)
    parser.add_argument("--hbm-gib", type=float, default=16.0)
    common.add_engine_args(parser, page_size=16, num_pages=256, max_model_len=1024,
                           max_num_batched_tokens=512)


def virtual_devices(n: int) -> None:
    """Asks for ``n`` virtual CPU devices: effective only before jax starts its backend."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={n}").strip()


def measure(args) -> list[dict]:
    config = jaxkv.ModelConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=1024)
    model = jaxkv.random_model(config, seed=0)
    rng = np.random.default_rng(0)
    rows = []
    tp = 1
    while tp <= min(jax.device_count(), args.heads):
        engine = jaxkv.Engine(model, mesh=make_mesh(tp), max_num_seqs=args.rows,
                              **common.engine_kwargs(args))
        weights = max(bytes_per_device(engine.model.params))
        kv_pages = max(bytes_per_device(engine.state.kv_pages))
        per_token = kv_pages // (engine.num_pages * engine.page_size)
        budget = int(args.hbm_gib * 2**30 * 0.9) - weights
        sp = jaxkv.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i in range(args.rows):
            engine.add_request(str(i), prompt_token_ids=rng.integers(4, 4096, 64).tolist(),
                               sampling_params=sp)
        times = []
        while engine.has_unfinished_requests():
            decoding = all(r.num_pending_tokens == 1 for r in engine.scheduler.running)
            t = time.perf_counter()
            engine.step()
            if decoding and len(engine.scheduler.running) == args.rows:
                times.append(time.perf_counter() - t)
        rows.append(dict(tp=tp, rep=kv_replication(config, tp), weights=weights,
                         per_token=per_token, tokens=budget // per_token,
                         seqs=budget // (per_token * args.avg_len),
                         step_ms=1e3 * float(np.median(times[3:]))))
        tp *= 2
    return rows


def run(args) -> dict:
    virtual_devices(args.devices)

    def mib(n):
        return f"{n / 2**20:,.2f} MiB"

    print(f"(1) measured on {jax.device_count()} virtual {jax.default_backend()} devices: "
          f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, {args.kv_heads} kv "
          f"heads, fp32; {args.hbm_gib:g} GiB per device assumed")
    print(f"{'tp':>3} {'kv copies':>9} {'weights/dev':>12} {'KV B/token/dev':>15} "
          f"{'KV tokens':>10} {f'seqs@{args.avg_len}':>10} {'decode step':>12}")
    measured = measure(args)
    for r in measured:
        print(f"{r['tp']:>3} {r['rep']:>9} {mib(r['weights']):>12} "
              f"{r['per_token']:>15,} {r['tokens']:>10,} {r['seqs']:>10,} "
              f"{r['step_ms']:>10.1f}ms")

    print("\n(2) paper estimate: llama-3-70b, bf16 weights and KV, 90% of HBM, sequences of "
          "2,048 tokens")
    print(f"{'system':<31} {'tp':>3} {'kv copies':>9} {'weights/dev':>12} {'KV B/token/dev':>15} "
          f"{'KV tokens':>11} {'seqs':>6} {'step floor':>11} {'(empty cache)':>14}")
    systems = [("TPU v5e-16 (16 GiB, 819 GB/s)", 16, 16 * 2**30, 819e9),
               ("8 x H200 (141 GB, 4.8 TB/s)", 8, 141 * 10**9, 4.8e12)]
    estimates = {}
    for name, tp, hbm, bw in systems:
        p = plan_sharded(PRESETS["llama-3-70b"], tp, hbm_bytes=hbm, bandwidth=bw)
        estimates[name] = p
        print(f"{name:<31} {tp:>3} {p.kv_replication:>9} {p.weight_bytes / 2**30:>8.2f} GiB "
              f"{p.kv_bytes_per_token:>15,} {p.kv_tokens:>11,} {p.seqs:>6,} "
              f"{p.step_floor_s * 1e3:>9.1f}ms {p.weights_floor_s * 1e3:>12.1f}ms")
    return dict(measured=measured, estimates=estimates)
