"""Prefill/decode disaggregation on virtual CPU devices: what is real here.

On this machine both "meshes" are virtual CPU devices sharing the same cores and RAM, so the
wall time of disaggregated vs colocated serving says nothing about a real pair of GPU or TPU
slices (see `jaxkv bench sim-disagg` for that). What is real and reported:

1. a trace of `--requests` requests (a shared system prefix of `--shared` tokens plus
   `--unique` tokens each, `--max-tokens` greedy tokens, one arriving per step) served
   colocated (one engine on device 0) and disaggregated (prefill on `--prefill-tp` devices,
   decode on the next `--decode-tp`): the tokens (must be identical), and the KV pages and
   bytes that moved and the pages the decode side's prefix cache already held;
2. the page mover alone (`jaxkv.disagg.kv_transfer.PageMover`): for N pages, the time to
   gather them on the prefill devices and put them on the decode devices (send, until the
   payload is ready), and to scatter them into the decode pool (receive), median of
   `--repeats`, with the bytes and the rate.

Asks for 8 virtual CPU devices before jax starts its backend: run it in a process of its own.

    jaxkv bench disagg [--model smollm2] [--requests 8] [--prefill-tp 1] [--decode-tp 1]
        [--kv-cache-dtype int8]
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from jaxkv import Engine, SamplingParams
from jaxkv.bench import common
from jaxkv.bench.scaleout import virtual_devices
from jaxkv.config import cdiv
from jaxkv.disagg import DisaggregatedEngine
from jaxkv.sharding import make_mesh


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | a checkpoint path")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--shared", type=int, default=96, help="system-prefix tokens")
    p.add_argument("--unique", type=int, default=40, help="tokens of each request's own")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--pages", default="1,4,16,64", help="page counts for the mover timing")
    p.add_argument("--repeats", type=int, default=5)
    # every engine's (colocated, prefill, decode); prompts longer than the step's token
    # budget prefill in chunks
    common.add_engine_args(p, page_size=16, num_pages=256, max_num_seqs=8, max_model_len=512,
                           max_num_batched_tokens=64, kv_cache_dtype="auto")


def serve(engine, prompts, sp) -> dict:
    """Runs the prompts, one arriving per step; returns each one's tokens, by request id."""
    tokens, queue = {}, list(enumerate(prompts))
    while queue or engine.has_unfinished_requests():
        if queue:
            i, p = queue.pop(0)
            engine.add_request(str(i), prompt_token_ids=p, sampling_params=sp)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def time_mover(engine: DisaggregatedEngine, n: int, repeats: int) -> tuple[float, float]:
    """Median seconds of sending n pages (until the payload is on the decode devices) and of
    scattering them into the decode pool."""
    mover = engine.mover
    src = list(range(n))
    dst = list(range(engine.decode.num_pages - n, engine.decode.num_pages))
    send, receive = [], []
    for _ in range(repeats + 1):  # the first compiles
        t0 = time.perf_counter()
        payload = mover.send(engine.prefill.state, src)
        payload.wait()
        t1 = time.perf_counter()
        engine.decode.write_kv(lambda state, p=payload: mover.receive(state, p, dst))
        jax.block_until_ready(engine.decode.state)
        t2 = time.perf_counter()
        send.append(t1 - t0)
        receive.append(t2 - t1)
    return float(np.median(send[1:])), float(np.median(receive[1:]))


def run(args) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    virtual_devices(8)
    if args.prefill_tp + args.decode_tp > jax.device_count():
        raise common.UsageError(f"--prefill-tp + --decode-tp exceeds the {jax.device_count()} "
                                "devices")
    model, what = common.load_model(args.model)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    shared = rng.integers(10, vocab, args.shared).tolist()
    prompts = [shared + rng.integers(10, vocab, args.unique).tolist()
               for _ in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    shape = common.engine_kwargs(args)
    devices = jax.devices()
    colocated = serve(Engine(model, **shape), prompts, sp)
    prefill = Engine(model, mesh=make_mesh(args.prefill_tp, devices[:args.prefill_tp]), **shape)
    decode = Engine(model, mesh=make_mesh(args.decode_tp, devices[args.prefill_tp:]), **shape)
    engine = DisaggregatedEngine(prefill, decode)
    tokens = serve(engine, prompts, sp)
    same = sum(tokens[k] == colocated[k] for k in colocated)

    print(f"# Prefill/decode disaggregation on virtual CPU devices: {what}, "
          f"kv_cache_dtype={args.kv_cache_dtype}, prefill tp={args.prefill_tp}, "
          f"decode tp={args.decode_tp}")
    print()
    t = engine.transfers
    prompt_pages = sum(cdiv(len(q), args.page_size) for q in prompts)
    print("| requests | greedy tokens equal to colocated | prompt pages | pages moved "
          "| pages reused on the decode side | bytes moved | bytes per request "
          "| pages streamed while prefilling |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {t.requests} | {same}/{len(colocated)} | {prompt_pages} | {t.pages} "
          f"| {t.reused_pages} | {t.bytes:,} | {t.bytes // max(1, t.requests):,} "
          f"| {t.streamed_pages} |")
    print()
    print("| pages | bytes | send (gather + put), ms | receive (scatter), ms | MB/s end to end |")
    print("|---|---|---|---|---|")
    mover = []
    for n in (int(x) for x in args.pages.split(",")):
        send, receive = time_mover(engine, n, args.repeats)
        nbytes = n * engine.mover.page_bytes
        mover.append(dict(pages=n, bytes=nbytes, send_s=send, receive_s=receive))
        print(f"| {n} | {nbytes:,} | {send * 1e3:.2f} | {receive * 1e3:.2f} "
              f"| {nbytes / (send + receive) / 1e6:.0f} |")
    return dict(ok=same == len(colocated), identical=same, requests=len(colocated),
                prompt_pages=prompt_pages, transfers=t, mover=mover)
