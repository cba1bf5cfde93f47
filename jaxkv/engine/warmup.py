"""Compiling every program an `Engine` can run before it serves (like vLLM's CUDA-graph capture).

An engine runs a handful of programs: the ragged step once per token bucket, the decode loop
once per row bucket, page copies per copy bucket, the fork sampler, the masked draw of
structured outputs' rows per row bucket, the host tier's page gather and load per copy bucket
(with ``host_kv_cache_bytes``), and (debug only) the page poisoner. `engine_programs` lists
them; `warmup` runs each on padding-only inputs (no page changes) and derives one request key.
Afterwards serving compiles nothing, so no request waits on a compile and host memory stays
flat (logits processors with entries, and a speculating grammar's masked verification,
compile on first use).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jaxkv.engine import spec_runner
from jaxkv.runtime.batch import padding_batch
from jaxkv.runtime.compiles import count_compiles
from jaxkv.runtime.page_copy import copy_pages_padded, fill_pages_padded
from jaxkv.runtime.processors import idle_masks, sample_processed
from jaxkv.runtime.sampling import sample, sample_keys, token_logprobs
from jaxkv.runtime.steps import MAX_STOP_IDS, DecodeLoopBatch
from jaxkv.sampling_params import MAX_LOGPROBS, SamplingParams

_log = logging.getLogger(__name__)


def engine_programs(engine) -> list[tuple[str, int]]:
    """(kind, size) of every program ``engine`` (an engine's `ModelRunner`) can run."""
    progs = [("step", t) for t in engine.token_buckets]
    if engine.steps.max_decode_steps > 1:
        progs += [("decode_loop", r) for r in engine.row_buckets]
    progs += [("copy_pages", n) for n in engine.copy_buckets]
    progs.append(("sample", engine.max_num_seqs))
    progs.append(("logprobs", engine.max_num_seqs))
    if engine.model.tokenizer is not None:  # structured outputs: masked draws per row bucket
        progs += [("sample_masked", r) for r in engine.row_buckets]
    if engine.spec_k:  # speculative decoding: a gather per (token, row) bucket pair, then
        # verification per row bucket (and the draft's programs, when drafts come from the device)
        progs += [("verify", (t, r)) for t in engine.token_buckets for r in engine.row_buckets]
        if engine.drafts_on_device:
            progs += [("draft", r) for r in engine.row_buckets]
    if engine.debug_nan_freed_pages:
        progs.append(("fill_pages", engine.copy_buckets[-1]))
    if engine.host_pool is not None:
        progs += [("host_save", n) for n in engine.host_pool.sizes]
        progs += [("host_load", n) for n in engine.host_pool.sizes]
    return progs


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
        temperature=z(np.float32), top_k=z(np.int32), top_p=np.ones(rows, np.float32),
        num_steps=np.int32(1),
        window_page_table=getattr(engine, "runner", engine).window_rows(rows))


def _padding(engine, t: int):
    """A padding step batch of t tokens, as this engine's steps take it."""
    batch = padding_batch(t, engine.page_table, engine.window_table)
    return spec_runner.committed_tokens(engine, batch) if engine.drafts_on_device else batch


def _precompile(engine, progs) -> None:
    """Compiles the step and decode-loop programs side by side, one per core: XLA releases
    the GIL while it compiles, and a compiled program lands in the cache a later call of the
    same signature hits (the runs in `warmup` then compile nothing)."""
    params, state = engine.model.params, engine.state
    keys, arrays = engine.sampling([])

    def compile_one(prog):
        kind, size = prog
        if kind == "step":
            engine.steps.step.lower(params, state, _padding(engine, size), keys, arrays
                                    ).compile()
        else:
            engine.steps.decode_loop.lower(params, state, idle_decode_loop(engine, size)
                                           ).compile()

    big = [p for p in progs if p[0] in ("step", "decode_loop")]
    workers = min(len(big), os.cpu_count() or 1)
    if workers < 2:
        return
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        for i, _ in enumerate(pool.map(compile_one, big)):  # (re-raises the first failure)
            kind, size = big[i]
            _log.info("warmup: %s %s compiled (%d/%d of the steps and loops, %.1f s)", kind,
                      size, i + 1, len(big), time.perf_counter() - start)


def warmup(engine) -> int:
    """Compiles every program of `engine_programs` on ``engine`` (an engine's `ModelRunner`);
    returns how many there are."""
    progs = engine_programs(engine)
    start = time.perf_counter()
    with count_compiles() as compiles:
        _precompile(engine, progs)
        _run_all(engine, progs)
    _log.info("warmup: %d programs ready in %.1f s (%d compiled, %d loaded from the compilation "
              "cache)", len(progs), time.perf_counter() - start, compiles.compiled,
              compiles.cache_hits)
    return len(progs)


def _run_all(engine, progs) -> None:
    """Runs each program once on padding inputs (compiling those `_precompile` did not)."""
    start = last = time.perf_counter()
    for i, (kind, size) in enumerate(progs):
        now = time.perf_counter()
        if now - last >= 1.0:  # the one before compiled: say where warmup is
            _log.info("warmup: %d/%d programs ready (%.1f s); next: %s %s", i, len(progs),
                      now - start, kind, size)
        last = now
        if kind == "step":
            keys, arrays = engine.sampling([])
            tokens, logits, _, engine.state = engine.steps.step(
                engine.model.params, engine.state, _padding(engine, size), keys, arrays)
            forked = sample(logits, keys, arrays)  # the fork sampler: one shape for all
            for drawn in (tokens, forked):  # logprobs of a step's or a fork's tokens
                token_logprobs(logits, drawn, MAX_LOGPROBS)
        elif kind == "sample_masked":  # (after the steps: it takes a step's logits)
            sample_processed(logits, keys, arrays, idle_masks(
                size, engine.max_num_seqs, engine.model.config.vocab_size), tokens)
        elif kind == "decode_loop":
            idle = idle_decode_loop(engine, size)
            _, after, engine.state = engine.steps.decode_loop(engine.model.params,
                                                              engine.state, idle)
            # A continuation takes the previous loop's outputs (device arrays, placed as the
            # mesh puts them), which may be a different signature from host arrays.
            chained = after.replace(page_table=idle.page_table, limit=idle.limit,
                                    num_steps=idle.num_steps,
                                    window_page_table=idle.window_page_table)
            _, _, engine.state = engine.steps.decode_loop(engine.model.params, engine.state,
                                                          chained)
        elif kind == "verify":
            spec_runner.warm_verify(engine, *size)
        elif kind == "draft":
            spec_runner.warm_draft(engine, size)
        elif kind == "copy_pages":  # one pair to a dropped destination, padded to `size`
            engine.state = copy_pages_padded(engine.state, [(0, engine.num_pages)], (size,))
        elif kind == "fill_pages":
            engine.state = fill_pages_padded(engine.state, [engine.num_pages], float("nan"),
                                             size)
        elif kind in ("host_save", "host_load"):  # a padding page: reads zeros, writes nothing
            pool = engine.host_pool
            engine.state = pool.run(engine.state, [(kind[5:], [engine.num_pages] * size,
                                                    [0] * size)] if kind == "host_save" else
                                    [("load", [0] * size, [engine.num_pages] * size)])
            pool.discard()
            pool.saved_pages = pool.loaded_pages = 0
    sample_keys(0, SamplingParams(n=2), 0)  # the per-request key derivation
    jax.block_until_ready(engine.state)
