"""Compiling every program an `Engine` can run before it serves (like vLLM's CUDA-graph capture).

An engine runs a handful of programs: the ragged step once per token bucket, the decode loop
once per row bucket, page copies per copy bucket, the fork sampler, the masked draw of
structured outputs' rows per row bucket, the host tier's page gather and load per copy bucket
(with ``host_kv_cache_bytes``), and (debug only) the page poisoner. Each kind is registered
once in `PROGRAMS` with its sizes on a runner and how it runs on padding; `engine_programs`
lists what the registry gives a runner and `warmup` runs exactly that (no page changes), so a
program added to the registry cannot go unwarmed.
Afterwards serving compiles nothing, so no request waits on a compile and host memory stays
flat (logits processors with entries, and a speculating grammar's masked verification,
compile on first use).

With ``background_warmup``, `warmup` compiles only what every request needs (the smallest
token bucket's step, the samplers, the copies) and returns; a `BackgroundWarmup` thread
compiles the rest (the larger token buckets, the decode loops) into the program store while
the engine serves. Until a program is ready the engine does not run it: each step's tokens
are capped at the largest token bucket ready (`ModelRunner.ready_tokens`), and decodes run as
ragged steps until their row bucket's loop is ready. So serving still compiles nothing.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jaxkv.engine import spec_runner
from jaxkv.runtime.batch import padding_batch
from jaxkv.runtime.compiles import count_compiles
from jaxkv.runtime.page_copy import copy_pages_padded, fill_pages_padded
from jaxkv.runtime.processors import idle_masks, sample_processed
from jaxkv.runtime.sampling import RowSettings, sample, sample_keys, token_logprobs
from jaxkv.runtime.steps import MAX_STOP_IDS, DecodeLoopBatch
from jaxkv.runtime.stored_jit import program_store
from jaxkv.sampling_params import MAX_LOGPROBS, SamplingParams

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Program:
    """A kind of program an engine runs."""

    kind: str
    sizes: Callable[[object], Sequence]
    """Its buckets on a runner (none: that engine never runs it)."""
    warm: Callable[[object, object, dict], None]
    """Runs it once at a size on padding (writes no page); ``ctx`` carries what a later kind
    takes from an earlier one (a step's logits: the samplers' inputs as serving passes them)."""
    prepare: Callable[[object, object], object] | None = None
    """Compiles it at a size (or loads it from the program store) ahead of its run, for the
    ones that compile side by side (`_precompile`): the steps, the decode loops, and with the
    program store the samplers."""


def _padding(runner, t: int):
    """A padding step batch of t tokens, as this runner's steps take it."""
    batch = padding_batch(t, runner.page_table, runner.window_table)
    return spec_runner.committed_tokens(runner, batch) if runner.drafts_on_device else batch


def _step_args(runner, size) -> tuple:
    """A step's arguments on padding of ``size`` tokens: params, state, batch, keys, arrays."""
    return (runner.model.params, runner.state, _padding(runner, size), *runner.sampling([]))


def _warm_step(runner, size, ctx) -> None:
    args = _step_args(runner, size)
    _, _, batch, ctx["keys"], ctx["arrays"] = args
    whole = None if program_store() is None else runner.steps.step.executable(*args)
    if whole is not None:  # in the program store's table: nothing left to trace or compile
        # (running it on padding would only cost its run: up to a second on CPU); the
        # samplers after it take logits shaped and placed as its outputs
        ctx["tokens"], ctx["logits"] = (jax.device_put(np.zeros(o.shape, o.dtype), o.sharding)
                                        for o in whole.out_info[:2])
        return
    ctx["tokens"], ctx["logits"], _ = runner.run(runner.steps.step, batch, ctx["keys"],
                                                 ctx["arrays"])


def _prepare_step(runner, size):
    return _prepare(runner.steps.step, *_step_args(runner, size))


def _warm_decode_loop(runner, size, ctx) -> None:
    idle = idle_decode_loop(runner, size)
    _, after = runner.run(runner.steps.decode_loop, idle)
    # A continuation takes the previous loop's outputs (device arrays, placed as the mesh puts
    # them), which may be a different signature from host arrays.
    runner.run(runner.steps.decode_loop, after.replace(
        page_table=idle.page_table, limit=idle.limit, num_steps=idle.num_steps,
        window_page_table=idle.window_page_table))


def _prepare_decode_loop(runner, size):
    return _prepare(runner.steps.decode_loop, runner.model.params, runner.state,
                    idle_decode_loop(runner, size))


def _prepare(program, *args) -> None:
    """Compiles ``program`` for ``args``, where a later call of the same signature finds it:
    the program store's table when one is in use (`jaxkv.runtime.stored_jit`), else jax's
    caches."""
    if program_store() is None or program.executable(*args) is None:
        program.lower(*args).compile()


def _warm_copy_pages(runner, size, ctx) -> None:  # one pair to a dropped destination
    runner.update_state(copy_pages_padded, [(0, runner.num_pages)], (size,))


def _warm_sample(runner, size, ctx) -> None:  # the fork sampler: one shape for every step
    ctx["forked"] = sample(ctx["logits"], ctx["keys"], ctx["arrays"])


def _sampler_inputs(runner):
    """Logits, keys, settings and tokens shaped as a step's outputs give the samplers (host
    arrays: the program store keys them as the outputs, on the default device)."""
    keys, arrays = runner.sampling([])
    rows, vocab = runner.max_num_seqs, runner.model.config.vocab_size
    return np.zeros((rows, vocab), np.float32), keys, arrays, np.zeros(rows, np.int32)


def _prepare_sampler(runner, kind: str, size) -> None:
    """Compiles a sampler alongside the steps, where the program store will hand it to the run
    in `warmup` (without the store, jax.jit would compile it again for the device arrays that
    run passes: then it compiles there)."""
    if program_store() is None:
        return
    logits, keys, arrays, tokens = _sampler_inputs(runner)
    if kind == "sample":
        _prepare(sample, logits, keys, arrays)
    elif kind == "logprobs":
        _prepare(token_logprobs, logits, tokens, MAX_LOGPROBS)
    else:
        _prepare(sample_processed, logits, keys, arrays, idle_masks(
            size, runner.max_num_seqs, runner.model.config.vocab_size), tokens)


def _warm_logprobs(runner, size, ctx) -> None:  # of a step's tokens, and of a fork's
    for drawn in (ctx["tokens"], ctx["forked"]):
        token_logprobs(ctx["logits"], drawn, MAX_LOGPROBS)


def _warm_sample_masked(runner, size, ctx) -> None:
    sample_processed(ctx["logits"], ctx["keys"], ctx["arrays"], idle_masks(
        size, runner.max_num_seqs, runner.model.config.vocab_size), ctx["tokens"])


def _warm_fill_pages(runner, size, ctx) -> None:
    runner.update_state(fill_pages_padded, [runner.num_pages], float("nan"), size)


def _warm_host(runner, kind, size) -> None:  # a padding page: reads zeros, writes nothing
    pool = runner.host_pool
    runner.update_state(pool.run, [("save", [runner.num_pages] * size, [0] * size)]
                        if kind == "save" else [("load", [0] * size, [runner.num_pages] * size)])
    pool.discard()
    pool.saved_pages = pool.loaded_pages = 0


def _host_sizes(runner):
    return () if runner.host_pool is None else runner.host_pool.sizes


# In the order warmup runs them: the samplers after the steps whose logits they take.
PROGRAMS = (
    Program("step", lambda r: r.token_buckets, _warm_step, _prepare_step),
    Program("decode_loop", lambda r: r.row_buckets if r.steps.max_decode_steps > 1 else (),
            _warm_decode_loop, _prepare_decode_loop),
    Program("copy_pages", lambda r: r.copy_buckets, _warm_copy_pages),
    Program("sample", lambda r: (r.max_num_seqs,), _warm_sample,
            lambda r, size: _prepare_sampler(r, "sample", size)),
    Program("logprobs", lambda r: (r.max_num_seqs,), _warm_logprobs,
            lambda r, size: _prepare_sampler(r, "logprobs", size)),
    # structured outputs: masked draws per row bucket
    Program("sample_masked", lambda r: r.row_buckets if r.model.tokenizer is not None else (),
            _warm_sample_masked, lambda r, size: _prepare_sampler(r, "sample_masked", size)),
    # speculative decoding: a gather per (token, row) bucket pair, then verification per row
    # bucket (and the draft's programs, when drafts come from the device)
    Program("verify", lambda r: [(t, b) for t in r.token_buckets for b in r.row_buckets]
            if r.spec_k else (), lambda r, size, ctx: spec_runner.warm_verify(r, *size)),
    Program("draft", lambda r: r.row_buckets if r.spec_k and r.drafts_on_device else (),
            lambda r, size, ctx: spec_runner.warm_draft(r, size)),
    Program("fill_pages", lambda r: r.copy_buckets[-1:] if r.debug_nan_freed_pages else (),
            _warm_fill_pages),
    Program("host_save", _host_sizes, lambda r, size, ctx: _warm_host(r, "save", size)),
    Program("host_load", _host_sizes, lambda r, size, ctx: _warm_host(r, "load", size)),
)


def program(kind: str) -> Program:
    """The registered `Program` of a kind."""
    return next(p for p in PROGRAMS if p.kind == kind)


def engine_programs(runner) -> list[tuple[str, object]]:
    """(kind, size) of every program ``runner`` (an engine's `ModelRunner`) can run."""
    return [(p.kind, size) for p in PROGRAMS for size in p.sizes(runner)]


def idle_decode_loop(engine, rows: int) -> DecodeLoopBatch:
    """Decode-loop inputs of ``rows`` rows that are all padding (for compiling ahead) of
    ``engine`` (an `Engine` or its `ModelRunner`)."""
    def z(dtype, *shape):
        return np.zeros(shape or (rows,), dtype)

    return DecodeLoopBatch(
        tokens=z(np.int32), positions=z(np.int32),
        page_table=z(np.int32, rows, engine.max_pages_per_seq), live=z(bool),
        limit=z(np.int32), generated=z(np.int32), min_tokens=z(np.int32),
        max_tokens=np.ones(rows, np.int32),
        stop_ids=np.full((rows, MAX_STOP_IDS), -1, np.int32), keys=z(np.uint32, rows, 2),
        settings=RowSettings.of(rows), num_steps=np.int32(1),
        window_page_table=getattr(engine, "runner", engine).window_rows(rows))


def _precompile(runner, progs) -> None:
    """Compiles the programs that have a ``prepare`` side by side, one per core (the longest
    first, the samplers filling in after): XLA releases the GIL while it compiles (and while
    it loads a stored program), and a compiled program lands where a later call of the same
    signature finds it (the runs in `warmup` then compile nothing)."""
    big = [(kind, size) for kind, size in progs if program(kind).prepare is not None]
    big.sort(key=lambda prog: prog[0] not in ("step", "decode_loop"))  # the longest first
    workers = min(len(big), os.cpu_count() or 1)
    if workers < 2:
        return
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        compiled = pool.map(lambda prog: program(prog[0]).prepare(runner, prog[1]), big)
        for i, _ in enumerate(compiled):  # (re-raises the first failure)
            kind, size = big[i]
            _log.info("warmup: %s %s compiled (%d/%d compiled side by side, %.1f s)", kind,
                      size, i + 1, len(big), time.perf_counter() - start)


def warmup(runner) -> int:
    """Compiles every program of `engine_programs` on ``runner`` (an engine's `ModelRunner`),
    or with ``background_warmup`` those every request needs, leaving the rest to a
    `BackgroundWarmup` (``runner.warming``); returns how many programs there are."""
    if runner.warming is not None:  # warmed up again: the earlier background stops first
        runner.warming.stop()
        runner.warming = None
    progs = engine_programs(runner)
    later = _deferrable(runner, progs) if runner.config.runtime.background_warmup else []
    now = [prog for prog in progs if prog not in later]
    start = time.perf_counter()
    with count_compiles() as compiles:
        _precompile(runner, now)
        _run_all(runner, now)
        if later and not _stored(runner):
            _log.info("warmup: background_warmup is off: the program store does not keep this "
                      "model's programs; every program compiles first")
            _precompile(runner, later)
            _run_all(runner, later)
            now, later = progs, []
    _log.info("warmup: %d programs ready in %.1f s (%d compiled, %d loaded from the compilation "
              "cache, %d from the program store)%s", len(now), time.perf_counter() - start,
              compiles.compiled, compiles.cache_hits, compiles.stored,
              f"; {len(later)} more compile in the background" if later else "")
    if later:
        runner.warming = BackgroundWarmup(runner, later)
    return len(progs)


def _stored(runner) -> bool:
    """Whether the program store keeps this runner's step (a model whose description cannot
    be reproduced, say, is not stored: a background compile would not land where serving
    looks). Asked after the smallest step was prepared: nothing compiles here."""
    return runner.steps.step.executable(*_step_args(runner, runner.token_buckets[0])) \
        is not None


def _deferrable(runner, progs) -> list[tuple[str, object]]:
    """The programs a request can do without while they compile: the step of every token
    bucket but the smallest (a step's tokens are capped meanwhile) and the decode loops (ragged
    steps decode meanwhile). None where a background compile would not land where serving
    finds it, or where the cap would not hold."""
    why = ("no program store (compilation_cache_dir is none)" if program_store() is None else
           "a mesh (tensor or data parallelism, disaggregation: a loop's continuation takes "
           "sharded arrays)" if runner.mesh is not None
           else "speculative decoding" if runner.spec_k else None)
    if why is not None:
        _log.info("warmup: background_warmup is off with %s: every program compiles first", why)
        return []
    return [(kind, size) for kind, size in progs if kind == "decode_loop"
            or kind == "step" and size != runner.token_buckets[0]]


class BackgroundWarmup:
    """Compiles ``progs`` (steps and decode loops) into the program store on daemon threads of
    its own (one per core but one: the other serves), smallest first; ``pending`` holds those
    not ready yet, which the engine does not run. A program that fails to compile leaves
    ``pending`` too: serving then compiles it on first use and reports the error there. At
    exit (or `stop`) no further program starts; the ones compiling finish. While it runs,
    programs compile with jax's persistent cache bypassed (`jaxkv.runtime.stored_jit`), those
    the engine compiles meanwhile included."""

    def __init__(self, runner, progs: list[tuple[str, object]]):
        # the order they become ready: each kind's buckets interleaved, smallest first
        index = {prog: i for kind in ("step", "decode_loop")
                 for i, prog in enumerate(p for p in progs if p[0] == kind)}
        self.pending = set(progs)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for prog in sorted(progs, key=lambda prog: (index[prog], prog[0] != "step")):
            self._queue.put(prog)
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._start = time.perf_counter()
        workers = min(len(progs), max(1, (os.cpu_count() or 1) - 1))
        # daemon threads: the interpreter's exit does not wait for the queue (`stop` at exit
        # waits only for the programs compiling, which a daemon killed inside XLA could crash)
        self._threads = [threading.Thread(target=self._work, args=(runner,), daemon=True,
                                          name=f"jaxkv-warmup-{i}") for i in range(workers)]
        atexit.register(self.stop)
        for thread in self._threads:
            thread.start()

    def _work(self, runner) -> None:
        while not self._stop.is_set():
            try:
                kind, size = prog = self._queue.get_nowait()
            except queue.Empty:
                break
            try:
                program(kind).prepare(runner, size)
            except Exception as e:  # noqa: BLE001 - serving compiles it and reports the error
                _log.warning("warmup: background compile of %s %s failed (%s: %s); it compiles "
                             "on first use", kind, size, type(e).__name__, e)
            with self._lock:
                self.pending.discard(prog)
                left = len(self.pending)
            _log.info("warmup: background: %s %s ready (%d left, %.1f s)", kind, size, left,
                      time.perf_counter() - self._start)
            if left == 0:
                _log.info("warmup: background: every program ready in %.1f s",
                          time.perf_counter() - self._start)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every program is ready (or ``timeout`` seconds, or `stop`); returns
        whether every one is."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        return not self.pending

    def cancel(self) -> None:
        """Starts no further program (those compiling go on)."""
        self._stop.set()

    def stop(self) -> None:
        """Starts no further program and waits for those compiling."""
        self.cancel()
        for thread in self._threads:
            thread.join()
        atexit.unregister(self.stop)


def _run_all(runner, progs) -> None:
    """Runs each program once on padding inputs (compiling those `_precompile` did not)."""
    start = last = time.perf_counter()
    ctx: dict = {}
    for i, (kind, size) in enumerate(progs):
        now = time.perf_counter()
        if now - last >= 1.0:  # the one before compiled: say where warmup is
            _log.info("warmup: %d/%d programs ready (%.1f s); next: %s %s", i, len(progs),
                      now - start, kind, size)
        last = now
        program(kind).warm(runner, size, ctx)
    sample_keys(0, SamplingParams(n=2), 0)  # the per-request key derivation
    jax.block_until_ready(runner.state)
