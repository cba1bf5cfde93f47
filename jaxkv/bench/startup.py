"""Start-up time: `jaxkv serve` until /health answers, and `LLM(model)` until it returns, on a
cold and then a warm persistent compilation cache (`jaxkv.runtime.compile_cache`) and program
store (`jaxkv.runtime.stored_jit`).

Each start is a new process (imports, model load, pool sizing, warmup, as a user who tunes
nothing gets them), timed from its launch. The first start of each kind uses an empty cache
folder of its own, the next ones the folder the first filled; the warmup's own log line says
how many programs were compiled and how many loaded from the cache. `jaxkv serve` is healthy
once every request can run and compiles the rest in the background (``background_warmup``):
right after /health answers, one completion (a 200-token prompt, 16 new tokens) is timed, and
the server is stopped only once its background warmup is done (the time from launch is the
last column), so the next start finds every program.

    jaxkv bench startup [--model smollm2] [--kinds serve llm] [--starts 2]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_WARMUP = re.compile(r"warmup: (\d+) programs ready in ([\d.]+) s \((\d+) compiled, (\d+) loaded "
                     r"from the compilation cache, (\d+) from the program store")
_BACKGROUND = re.compile(r"warmup: background: every program ready in")
_LLM = ("import logging, sys, time; t = time.perf_counter(); import jaxkv; "
        "logging.basicConfig(); logging.getLogger('jaxkv').setLevel(logging.INFO); "
        "jaxkv.LLM(None if sys.argv[1] == 'tiny' else sys.argv[1], "
        "compilation_cache_dir=sys.argv[2]); print(f'READY {time.perf_counter() - t:.2f}')")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="tiny (the embedded model), smollm2, or a checkpoint path")
    parser.add_argument("--kinds", nargs="+", default=["serve", "llm"], choices=["serve", "llm"])
    parser.add_argument("--starts", type=int, default=2, help="starts per kind (the first cold)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per start")


def _serve_once(model: str, cache: str, timeout: float) -> tuple[float, str, float, float]:
    """Seconds to /health, the log, then seconds of a first request and from launch until
    every program is ready."""
    import socket

    import httpx

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxkv.cli", "serve", model, "--port", str(port),
           "--compilation-cache-dir", cache]
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while time.perf_counter() - t < timeout:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"jaxkv serve exited ({proc.returncode}):\n"
                                       f"{log.read()[-3000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                raise RuntimeError(f"jaxkv serve not healthy after {timeout:.0f} s")
            seconds = time.perf_counter() - t
            sent = time.perf_counter()
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=timeout, json=dict(
                prompt="the cat sat on the mat. " * 25, max_tokens=16, temperature=0,
                ignore_eos=True)).raise_for_status()
            first = time.perf_counter() - sent
            while time.perf_counter() - t < timeout:
                log.seek(0)
                text = log.read()
                if _BACKGROUND.search(text) or "more compile in the background" not in text:
                    break
                time.sleep(0.2)
            ready = time.perf_counter() - t
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        log.seek(0)
        return seconds, log.read(), first, ready


def _llm_once(model: str, cache: str, timeout: float) -> tuple[float, str, None, float]:
    t = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", _LLM, model, cache], capture_output=True,
                         text=True, timeout=timeout)
    seconds = time.perf_counter() - t
    if run.returncode:
        raise RuntimeError(f"LLM({model!r}) failed:\n{run.stderr[-3000:]}")
    return seconds, run.stdout + run.stderr, None, seconds


def run(args) -> dict:
    print("| kind | start | compilation cache | seconds to ready | programs ready | compiled | "
          "loaded from jax's cache | loaded whole (program store) | warmup s | first request s "
          "| every program ready s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for kind in args.kinds:
        with tempfile.TemporaryDirectory(prefix="jaxkv-xla-") as cache:
            for i in range(args.starts):
                once = _serve_once if kind == "serve" else _llm_once
                seconds, log, first, ready = once(args.model, str(Path(cache)), args.timeout)
                m = _WARMUP.search(log)
                programs, warm_s, compiled, loaded, stored = (m.groups() if m else ("?",) * 5)
                row = dict(kind=kind, start=i + 1, cold=i == 0, seconds=seconds,
                           programs=programs, compiled=compiled, loaded=loaded, stored=stored,
                           warmup_s=warm_s, first_request_s=first, all_ready_s=ready)
                rows.append(row)
                what = "jaxkv serve → /health" if kind == "serve" else "LLM(model)"
                print(f"| {what} | {i + 1} | {'empty' if i == 0 else 'warm'} | {seconds:.1f} | "
                      f"{programs} | {compiled} | {loaded} | {stored} | {warm_s} | "
                      f"{'-' if first is None else f'{first:.1f}'} | {ready:.1f} |", flush=True)
    return {"model": args.model, "rows": rows}
