"""Engine: continuous batching over the paged KV cache, with prefix caching and n-way samples.

One step: the scheduler plans (host) -> page copies run (device: prefix reuse of a partly
matched page, copy-on-write) -> device work -> bookkeeping (host). The device work is one of
two programs (`jaxkv.runtime.steps`):

- a ragged ``step`` when any row has a prefill chunk: every scheduled row (decodes and chunks)
  in one flattened batch, so the weights are read once, each row's next token sampled on
  device;
- a ``decode_loop`` when only decodes run and nothing waits: up to ``max_decode_steps`` decode
  steps on device with sampling and stop checks there, pages for them reserved beforehand, the
  tokens read back once.

Shapes: the step is one program per token bucket (powers of two from 16 to
max_num_batched_tokens) with rows = slots (max_num_seqs) and the page table at its full width;
the decode loop one per row bucket. Width costs nothing: the kernels and the jnp reference stop
at each row's length. `Engine.programs` lists every program; `warmup` compiles them.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxkv.attention import check_page_size, kernel_for
from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.host_radix import HostTieredRadixCache
from jaxkv.cache.prefix import NullPrefixCache
from jaxkv.cache.radix import RadixCache
from jaxkv.engine import logprobs, weights
from jaxkv.engine import warmup as compile_ahead
from jaxkv.engine.detokenizer import IncrementalDetokenizer
from jaxkv.engine.host_tier import HostKVPool
from jaxkv.engine.request import (
    CompletionOutput,
    EngineStats,
    Request,
    RequestOutput,
    RequestStatus,
    request_metrics,
)
from jaxkv.engine.scheduler import ScheduledRow, Scheduler
from jaxkv.kv import init_state
from jaxkv.model.pretrained import Model
from jaxkv.runtime.batch import PageTable, build_batch, fit, ladder, pow2
from jaxkv.runtime.page_copy import copy_pages_padded, fill_pages_padded
from jaxkv.runtime.processors import build_processors, has_processors, sample_processed
from jaxkv.runtime.sampling import (
    MAX_BANNED,
    SamplingArrays,
    check_bannable,
    request_key,
    sample,
    token_logprobs,
)
from jaxkv.runtime.steps import MAX_STOP_IDS, DecodeLoopBatch, make_steps
from jaxkv.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from jaxkv.sharding import commit, place_params, shard, shard_state
from pallas_kernels.quant import is_quantized, pages_per_scale_row, storage_dtype

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Loop:
    """A dispatched decode loop: its rows, the host's view of their inputs, its outputs."""

    plan: object  # the SchedulerOutput whose decode rows it runs
    starts: list[int]  # position of each row's pending token at the loop's start
    limits: list[int]  # tokens each row may sample in it
    generated: list[int]  # output tokens of each row at its start
    table: np.ndarray  # the page table it was given (host)
    after: DecodeLoopBatch  # device: the inputs of a continuation
    read: _Read  # () -> ("loop", tokens per row)


@dataclasses.dataclass(frozen=True)
class _Read:
    """Reads a dispatched program's tokens back: () -> (kind, tokens per row). ``version``:
    the weights it was dispatched with, which sampled those tokens (`Engine.update_params`)."""

    fn: Callable[[], tuple[str, list]]
    version: int | str
    tokens: object = None  # the device arrays it reads (`ready` looks at them)

    def __call__(self) -> tuple[str, list]:
        return self.fn()

    def ready(self) -> bool:
        """True once the program has produced its tokens (reading them will not wait)."""
        return all(x.is_ready() for x in jax.tree.leaves(self.tokens))


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
    ``max_decode_steps``: decode steps one `decode_loop` may run on device between two host
    reads (1: every step goes back to the host; default 8 on CPU, 1 on GPU/TPU: compiled for
    TPU, the loop has XLA copy the stacked q/k/v projection weights into another layout, 192
    MiB at Llama-3.2-1B, and it has not run on a GPU yet; see docs/AOT.md). A loop
    runs only while no request waits,
    and stops early when every row is done. ``async_scheduling``: while decode loops run,
    dispatch the next loop (continuing from the device's own tokens) before reading the
    current one, so the host's reading, bookkeeping and reservation overlap device work; a
    request arriving meanwhile waits for at most the loop in flight.
    ``kv_cache_dtype``: "auto" (pages in the model's compute dtype), "int8" or "fp8_e4m3":
    quantized pages with a key and a value scale per token and kv head, quantized as the step
    writes them and dequantized inside attention; about half the bytes of bf16 pages.
    ``host_kv_cache_bytes``: a host-memory tier behind the prefix cache (`HostKVPool`): pages
    the device pool evicts are copied there instead of dropped, and a later prefix hit copies
    them back instead of recomputing them.

    `update_params` swaps the weights between two steps (RL rollouts), compiling nothing:
    requests in flight restart their KV under the new weights (or keep it, by choice), the
    prefix cache is keyed by weight version so nothing computed by other weights is reused,
    and every output token records the version that sampled it (``weight_versions``).
    """

    def __init__(self, model: Model, *, page_size: int = 16, num_pages: int,
                 max_num_seqs: int = 32, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 attention_impl: str = "auto", seed: int = 0, debug_nan_freed_pages: bool = False,
                 mesh=None, max_decode_steps: int | None = None, async_scheduling: bool = True,
                 kv_cache_dtype: str = "auto", host_kv_cache_bytes: int = 0):
        # What update_params checks new weights against: the model as given (unsharded).
        self._source_config, self._param_specs = model.config, weights.param_specs(model.params)
        if mesh is not None:  # tensor parallel: weights and KV pages split by head
            model = shard(model, mesh)
        else:  # committed, as update_params places new weights: the same programs run them
            model = dataclasses.replace(model, params=commit(model.params))
        cfg = model.config
        _positive_int("page_size", page_size)
        try:
            self.kv_dtype = storage_dtype(kv_cache_dtype, model.dtype)
            check_page_size(attention_impl, page_size, self.kv_dtype)
        except ValueError as e:
            raise ValueError(f"Engine: {e}") from None
        self.kv_cache_dtype = kv_cache_dtype
        _positive_int("num_pages", num_pages)
        g = pages_per_scale_row(page_size)
        if is_quantized(self.kv_dtype) and num_pages % g and kernel_for(attention_impl) == "gpu":
            _log.warning("num_pages=%d is not a multiple of %d (pages per row of scale words at "
                         "page_size %d): the GPU kernels will copy the scales on every call; "
                         "LLM sizes pools in whole rows", num_pages, g, page_size)
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        _positive_int("max_model_len", max_model_len)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"Engine: max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise ValueError(f"Engine: seed must be an int in [0, 2**64), got {seed!r}")
        self.model, self.page_size, self.num_pages = model, page_size, num_pages
        self.max_num_seqs, self.max_model_len, self.seed = max_num_seqs, max_model_len, seed
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.mesh = mesh
        if max_decode_steps is None:  # see the class docstring: TPU/GPU loops are not proven yet
            max_decode_steps = 8 if jax.default_backend() == "cpu" else 1
        _positive_int("max_decode_steps", max_decode_steps)
        self.steps = make_steps(model.graphdef, attention_impl, mesh, max_decode_steps)
        self.token_buckets = ladder(max(max_num_batched_tokens, max_num_seqs))
        self.row_buckets = tuple(sorted({min(4 ** i, max_num_seqs)
                                         for i in range(max_num_seqs.bit_length())}
                                        | {max_num_seqs}))
        self.copy_buckets = tuple(sorted({8, max(8, pow2(2 * max_num_seqs))}))
        self.page_table = PageTable(max_num_seqs, self.max_pages_per_seq, num_pages, page_size)
        self.debug_nan_freed_pages = debug_nan_freed_pages
        self.allocator = PageAllocator(num_pages, track_freed=debug_nan_freed_pages)
        self.state = self._new_state()
        self.host_pool = self._host_pool(host_kv_cache_bytes, enable_prefix_caching)
        if self.host_pool is not None:
            self.radix = HostTieredRadixCache(self.allocator, page_size,
                                              PageAllocator(self.host_pool.num_slots))
        else:
            self.radix = RadixCache(self.allocator, page_size) if enable_prefix_caching \
                else NullPrefixCache()
        self.scheduler = Scheduler(self.allocator, self.radix, page_size=page_size,
                                   max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   eos_token_ids=cfg.eos_token_ids)
        self._requests: dict[str, _Entry] = {}  # unfinished, by id
        self._pending: list[RequestOutput] = []  # aborted requests, reported by the next step
        self._num_added = self._prompt_tokens = self._steps = 0
        self.async_scheduling = bool(async_scheduling)
        self._inflight: _Loop | None = None  # a loop dispatched ahead, its tokens unread
        self.state_resets = 0  # KV states rebuilt after a failed step lost one

    def _host_pool(self, nbytes, enable_prefix_caching: bool) -> HostKVPool | None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"Engine: host_kv_cache_bytes must be an int >= 0, got {nbytes!r}")
        if nbytes == 0:
            return None
        if not enable_prefix_caching:
            raise ValueError("Engine: host_kv_cache_bytes needs enable_prefix_caching=True (the "
                             "host tier keeps prefix-cache entries)")
        page = sum(x.nbytes for x in jax.tree.leaves(self.state)) // self.num_pages
        if nbytes < page:
            raise ValueError(f"Engine: host_kv_cache_bytes={nbytes} holds no page of {page} "
                             "bytes")
        return HostKVPool(self.state, nbytes // page, self.copy_buckets)

    def _transfer(self) -> None:
        """Runs the host tier's queued copies (before anything reads or reuses those pages)."""
        if self.host_pool is not None:
            moves = self.radix.take_transfers()
            if moves:
                self.state = self.host_pool.run(self.state, moves)

    def _new_state(self):
        state = init_state(self.model.config, self.num_pages, self.page_size, self.model.dtype,
                           self.kv_cache_dtype)
        # Committed, like the params (`commit`): jit specializes on it, so a step's output
        # state (committed) runs in the same programs as the first one.
        return commit(state) if self.mesh is None else shard_state(state, self.mesh)

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
        tok = self.model.tokenizer
        samples = [Request(request_id, ids, sp, index, now, sample_index=j, cache_salt=cache_salt,
                           key=key, detok=None if tok is None else IncrementalDetokenizer(
                               tok, ids, skip_special_tokens=sp.skip_special_tokens,
                               stop=sp.stop,
                               include_stop_str_in_output=sp.include_stop_str_in_output))
                   for j, key in enumerate(self._sample_keys(sp, index))]
        if sp.bad_words:
            words = sp.bad_words_ids(tok, self.model.config.vocab_size)
            for s in samples:
                s.bad_words_ids = words
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
        # A prefill engine of a DisaggregatedEngine holds a request until its first token.
        if self.scheduler.hand_off_after_prefill:
            total = prompt_len + 1
            need = -(-prompt_len // self.page_size)
            if prompt_len >= self.max_model_len or need > self.num_pages:
                raise ValueError(f"request {request_id!r}: the prompt ({prompt_len} tokens, "
                                 f"{need} pages) does not fit the prefill engine "
                                 f"(max_model_len={self.max_model_len}, {self.num_pages} pages)")
        else:
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
        sp.check_vocab(self.model.config.vocab_size)
        if sp.n > self.max_num_seqs:
            raise ValueError(f"SamplingParams.n={sp.n} exceeds max_num_seqs={self.max_num_seqs}")
        for name, what in (("stop", "stop strings"), ("bad_words", "bad words")):
            if getattr(sp, name) and self.model.tokenizer is None:
                raise ValueError(f"SamplingParams.{name}={getattr(sp, name)!r}: {what} need a "
                                 "model with a tokenizer (stop_token_ids, logit_bias and "
                                 "allowed_token_ids take token ids)")
        check_bannable(sp, self.model.config.eos_token_ids)
        if sp.bad_words:
            sp.bad_words_ids(self.model.tokenizer, self.model.config.vocab_size)

    def _sample_keys(self, sp: SamplingParams, index: int) -> list[np.ndarray]:
        """Sample j's raw key: as `jaxkv.generate` with ``sp.seed``, else from the engine seed
        and the request's index, so outputs never depend on the batch a request lands in."""
        if sp.seed is not None:
            return [request_key(sp.seed, j) for j in range(sp.n)]
        base = request_key(self.seed, index)  # the whole 64-bit engine seed counts
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
        """Runs one step; returns the output of each request that got tokens or finished in
        it (cumulative, only the new part, or only the final one, by its
        SamplingParams.output_kind), and of requests aborted since the last step.

        If the device step (or sampling) raises, the requests in it fail with finish_reason
        "error" and the message in `RequestOutput.error`; every other request keeps going. If
        the failure consumed the KV state, it is rebuilt and the other running requests
        recompute their KV (as after a preemption).
        """
        return self.collect(self.dispatch())

    def dispatch(self):
        """The first half of `step`: plans and launches the device work without waiting for
        it (a `ReplicatedEngine` launches every replica's before collecting any). With a loop
        in flight, it dispatches that loop's continuation and hands over the loop in flight."""
        outputs, self._pending = self._pending, []
        if self._inflight is not None:
            current, self._inflight = self._inflight, None
            try:
                self._inflight = self._chain(current)
            except Exception as e:  # noqa: BLE001
                return outputs, current.plan, None, e
            return outputs, current.plan, current.read, None
        plan = self.scheduler.schedule()
        try:
            launched = self._launch(plan)
            if isinstance(launched, _Loop):
                self._inflight = self._chain(launched)
                launched = launched.read
        except Exception as e:  # noqa: BLE001 - any failure of the step fails its requests
            return outputs, plan, None, e
        return outputs, plan, launched, None

    def collect(self, dispatched) -> list[RequestOutput]:
        """The second half of `step`: reads the tokens back and updates the requests."""
        outputs, plan, launched, error = dispatched
        if error is None and launched is not None:
            try:
                sampled = launched()
            except Exception as e:  # noqa: BLE001
                error = e
        if error is None and self.host_pool is not None:
            try:  # saves of this step land while the next one runs
                self.host_pool.flush()
            except Exception as e:  # noqa: BLE001 - a save failed: its host entries are lost
                error = e
        if error is not None:
            self._inflight = None  # a continuation of the failed requests, if any
            return outputs + self._fail(plan, error)
        if launched is None:
            return outputs
        kind, tokens = sampled
        update = self.scheduler.update if kind == "step" else self.scheduler.update_loop
        progressed = update(plan, tokens, time.time())
        # The weights that sampled them: those the program was dispatched with (a loop read
        # after an update ran with the old ones); a caller's own reader (scripts/
        # profile_runtime.py replays one) read a program of the current weights.
        version = getattr(launched, "version", self.weight_version)
        for seq in progressed:
            seq.token_versions += [version] * (seq.num_output_tokens - len(seq.token_versions))
        for rid in dict.fromkeys(r.request_id for r in progressed):
            entry = self._requests[rid]
            out = self._output(rid, entry)
            if out is None:  # FINAL_ONLY, still running
                continue
            if out.finished:
                del self._requests[rid]
            outputs.append(out)
        if self._inflight is not None and all(
                r.request.is_done for r in self._inflight.plan.decode_rows):
            self._inflight = None  # every row it continues has finished: nothing to read
        return outputs

    def _launch(self, plan):
        """Dispatches the device part of a step (page poisoning and copies, then a ragged
        step or a decode loop); returns a function that reads its tokens back: for each
        row, a list of tokens per sample (None for a row still prefilling)."""
        self._transfer()  # first: saves read pages this plan freed, loads fill pages it reads
        if plan.copies:  # a copy's source may have been freed by this very plan
            self.state = copy_pages_padded(self.state, plan.copies, self.copy_buckets)
        if self.debug_nan_freed_pages:  # poison what is free now: a later read would show NaN
            freed = self.allocator.drain_freed()  # (a copy's destination is never free)
            if freed:
                self.state = fill_pages_padded(self.state, freed, float("nan"),
                                               self.copy_buckets[-1])
        if not plan.rows:
            return None
        n = self._loop_steps(plan)
        if n > 1:
            return self._launch_loop(plan, n)
        return self._launch_step(plan.rows)

    def _launch_step(self, rows: list[ScheduledRow]):
        batch = build_batch(rows, self.page_table,
                            tokens_bucket=fit(sum(len(r.tokens) for r in rows),
                                              self.token_buckets),
                            vocab_size=self.model.config.vocab_size)
        keys, arrays = self._sampling([(r.slot, r.samples[0]) for r in rows if r.samples])
        tokens, logits, hidden, self.state = self.steps.step(
            self.model.params, self.state, batch, keys, arrays)
        self._steps += 1
        drawn = [tokens]  # [sample][slot]: a forking row's samples 1..n-1 use the same logits
        for k in range(max((len(r.samples) for r in rows), default=0)):
            seqs = [(r.slot, r.samples[k]) for r in rows if len(r.samples) > k]
            if k:
                keys, arrays = self._sampling(seqs)
                drawn.append(sample(logits, keys, arrays))
            edits = [(i, q.token_ids, q.num_prompt_tokens, q.sampling_params, q.bad_words_ids)
                     for i, q in seqs if has_processors(q.sampling_params)]
            if edits:  # their rows draw again, from processed logits; the others keep theirs
                procs = build_processors(edits, self.max_num_seqs)
                drawn[k] = sample_processed(logits, keys, arrays, procs, drawn[k])
        want = [any(s.logprobs is not None for r in rows for s in r.samples[k:k + 1])
                for k in range(len(drawn))]
        lps = [token_logprobs(logits, d, MAX_LOGPROBS) if w else None
               for d, w in zip(drawn, want, strict=True)]
        prompt_lps = logprobs.dispatch_prompt_logprobs(
            self.steps, self.model.params, rows, batch.cu_q_lens, hidden)

        def read():
            got = [np.asarray(d) for d in drawn]
            for k, lp in enumerate(lps):
                if lp is not None:
                    logprobs.record_logprobs(rows, k, got[k], [np.asarray(x) for x in lp],
                                             self.model.tokenizer)
            if prompt_lps is not None:
                logprobs.record_prompt_logprobs(*prompt_lps, self.model.tokenizer)
            return "step", [[int(d[r.slot]) for d in got[:len(r.samples)]] if r.samples
                            else None for r in rows]
        return _Read(read, self.weight_version, drawn)

    def _sampling(self, seqs, rows: int | None = None):
        """Keys and SamplingArrays for (row, sequence) pairs; other rows are greedy."""
        b = self.max_num_seqs if rows is None else rows
        keys = np.zeros((b, 2), np.uint32)
        temperature, top_k = np.zeros(b, np.float32), np.zeros(b, np.int32)
        top_p, step = np.ones(b, np.float32), np.zeros(b, np.int32)
        banned = np.full((b, MAX_BANNED), -1, np.int32)
        eos = self.model.config.eos_token_ids
        for i, seq in seqs:
            sp = seq.sampling_params
            keys[i], step[i] = seq.key, seq.num_output_tokens
            temperature[i], top_k[i], top_p[i] = sp.temperature, sp.top_k, sp.top_p
            ids = sp.banned_ids(seq.num_output_tokens, eos)
            banned[i, :len(ids)] = ids
        return keys, SamplingArrays(temperature, top_k, top_p, step, banned)

    def _stop_ids(self, seq) -> tuple[int, ...]:
        return seq.sampling_params.stop_ids(self.model.config.eos_token_ids)

    def _loop_steps(self, plan) -> int:
        """How many decode steps to run on device for this plan (1: a plain step): only
        decodes, no request waiting, and every row's stop ids checkable on device."""
        if (self.steps.max_decode_steps == 1 or plan.prefill_rows or self.scheduler.waiting
                or self.scheduler.hand_off_after_prefill  # a prompt's last token: hand off
                or any(len(r.samples) != 1 or r.samples[0].logprobs is not None
                       or has_processors(r.samples[0].sampling_params)
                       for r in plan.decode_rows)):
            return 1  # (logprobs and processors work on the single step's logits)
        left = 0
        for r in plan.decode_rows:
            seq = r.samples[0]
            if len(self._stop_ids(seq)) > MAX_STOP_IDS:
                return 1
            left = max(left, seq.sampling_params.max_tokens - seq.num_output_tokens)
        return min(self.steps.max_decode_steps, left)

    def _launch_loop(self, plan, n: int):
        rows = plan.decode_rows
        width = fit(len(rows), self.row_buckets)
        reqs = [r.request for r in rows]
        starts = [r.start for r in rows]
        limits = self.scheduler.reserve(reqs, starts, [  # pages for up to n tokens per row
            min(n, q.sampling_params.max_tokens - q.num_output_tokens) for q in reqs])
        self._transfer()  # reserving may have moved cache entries to the host
        keys, arrays = self._sampling([(i, r.samples[0]) for i, r in enumerate(rows)], width)
        tokens = np.zeros(width, np.int32)
        positions = np.zeros(width, np.int32)
        live = np.zeros(width, bool)
        limit, generated = np.zeros(width, np.int32), np.zeros(width, np.int32)
        min_tokens, max_tokens = np.zeros(width, np.int32), np.ones(width, np.int32)
        stop_ids = np.full((width, MAX_STOP_IDS), -1, np.int32)
        table = np.zeros((width, self.max_pages_per_seq), np.int32)
        for i, r in enumerate(rows):
            seq = r.request
            sp = seq.sampling_params
            self.page_table.update(r.slot, seq.pages, r.start, r.owner)
            table[i] = self.page_table.table[r.slot]
            tokens[i], positions[i], live[i], limit[i] = r.tokens[0], r.start, True, limits[i]
            generated[i] = seq.num_output_tokens
            min_tokens[i], max_tokens[i] = sp.min_tokens, sp.max_tokens
            ids = self._stop_ids(seq)
            stop_ids[i, :len(ids)] = ids
        loop = DecodeLoopBatch(
            tokens=tokens, positions=positions, page_table=table, live=live, limit=limit,
            generated=generated, min_tokens=min_tokens, max_tokens=max_tokens,
            stop_ids=stop_ids, keys=keys, temperature=arrays.temperature, top_k=arrays.top_k,
            top_p=arrays.top_p, num_steps=np.int32(n))
        return self._run_loop(plan, loop, starts, limits, [q.num_output_tokens for q in reqs],
                              table)

    def _run_loop(self, plan, loop: DecodeLoopBatch, starts, limits, generated, table) -> _Loop:
        out, after, self.state = self.steps.decode_loop(self.model.params, self.state, loop)
        rows = len(plan.decode_rows)

        def read():
            got = np.asarray(out)
            self._steps += int((got >= 0).any(axis=1).sum())
            return "loop", [[int(t) for t in got[:, i] if t >= 0] for i in range(rows)]
        return _Loop(plan, starts, limits, generated, table, after,
                     _Read(read, self.weight_version, out))

    def _chain(self, current: _Loop) -> _Loop | None:
        """Dispatches the continuation of a loop whose tokens are not read yet, or returns
        None: when a request waits, or the loop no longer holds every running sequence.

        The continuation takes each row's pending token, position and liveness from the
        device; the host reserves pages past the furthest position the row can have reached.
        A row that stopped on device stays stopped; one that ends on the host meanwhile (an
        abort) ends the chain before its pages can be reused, and a stale write is ordered
        before any later program on the device."""
        reqs = [r.request for r in current.plan.decode_rows]
        if (not self.async_scheduling or self.scheduler.waiting
                or len(reqs) != len(self.scheduler.running)
                or any(q.status is not RequestStatus.RUNNING for q in reqs)):
            return None
        starts = [s + k for s, k in zip(current.starts, current.limits, strict=True)]
        generated = [g + k for g, k in zip(current.generated, current.limits, strict=True)]
        left = [q.sampling_params.max_tokens - g for q, g in zip(reqs, generated, strict=True)]
        n = min(self.steps.max_decode_steps, max(left))
        if n < 1:
            return None
        wants = [min(n, x) for x in left]
        limits = self.scheduler.reserve(reqs, starts, wants)
        self._transfer()
        if any(w > 0 and k == 0 for w, k in zip(wants, limits, strict=True)):
            return None  # a row without pages: `schedule` (which may preempt) takes over
        table = current.table.copy()  # rows hold the same slots as before
        limit = np.zeros(table.shape[0], np.int32)
        for i, (row, q) in enumerate(zip(current.plan.decode_rows, reqs, strict=True)):
            self.page_table.update(row.slot, q.pages, starts[i], row.owner)
            table[i] = self.page_table.table[row.slot]
            limit[i] = limits[i]
        loop = current.after.replace(page_table=table, limit=limit, num_steps=np.int32(n))
        return self._run_loop(current.plan, loop, starts, limits, generated, table)

    # ---- weights -------------------------------------------------------------------------

    @property
    def weight_version(self) -> int | str:
        """The version of the weights served (0 at construction; see `update_params`)."""
        return self.scheduler.weight_version

    def update_params(self, params, *, version: int | str | None = None,
                      in_flight: str = "restart") -> None:
        """Serves new weights from the next step on (an RL rollout pipeline's update), with
        nothing compiled: the programs take the params as an argument.

        ``params``: a `jaxkv.Model` or a params pytree with the tree, shapes and dtypes of the
        model this engine was built from (its ``Model.params``, unsharded, as a trainer holds
        them); with a mesh, each leaf is placed like the one it replaces (kv heads replicated
        as `jaxkv.shard` did). ``version`` (an int or a str; default the current one + 1)
        names them: every output token records the version that sampled it
        (`CompletionOutput.weight_versions`; a decode loop dispatched before the update
        sampled with the old weights), and prefix-cache entries are keyed by the version
        their KV was computed with, so no request reuses KV of other weights (in either
        tier; old entries age out by LRU). A version names one set of weights: passing an
        earlier version again with other weights would let stale entries hit.

        ``in_flight="restart"``: running requests keep the tokens already returned and
        recompute their KV (prompt + those tokens) with the new weights, as after a
        preemption (counted as one); a decode loop in flight is dropped, its unread tokens
        never reported. ``"keep"``: they keep their KV, computed by the old weights, and
        decode on with the new ones (stale KV, by choice). Waiting requests always compute
        with the new weights. Raises ValueError naming ``params`` (and the offending leaf
        path), ``version`` or ``in_flight``, changing nothing.
        """
        weights.check_in_flight(in_flight)
        version = weights.next_version(self.weight_version, version)
        params = weights.source_params(params, self._source_config, self._param_specs)
        placed = place_params(params, self.model.params, self._source_config)
        if in_flight == "restart":
            self._inflight = None  # sampled by the old weights: its tokens are never read
            self.scheduler.preempt_all()  # nothing cached: that KV is of the old weights
        self.model = dataclasses.replace(self.model, params=placed)
        self.scheduler.weight_version = version

    def programs(self) -> list[tuple[str, int]]:
        """Every program serving can run: ("step", T tokens), ("decode_loop", R rows),
        ("copy_pages", N), ("sample", B), ("logprobs", B), and ("fill_pages", N) with
        debug_nan_freed_pages. Not listed: the small programs that requests with
        ``prompt_logprobs`` (one per token bucket) or logits processors (one per entry
        bucket) compile on first use."""
        return compile_ahead.engine_programs(self)

    def warmup(self) -> int:
        """Compiles every program serving can run (`programs`), so no request waits on a
        compile; returns how many (see `jaxkv.engine.warmup`)."""
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
        # Only requests still in flight: a continuation loop's plan may name requests that
        # finished or were aborted (and whose id may since be reused) while it ran.
        live = {row.request.request_id: row.request for row in plan.rows
                if not row.request.is_done}
        for rid, req in live.items():
            entry = self._requests.get(rid)
            if entry is None or not any(s is req for s in entry.samples):
                continue
            del self._requests[rid]
            entry.error = message
            for s in entry.samples:  # its KV may be half-written: cache none of it
                if not s.is_done:
                    self.scheduler.finish(s, "error", now, cache=False)
            outputs.append(self._output(rid, entry))
        if self._state_lost():
            self.scheduler.preempt_all()  # their KV is gone: recompute from their tokens
            self.radix.clear()
            if self.debug_nan_freed_pages:
                self.allocator.drain_freed()  # the new state starts zeroed
            self.state = self._new_state()
            self.state_resets += 1  # (a DisaggregatedEngine's hand-offs lost their KV too)
        if self.host_pool is not None:  # a failed step may have skipped or lost a host copy
            self.radix.drop_host_tier()
            self.radix.take_transfers()
            self.host_pool.discard()
        return outputs

    def _output(self, request_id: str, entry: _Entry) -> RequestOutput | None:
        """The request's output after a step (None when its output_kind is FINAL_ONLY and it
        is still running); DELTA outputs hold only what is new since the last one."""
        sp = entry.samples[0].sampling_params
        finished = all(s.is_done for s in entry.samples)
        if sp.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outs = []
        for s in entry.samples:
            tokens, text = s.output_token_ids, s.text(s.is_done)
            versions = list(s.token_versions)
            if sp.output_kind is RequestOutputKind.DELTA:
                (n, c), s.emitted = s.emitted, (len(tokens), len(text))
                tokens, text, versions = tokens[n:], text[c:], versions[n:]
            lps = cum = None
            if s.logprobs is not None:
                every = s.logprobs[:s.num_output_tokens]
                cum = sum(e[t].logprob for e, t in zip(every, s.output_token_ids, strict=False))
                lps = every[len(every) - len(tokens):] if tokens else []
            outs.append(CompletionOutput(index=s.sample_index, token_ids=tokens,
                                         finish_reason=s.finish_reason, text=text,
                                         stop_reason=s.stop_reason, logprobs=lps,
                                         cumulative_logprob=cum, weight_versions=versions))
        first = entry.samples[0]
        prompt_lps = first.prompt_logprobs
        if prompt_lps is not None and (first.needs_prompt_logits or (
                sp.output_kind is RequestOutputKind.DELTA and first.prompt_logprobs_sent)):
            prompt_lps = None
        elif prompt_lps is not None:
            first.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=request_id, prompt=entry.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=outs, finished=finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=request_metrics(entry.samples), error=entry.error,
            prompt_logprobs=prompt_lps)

    # ---- accounting ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        used, cached = self.scheduler.page_usage()
        c = self.scheduler.counters
        return EngineStats(
            prompt_tokens=self._prompt_tokens, cached_prompt_tokens=c.cached_prompt_tokens,
            computed_prompt_tokens=c.computed_prompt_tokens,
            generated_tokens=c.generated_tokens, preemptions=c.preemptions,
            kv_pages_total=self.num_pages, kv_pages_used=used, kv_pages_cached=cached,
            kv_pages_free=self.allocator.num_free, steps=self._steps,
            **self._host_stats())

    def _host_stats(self) -> dict:
        r = self.radix.stats()
        out = dict(device_hit_tokens=r["hit_tokens"] - r["host_hit_tokens"])
        if self.host_pool is not None:
            out.update(host_hit_tokens=r["host_hit_tokens"],
                       host_kv_pages=self.radix.host.num_used,
                       host_kv_bytes=self.radix.host.num_used * self.host_pool.page_bytes,
                       host_kv_pages_total=self.host_pool.num_slots)
        return out

    def check(self) -> None:
        """Asserts the host invariants: every page's refcount equals its holders (running
        sequences and prefix-cache references), and the radix tree's own invariants."""
        self.allocator.check(holders=self.scheduler.holders())
        self.radix.check()
