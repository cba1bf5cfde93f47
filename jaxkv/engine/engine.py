"""Engine: continuous batching over the paged KV cache, with prefix caching and n-way samples.

One step: the scheduler plans (host) -> page copies run (device: prefix reuse of a partly
matched page, copy-on-write) -> one jitted forward over every scheduled row -> per-request
sampling -> bookkeeping (host). Decode rows and prefill chunks go through one ragged `prefill`
call, so the weights are read once per step; a step whose rows all have one token uses the
`decode` program (and kernel).

Shapes: rows are padded to at least MIN_ROWS (capped by max_num_seqs) and the page table to its
full width (max_model_len / page_size): the kernels stop at each row's length, so width costs
no device work, and fixing it removes an axis of programs to compile; tokens and rows are
bucketed by `build_batch`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import time

import jax
import numpy as np

from jaxkv.attention import check_page_size, kernel_for
from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.radix import RadixCache
from jaxkv.engine import warmup as compile_ahead
from jaxkv.engine.request import (
    CompletionOutput,
    EngineStats,
    Request,
    RequestOutput,
    request_metrics,
)
from jaxkv.engine.scheduler import ScheduledRow, Scheduler
from jaxkv.kv import init_state
from jaxkv.model.pretrained import Model
from jaxkv.runtime.batch import build_batch
from jaxkv.runtime.page_copy import copy_pages_padded, fill_pages_padded
from jaxkv.runtime.sampling import SamplingArrays, request_key, sample
from jaxkv.runtime.steps import make_steps
from jaxkv.sampling_params import SamplingParams
from jaxkv.sharding import shard, shard_state

MIN_ROWS = 8
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Entry:
    prompt: str | None
    samples: list[Request]  # samples[j] is sample j; samples[0] prefills the prompt
    error: str | None = None  # why the request failed (finish_reason "error")


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Engine: {name} must be an int >= 1, got {value!r}")
    return value


class Engine:
    """Serves requests step by step: `add_request`, `step` (streaming outputs), `abort`.

    ``num_pages`` pages of ``page_size`` tokens hold every sequence's KV and the prefix cache.
    ``max_num_seqs`` bounds running sequences (each sample of an n > 1 request counts),
    ``max_num_batched_tokens`` the tokens of one step (decodes + prefill chunks).
    ``debug_nan_freed_pages`` fills every freed page with NaN before the next step runs, so a
    read of a stale page (another request's, or a finished one's) would surface as NaN.
    ``mesh`` (`jaxkv.sharding.make_mesh`): tensor parallelism, the model and KV pages split by
    head over its devices; the host side is the same, one page table for all shards.
    """

    def __init__(self, model: Model, *, page_size: int = 16, num_pages: int,
                 max_num_seqs: int = 32, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 attention_impl: str = "auto", seed: int = 0, debug_nan_freed_pages: bool = False,
                 mesh=None):
        if mesh is not None:  # tensor parallel: weights and KV pages split by head
            model = shard(model, mesh)
        cfg = model.config
        _positive_int("page_size", page_size)
        try:
            check_page_size(attention_impl, page_size, model.dtype)
        except ValueError as e:
            raise ValueError(f"Engine: {e}") from None
        _positive_int("num_pages", num_pages)
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        _positive_int("max_model_len", max_model_len)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"Engine: max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"Engine: seed must be an int >= 0, got {seed!r}")
        self.model, self.page_size, self.num_pages = model, page_size, num_pages
        self.max_num_seqs, self.max_model_len, self.seed = max_num_seqs, max_model_len, seed
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.mesh = mesh
        self.steps = make_steps(model.graphdef, attention_impl, mesh)
        # The Pallas kernels are ragged: the longest row (Q) is no shape for them, so one
        # program per (T, B) serves every Q. Only the jnp reference sizes its work by Q.
        self.q_is_shape = kernel_for(attention_impl) == "reference"
        self.min_rows = min(MIN_ROWS, max_num_seqs)
        self.debug_nan_freed_pages = debug_nan_freed_pages
        self.allocator = PageAllocator(num_pages, track_freed=debug_nan_freed_pages)
        self.radix = RadixCache(self.allocator, page_size) if enable_prefix_caching else None
        self.scheduler = Scheduler(self.allocator, self.radix, page_size=page_size,
                                   max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   eos_token_ids=cfg.eos_token_ids)
        self.state = self._new_state()
        self._requests: dict[str, _Entry] = {}  # unfinished, by id
        self._pending: list[RequestOutput] = []  # aborted requests, reported by the next step
        self._num_added = self._prompt_tokens = self._steps = 0

    def _new_state(self):
        state = init_state(self.model.config, self.num_pages, self.page_size, self.max_num_seqs,
                           self.max_pages_per_seq, self.model.dtype)
        return state if self.mesh is None else shard_state(state, self.mesh)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None = None,
                    prompt_token_ids=None, sampling_params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        """Queues a request (text ``prompt`` or ``prompt_token_ids``, not both).

        Raises ValueError naming the bad field, or when the request cannot fit even alone.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already used by an unfinished "
                             "request")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be None or a string, got {cache_salt!r}")
        self._check_fits(request_id, len(ids), sp)
        index, now = self._num_added, time.time()
        samples = [Request(request_id, ids, sp, index, now, sample_index=j, cache_salt=cache_salt,
                           key=key) for j, key in enumerate(self._sample_keys(sp, index))]
        samples[0].forks = samples[1:]
        self._requests[request_id] = _Entry(prompt, samples)
        self._num_added += 1
        self._prompt_tokens += len(ids)
        self.scheduler.add(samples[0])

    def _prompt_ids(self, prompt, prompt_token_ids) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompt (text) and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__} "
                                 "(token ids go in prompt_token_ids)")
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.model.encode(prompt)
            if not ids:
                raise ValueError(f"prompt {prompt!r} encodes to no tokens")
            return ids
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
            raise ValueError("prompt_token_ids must be a sequence of ints, got "
                             f"{type(prompt_token_ids).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty")
        vocab = self.model.config.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids[{i}]={t!r} is not a token id in the "
                                 f"vocabulary [0, {vocab})")
        return [int(t) for t in prompt_token_ids]

    def _check_fits(self, request_id: str, prompt_len: int, sp: SamplingParams) -> None:
        total = prompt_len + sp.max_tokens
        if prompt_len >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: the prompt has {prompt_len} tokens; "
                             f"max_model_len={self.max_model_len} leaves no room to generate")
        if total > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt ({prompt_len} tokens) + "
                             f"max_tokens ({sp.max_tokens}) = {total} tokens exceeds "
                             f"max_model_len={self.max_model_len}")
        need = -(-(total - 1) // self.page_size)  # the last sampled token's KV is never stored
        if need > self.num_pages:
            raise ValueError(f"request {request_id!r} needs {need} KV pages ({prompt_len} prompt "
                             f"+ {sp.max_tokens} max_tokens tokens at page_size "
                             f"{self.page_size}) but the cache has only {self.num_pages} pages")
        vocab = self.model.config.vocab_size
        bad = [t for t in sp.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids={sp.stop_token_ids!r}: {bad[0]} is "
                             f"not a token id in the vocabulary [0, {vocab})")
        if sp.n > self.max_num_seqs:
            raise ValueError(f"SamplingParams.n={sp.n} exceeds max_num_seqs={self.max_num_seqs}")

    def _sample_keys(self, sp: SamplingParams, index: int) -> list[np.ndarray]:
        """Sample j's raw key: as `jaxkv.generate` with ``sp.seed``, else from the engine seed
        and the request's index, so outputs never depend on the batch a request lands in."""
        if sp.seed is not None:
            return [request_key(sp.seed, j) for j in range(sp.n)]
        base = jax.random.fold_in(jax.random.PRNGKey(self.seed), index)
        return [np.asarray(jax.random.fold_in(base, j), np.uint32) for j in range(sp.n)]

    def abort(self, request_id: str) -> None:
        """Ends an unfinished request now, freeing its pages; the next `step` reports it.

        Raises ValueError if no unfinished request has this id (never added, finished, or
        already aborted)."""
        entry = self._requests.pop(request_id, None) if isinstance(request_id, str) else None
        if entry is None:
            raise ValueError(f"abort: no unfinished request with request_id {request_id!r}")
        now = time.time()
        for s in entry.samples:  # the parent first: it holds its unborn samples' slots
            if not s.is_done:
                self.scheduler.finish(s, "abort", now)
        self._pending.append(self._output(request_id, entry))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the (cumulative) output of each request that got a token
        or finished in it, and of requests aborted since the last step.

        If the device step (or sampling) raises, the requests in it fail with finish_reason
        "error" and the message in `RequestOutput.error`; every other request keeps going. If
        the failure consumed the KV state, it is rebuilt and the other running requests
        recompute their KV (as after a preemption).
        """
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        try:
            sampled = self._run(plan)
        except Exception as e:  # noqa: BLE001 - any failure of the step fails its requests
            return outputs + self._fail(plan, e)
        if sampled is None:
            return outputs
        progressed = self.scheduler.update(plan, sampled, time.time())
        for rid in dict.fromkeys(r.request_id for r in progressed):
            entry = self._requests[rid]
            out = self._output(rid, entry)
            if out.finished:
                del self._requests[rid]
            outputs.append(out)
        return outputs

    def _run(self, plan) -> list[list[int] | None] | None:
        """The device part of a step: page poisoning and copies, the forward, sampling."""
        if self.debug_nan_freed_pages:  # poison what is free now: a later read would show NaN
            freed = self.allocator.drain_freed()
            if freed:
                self.state = fill_pages_padded(self.state, freed, float("nan"))
        if plan.copies:
            self.state = copy_pages_padded(self.state, plan.copies)
        rows = plan.rows
        if not rows:
            return None
        batch = build_batch(rows, page_size=self.page_size, num_pages=self.num_pages,
                            max_seqs=self.max_num_seqs, max_pages_per_seq=self.max_pages_per_seq,
                            vocab_size=self.model.config.vocab_size,
                            min_tokens=self.min_rows, min_rows=self.min_rows)
        table = batch.page_table
        batch = batch.replace(page_table=np.pad(
            table, ((0, 0), (0, self.max_pages_per_seq - table.shape[1]))))
        if batch.max_q_len > 1 and not self.q_is_shape:
            batch = batch.replace(max_q_len=batch.tokens.shape[0])
        run = self.steps.decode if batch.max_q_len == 1 else self.steps.prefill
        logits, self.state = run(self.model.params, self.state, batch)
        self._steps += 1
        return self._sample(logits, rows)

    def step_shapes(self) -> list[tuple[int, int, int]]:
        """The (T tokens, B rows, Q longest row) of every step program this engine can run."""
        return compile_ahead.engine_step_shapes(self)

    def warmup(self) -> int:
        """Compiles every program serving can run, so no request waits on a compile; returns
        the number of step shapes (see `jaxkv.engine.warmup`)."""
        return compile_ahead.warmup(self)

    def _state_lost(self) -> bool:
        """True if the KV state is unusable: donated to a step that failed before returning
        (deleted buffers), or the output of a step that failed on the device after returning
        (an async error that surfaces when the arrays are read)."""
        try:
            if any(x.is_deleted() for x in jax.tree.leaves(self.state)):
                return True
            jax.block_until_ready(self.state)
            return False
        except Exception:  # noqa: BLE001 - whatever the device reports, the state is gone
            return True

    def _fail(self, plan, error: Exception) -> list[RequestOutput]:
        """Fails every request with a row in the failed step; keeps the rest serving."""
        message = f"{type(error).__name__}: {error}"
        _log.error("engine step failed; failing its requests: %s", message, exc_info=error)
        now, outputs = time.time(), []
        for rid in dict.fromkeys(row.request.request_id for row in plan.rows):
            entry = self._requests.pop(rid)
            entry.error = message
            for s in entry.samples:  # its KV may be half-written: cache none of it
                if not s.is_done:
                    self.scheduler.finish(s, "error", now, cache=False)
            outputs.append(self._output(rid, entry))
        if self._state_lost():
            self.scheduler.preempt_all()  # their KV is gone: recompute from their tokens
            if self.radix is not None:
                self.radix.clear()
            if self.debug_nan_freed_pages:
                self.allocator.drain_freed()  # the new state starts zeroed
            self.state = self._new_state()
        return outputs

    def _sample(self, logits, rows: list[ScheduledRow]) -> list[list[int] | None]:
        """One token per sample of each sampling row. A forking row has n samples: round r
        samples the r-th of every row from the same logits (same shapes: no new program)."""
        b = logits.shape[0]
        out: list[list[int] | None] = [[] if r.samples else None for r in rows]
        for r in range(max((len(row.samples) for row in rows), default=0)):
            keys = np.zeros((b, 2), np.uint32)
            temperature, top_k = np.zeros(b, np.float32), np.zeros(b, np.int32)
            top_p, step = np.ones(b, np.float32), np.zeros(b, np.int32)
            live = [i for i, row in enumerate(rows) if r < len(row.samples)]
            for i in live:
                seq = rows[i].samples[r]
                sp = seq.sampling_params
                keys[i], step[i] = seq.key, seq.num_output_tokens
                temperature[i], top_k[i], top_p[i] = sp.temperature, sp.top_k, sp.top_p
            tokens = np.asarray(sample(logits, keys,
                                       SamplingArrays(temperature, top_k, top_p, step)))
            for i in live:
                out[i].append(int(tokens[i]))
        return out

    def _output(self, request_id: str, entry: _Entry) -> RequestOutput:
        tok = self.model.tokenizer
        detokenize = functools.partial(tok.decode, skip_special_tokens=True) if tok else None
        outs = [CompletionOutput(index=s.sample_index, token_ids=s.output_token_ids,
                                 finish_reason=s.finish_reason, detokenize=detokenize)
                for s in entry.samples]
        first = entry.samples[0]
        return RequestOutput(
            request_id=request_id, prompt=entry.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=outs, finished=all(s.is_done for s in entry.samples),
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=request_metrics(entry.samples), error=entry.error)

    # ---- accounting ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        used, cached = self.scheduler.page_usage()
        c = self.scheduler.counters
        return EngineStats(
            prompt_tokens=self._prompt_tokens, cached_prompt_tokens=c.cached_prompt_tokens,
            computed_prompt_tokens=c.computed_prompt_tokens,
            generated_tokens=c.generated_tokens, preemptions=c.preemptions,
            kv_pages_total=self.num_pages, kv_pages_used=used, kv_pages_cached=cached,
            kv_pages_free=self.allocator.num_free, steps=self._steps)

    def check(self) -> None:
        """Asserts the host invariants: every page's refcount equals its holders (running
        sequences and prefix-cache references), and the radix tree's own invariants."""
        self.allocator.check(holders=self.scheduler.holders())
        if self.radix is not None:
            self.radix.check()
