"""Streaming clients of which one in three hangs up mid-stream, against `jaxkv serve`.

    .venv/bin/python scripts/disconnect_clients.py --url http://127.0.0.1:8011 \
        --clients 24 --seconds 60

Each of --clients workers sends streaming /v1/completions requests back to back for
--seconds (a ~128-token prompt, max_tokens 64, ignore_eos). Worker i with i % 3 == 0 closes
its connection after --drop-after chunks of every request (the server should abort the request
and free its pages); the others read every answer to `data: [DONE]`. Afterwards it waits for the
server to go idle, prints the /metrics gauges (pages, running, waiting) and request counters,
and sends one normal request, which must succeed. Exit status 0 only if no request failed,
no pages stay held by requests and the last request succeeded.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx

WORDS = ("river stone garden window paper light music winter orange silver cloud forest "
         "table market engine letter bridge summer island candle mirror street planet "
         "pocket ticket valley harbor meadow").split()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def worker(i, args, model, deadline, stats):
    rng = random.Random(i)
    drops = i % 3 == 0
    timeout = httpx.Timeout(120.0, connect=10.0)
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout) as client:
        while time.monotonic() < deadline:
            body = {"model": model, "prompt": prompt(rng, args.prompt_words),
                    "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.monotonic()
            chunks, last, done, tokens = 0, t0, False, None
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        stats["failed"] += 1
                        stats["errors"].append(f"HTTP {r.status_code}: {r.text[:200]}")
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            stats["errors"].append(str(event["error"])[:200])
                            break
                        if event.get("usage") and not event.get("choices"):
                            tokens = event["usage"]["completion_tokens"]  # the last chunk
                            continue
                        now = time.monotonic()
                        if chunks == 0:
                            first = now - t0
                            stats["ttft"].append(first)
                        else:
                            stats["itl"].append(now - last)
                        last = now
                        chunks += 1
                        if drops and chunks >= args.drop_after:
                            break  # leaving the block closes the unread response's connection
            except httpx.HTTPError as e:
                stats["failed"] += 1
                stats["errors"].append(f"{type(e).__name__}: {e}")
                continue
            if done:
                stats["completed"] += 1
                if tokens and tokens > 1:
                    # time per output token after the first (one chunk can carry several)
                    stats["tpot"].append((last - t0 - first) / (tokens - 1))
            elif drops and chunks >= args.drop_after:
                stats["aborted"] += 1
            else:
                stats["failed"] += 1


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{")[0]
        if name.endswith("_created"):
            continue
        if any(k in name for k in ("pages", "running", "waiting", "request_success",
                                   "generation_tokens")):
            if "finished_reason" in name_labels:
                reason = name_labels.split('finished_reason="')[1].split('"')[0]
                name = f"{name}[{reason}]"
            out[name] = float(value)
    return out


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8011")
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--drop-after", type=int, default=3, help="chunks before a hang-up")
    ap.add_argument("--prompt-words", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    model = httpx.get(args.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    before = metrics(args.url)
    stats = {"completed": 0, "aborted": 0, "failed": 0, "ttft": [], "itl": [], "tpot": [],
             "errors": []}
    t0 = time.monotonic()
    deadline = t0 + args.seconds
    await asyncio.gather(*(worker(i, args, model, deadline, stats)
                           for i in range(args.clients)))
    wall = time.monotonic() - t0

    # the server frees an aborted request's pages on its next step: wait for it to go idle
    idle_deadline = time.monotonic() + 60
    while True:
        after = metrics(args.url)
        if (after.get("jaxkv:kv_pages_used", 0) == 0
                and after.get("jaxkv:num_requests_running", 0) == 0
                and after.get("jaxkv:num_requests_waiting", 0) == 0) \
                or time.monotonic() > idle_deadline:
            break
        await asyncio.sleep(0.5)

    r = httpx.post(args.url + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": "The capital of France is",
                         "max_tokens": 16, "temperature": 0.0})
    last_ok = r.status_code == 200 and bool(r.json()["choices"][0]["text"])

    total = stats["completed"] + stats["aborted"] + stats["failed"]
    result = {
        "clients": args.clients, "dropping_clients": len(range(0, args.clients, 3)),
        "seconds": round(wall, 1), "requests": total,
        "completed": stats["completed"], "aborted_by_client": stats["aborted"],
        "failed": stats["failed"],
        "ttft_ms_p50_p90_p99": [round(1000 * pct(stats["ttft"], q), 1) for q in (50, 90, 99)],
        # between two chunks of a stream (a chunk is one engine step's tokens: up to
        # max_decode_steps of them), and per output token after the first (completed ones)
        "inter_chunk_ms_p50_p90_p99": [round(1000 * pct(stats["itl"], q), 1)
                                       for q in (50, 90, 99)],
        "tpot_ms_p50_p90_p99": [round(1000 * pct(stats["tpot"], q), 1) for q in (50, 90, 99)],
        "metrics_before": before, "metrics_after": after,
        "request_success_delta": {k: after.get(k, 0) - before.get(k, 0)
                                  for k in after if "request_success" in k},
        "normal_request_after": {
            "status": r.status_code,
            "text": r.json()["choices"][0]["text"] if last_ok else r.text[:200]},
        "errors": stats["errors"][:10],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = (stats["failed"] == 0 and after.get("jaxkv:kv_pages_used", 0) == 0 and last_ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
