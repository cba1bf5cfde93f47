"""ModelRunner: the device half of an `Engine`: weights, KV state, page table and programs.

The engine core decides what runs (its scheduler plans each step); the runner turns a plan
into device work and hands back a `TokenRead`: page copies (prefix reuse, copy-on-write, the
host tier's saves and loads), then one of two programs (`jaxkv.runtime.steps`):

- a ragged ``step`` when any row has a prefill chunk: every scheduled row in one flattened
  batch, each row's next token sampled on device (forks and logits processors sample again
  from the same logits);
- a ``decode_loop`` when only decodes run: up to ``max_decode_steps`` decode steps on device
  with sampling and stop checks there, the tokens read back once. `continue_loop` dispatches
  the next loop from the device's own outputs before the current one is read.

Shapes: the step is one program per token bucket (powers of two from 16 to
max_num_batched_tokens) with rows = slots (max_num_seqs) and the page table at its full width;
the decode loop one per row bucket. Width costs nothing: the kernels and the jnp reference stop
at each row's length. `programs` lists every program; `warmup` compiles them.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jaxkv.attention import check_head_dim, check_page_size, kernel_for
from jaxkv.cache.window import WindowSlots
from jaxkv.config import EngineConfig, cdiv
from jaxkv.engine import logprobs, spec_runner
from jaxkv.engine import warmup as compile_ahead
from jaxkv.engine.host_tier import HostKVPool
from jaxkv.engine.plan import ScheduledRow, SchedulerOutput
from jaxkv.engine.reads import LoopRun, TokenRead
from jaxkv.kv import init_state
from jaxkv.model.pretrained import Model
from jaxkv.runtime.batch import PageTable, WindowTable, build_batch, fit, ladder, pow2
from jaxkv.runtime.page_copy import copy_pages_padded, fill_pages_padded
from jaxkv.runtime.processors import build_processors, has_processors, sample_processed
from jaxkv.runtime.sampling import (
    MAX_BANNED,
    RowSettings,
    SamplingArrays,
    sample,
    token_logprobs,
)
from jaxkv.runtime.steps import (
    DecodeLoopBatch,
    LoopRow,
    decode_loop_batch,
    default_decode_steps,
    make_steps,
)
from jaxkv.sampling_params import MAX_LOGPROBS
from jaxkv.sharding import commit, shard, shard_state
from jaxkv.spec import proposer_for
from jaxkv.structured.grammar import grammars_for
from pallas_kernels.quant import is_quantized, pages_per_scale_row, storage_dtype

_log = logging.getLogger(__name__)


class ModelRunner:
    """Holds the device side of one engine and launches its programs.

    ``mesh`` (`jaxkv.sharding.make_mesh`): tensor parallelism, the model and KV pages split
    by head over its devices. The runner never allocates pages: every launch receives the
    pages and positions its rows own (the host is the source of truth for which pages a slot
    owns; the device for what is in them)."""

    def __init__(self, model: Model, config: EngineConfig, *, num_pages: int,
                 max_model_len: int, mesh=None, window: WindowSlots | None = None):
        cache, sched = config.cache, config.scheduler
        if mesh is not None:  # tensor parallel: weights and KV pages split by head
            model = shard(model, mesh,
                          expert_parallel=config.parallel.enable_expert_parallel)
        else:  # committed, as update_params places new weights: the same programs run them
            model = dataclasses.replace(model, params=commit(model.params))
        impl, page_size = config.runtime.attention_impl, cache.page_size
        try:
            self.kv_dtype = storage_dtype(cache.kv_cache_dtype, model.dtype)
            check_page_size(impl, page_size, self.kv_dtype)
            check_head_dim(impl, model.config.head_dim)
        except ValueError as e:
            raise ValueError(f"Engine: {e}") from None
        g = pages_per_scale_row(page_size)
        if is_quantized(self.kv_dtype) and num_pages % g and kernel_for(impl) == "gpu":
            _log.warning("num_pages=%d is not a multiple of %d (pages per row of scale words at "
                         "page_size %d): the GPU kernels will copy the scales on every call; "
                         "LLM sizes pools in whole rows", num_pages, g, page_size)
        self.model, self.mesh, self.config = model, mesh, config
        self.page_size, self.num_pages = page_size, num_pages
        self.kv_cache_dtype = cache.kv_cache_dtype
        self.max_num_seqs = max_num_seqs = sched.max_num_seqs
        self.max_pages_per_seq = cdiv(max_model_len, page_size)
        steps = sched.max_decode_steps
        if steps is None:
            steps = default_decode_steps()
        spec = sched.speculative_config
        self.proposer = proposer_for(spec)  # speculative decoding's method (None: off)
        self.spec_k = 0 if spec is None else spec.k
        self.steps = make_steps(model.graphdef, impl, mesh, steps, None if spec is None else
                                self.proposer.draft_program(model.config))
        self.token_buckets = ladder(max(sched.max_num_batched_tokens, max_num_seqs))
        self.row_buckets = tuple(sorted({min(4 ** i, max_num_seqs)
                                         for i in range(max_num_seqs.bit_length())}
                                        | {max_num_seqs}))
        self.copy_buckets = tuple(sorted({8, max(8, pow2(2 * max_num_seqs))}))
        self.page_table = PageTable(max_num_seqs, self.max_pages_per_seq, num_pages, page_size)
        # Window-only KV: the local layers' slots (the scheduler's books) and their table.
        self.window = window
        self.window_table = None if window is None else \
            WindowTable(max_num_seqs, self.max_pages_per_seq, window)
        self.debug_nan_freed_pages = cache.debug_nan_freed_pages
        # programs compiling in the background (background_warmup), not run until ready
        self.warming: compile_ahead.BackgroundWarmup | None = None
        self._state = self.new_state()  # the KV state: assigned in this class only
        self.host_pool = self._host_pool(cache.host_kv_cache_bytes)
        self.num_steps = 0  # device steps run (a loop's count as many as it ran)
        self.grammars = grammars_for(model.tokenizer, model.config.vocab_size,
                                     model.config.eos_token_ids)  # structured outputs
        # a drafter with weights and a KV pool of its own (draft_model), or None
        self.draft_model = None if spec is None else self.proposer.drafter(self, max_model_len)

    @property
    def drafts_on_device(self) -> bool:
        """Whether speculation's drafts come from the device (``self``, ``draft_model``)."""
        return self.steps.draft is not None or self.draft_model is not None

    def _host_pool(self, nbytes: int) -> HostKVPool | None:
        if nbytes == 0:
            return None
        page = sum(x.nbytes for x in jax.tree.leaves(self.state)) // self.num_pages
        if nbytes < page:
            raise ValueError(f"Engine: host_kv_cache_bytes={nbytes} holds no page of {page} "
                             "bytes")
        return HostKVPool(self.state, nbytes // page, self.copy_buckets)

    # ---- state and copies ----------------------------------------------------------------

    def new_state(self):
        """A zeroed KV state for this engine's pool."""
        state = init_state(self.model.config, self.num_pages, self.page_size, self.model.dtype,
                           self.kv_cache_dtype,
                           None if self.window is None else self.window.num_slots)
        # Committed, like the params (`commit`): jit specializes on it, so a step's output
        # state (committed) runs in the same programs as the first one.
        return commit(state) if self.mesh is None else shard_state(state, self.mesh)

    @property
    def state(self):
        """The KV state (read-only: programs that change it run through `run` or
        `update_state`, which keep what they return)."""
        return self._state

    def run(self, program, *args, params=None):
        """Runs ``program(params, state, *args)``, a program that donates the KV state and
        returns ``(*outputs, state)``; keeps the new state and returns the outputs (one, or a
        tuple). ``params``: the model's unless given."""
        *out, self._state = program(self.model.params if params is None else params,
                                    self._state, *args)
        return out[0] if len(out) == 1 else tuple(out)

    def update_state(self, fn, *args) -> None:
        """Replaces the KV state by ``fn(state, *args)`` (the state is donated): page copies,
        the host tier's moves, pages written in from another engine."""
        self._state = fn(self._state, *args)

    def reset_state(self) -> None:
        """A zeroed KV state (after a failure lost the old one), and the draft's pool with it."""
        self._state = self.new_state()
        if self.draft_model is not None:
            self.draft_model.reset(self)

    def state_lost(self) -> bool:
        """True if the KV state is unusable: donated to a step that failed before returning
        (deleted buffers), or the output of a step that failed on the device after returning
        (an async error that surfaces when the arrays are read)."""
        states = (self.state, None if self.draft_model is None else self.draft_model.state)
        try:
            if any(x.is_deleted() for x in jax.tree.leaves(states)):
                return True
            jax.block_until_ready(states)
            return False
        except Exception:  # noqa: BLE001 - whatever the device reports, the state is gone
            return True

    def run_host_copies(self, moves) -> None:
        """Runs the host tier's queued copies (before anything reads or reuses those pages)."""
        if self.host_pool is not None and moves:
            self.update_state(self.host_pool.run, moves)

    def copy_pages(self, copies, window_copies=()) -> None:
        """Device page copies (src, dst): prefix reuse of a partly matched page, copy-on-write;
        ``window_copies``: the same copies' local-layer slots (window-only KV)."""
        if copies:
            self.update_state(copy_pages_padded, copies, self.copy_buckets, window_copies)

    def poison_pages(self, pages) -> None:
        """Fills ``pages`` with NaN (debug_nan_freed_pages: a later read of them would show)."""
        if pages:
            self.update_state(fill_pages_padded, pages, float("nan"), self.copy_buckets[-1])

    def set_params(self, placed) -> None:
        """Serves ``placed`` (already placed like the current params) from the next launch;
        a draft that is the target's quantized copy follows."""
        self.model = dataclasses.replace(self.model, params=placed)
        if self.draft_model is not None:
            self.draft_model.follow(self.model)

    # ---- programs ------------------------------------------------------------------------

    def stop_ids(self, seq) -> tuple[int, ...]:
        return seq.sampling_params.stop_ids(self.model.config.eos_token_ids)

    def sampling(self, seqs, rows: int | None = None) -> tuple[np.ndarray, SamplingArrays]:
        """Keys and SamplingArrays for (row, sequence) pairs; other rows are greedy."""
        b = self.max_num_seqs if rows is None else rows
        keys, step = np.zeros((b, 2), np.uint32), np.zeros(b, np.int32)
        banned = np.full((b, MAX_BANNED), -1, np.int32)
        eos = self.model.config.eos_token_ids
        for i, seq in seqs:
            keys[i], step[i] = seq.key, seq.num_output_tokens
            ids = seq.sampling_params.banned_ids(seq.num_output_tokens, eos)
            banned[i, :len(ids)] = ids
        settings = RowSettings.of(b, [(i, seq.sampling_params) for i, seq in seqs])
        return keys, SamplingArrays(settings, step, banned)

    def launch_step(self, rows: list[ScheduledRow], version) -> TokenRead:
        """Dispatches one ragged step over ``rows``; the read gives, for each row, a list of
        tokens per sample (None for a row still prefilling; a speculating row's emitted
        tokens, `jaxkv.engine.spec_runner`)."""
        if self.spec_k and spec_runner.decodes_only(rows):
            return spec_runner.launch_spec_step(self, rows, version)
        batch = build_batch(rows, self.page_table,
                            tokens_bucket=fit(sum(len(r.tokens) for r in rows),
                                              self.token_buckets),
                            vocab_size=self.model.config.vocab_size, window=self.window_table)
        spec, drafts = [r for r in rows if r.num_draft], None
        if self.drafts_on_device:  # drafts from the device
            batch, drafts = spec_runner.draft_on_device(self, spec, batch) if spec else \
                (spec_runner.committed_tokens(self, batch), None)
        keys, arrays = self.sampling([(r.slot, r.samples[0]) for r in rows if r.samples])
        params = self.model.params
        tokens, logits, hidden = self.run(self.steps.step, batch, keys, arrays, params=params)
        self.num_steps += 1
        verified = spec_runner.dispatch_verify(self, spec, batch, hidden, drafts) \
            if spec else None
        verifying = {r.slot for r in spec}
        drawn = [tokens]  # [sample][slot]: a forking row's samples 1..n-1 use the same logits
        for k in range(max((len(r.samples) for r in rows), default=0)):
            seqs = [(r.slot, r.samples[k]) for r in rows if len(r.samples) > k]
            if k:
                keys, arrays = self.sampling(seqs)
                drawn.append(sample(logits, keys, arrays))
            edits = [(i, q.token_ids, q.num_prompt_tokens, q.sampling_params, q.bad_words_ids,
                      q.grammar) for i, q in seqs if has_processors(q.sampling_params)
                     and i not in verifying]  # (a speculating row's verification masks it)
            if edits:  # their rows draw again, from processed logits; the others keep theirs
                # (built while the device runs the step: a grammar's mask on host threads)
                procs = build_processors(edits, self.max_num_seqs, self.grammars)
                drawn[k] = sample_processed(logits, keys, arrays, procs, drawn[k])
        want = [any(s.logprobs is not None for r in rows for s in r.samples[k:k + 1])
                for k in range(len(drawn))]
        lps = [token_logprobs(logits, d, MAX_LOGPROBS) if w else None
               for d, w in zip(drawn, want, strict=True)]
        prompt_lps = logprobs.dispatch_prompt_logprobs(self.steps, params, rows,
                                                       batch.cu_q_lens, hidden)
        tokenizer = self.model.tokenizer

        def read():
            got = [np.asarray(d) for d in drawn]
            for k, lp in enumerate(lps):
                if lp is not None:
                    logprobs.record_logprobs(rows, k, got[k], [np.asarray(x) for x in lp],
                                             tokenizer)
            if prompt_lps is not None:
                logprobs.record_prompt_logprobs(*prompt_lps, tokenizer)
            emitted = {} if verified is None else verified.read(tokenizer)
            return "step", [emitted[r.slot] if r.num_draft else
                            [int(d[r.slot]) for d in got[:len(r.samples)]] if r.samples
                            else None for r in rows]
        return TokenRead(read, version, drawn if verified is None else
                         (drawn, verified.tokens))

    def launch_loop(self, plan: SchedulerOutput, limits: list[int], n: int, version) -> LoopRun:
        """Dispatches up to ``n`` decode steps of the plan's decode rows on device; row i may
        sample ``limits[i]`` tokens (its pages are reserved for them)."""
        rows = plan.decode_rows
        table = np.zeros((fit(len(rows), self.row_buckets), self.max_pages_per_seq), np.int32)
        window = self.window_rows(table.shape[0])
        live = []
        for i, r in enumerate(rows):
            seq = r.request
            self._update_tables(r.slot, seq.pages, r.start, r.owner, table, window, i)
            live.append(LoopRow(i, r.tokens[0], r.start, limits[i], seq.num_output_tokens,
                                seq.sampling_params, seq.key))
        loop = decode_loop_batch(live, table, self.model.config.eos_token_ids, n, window)
        return self._run_loop(plan, loop, [r.start for r in rows], limits,
                              [r.request.num_output_tokens for r in rows], table, version)

    def continue_loop(self, current: LoopRun, starts: list[int], limits: list[int],
                      generated: list[int], n: int, version) -> LoopRun:
        """Dispatches the continuation of ``current`` (whose tokens are not read yet): each
        row's pending token, position and liveness come from the device; the caller reserved
        pages for ``limits`` more tokens past ``starts``. A row that stopped on device stays
        stopped."""
        table = current.table.copy()  # rows hold the same slots as before
        window = self.window_rows(table.shape[0])
        limit = np.zeros(table.shape[0], np.int32)
        for i, row in enumerate(current.plan.decode_rows):
            self._update_tables(row.slot, row.request.pages, starts[i], row.owner, table,
                                window, i)
            limit[i] = limits[i]
        loop = current.after.replace(page_table=table, limit=limit, num_steps=np.int32(n),
                                     window_page_table=window)
        return self._run_loop(current.plan, loop, starts, limits, generated, table, version)

    def window_rows(self, rows: int) -> np.ndarray | None:
        """A decode loop's window table of ``rows`` idle rows (None without window-only KV)."""
        if self.window is None:
            return None
        return np.full((rows, self.max_pages_per_seq), self.window.null, np.int32)

    def _update_tables(self, slot, pages, start, owner, table, window, i) -> None:
        """Brings slot ``slot``'s page table (and window table) up to date and copies them
        into row ``i`` of a decode loop's tables."""
        self.page_table.update(slot, pages, start, owner)
        table[i] = self.page_table.table[slot]
        if window is not None:
            self.window_table.update(slot, pages, start, owner)
            window[i] = self.window_table.table[slot]

    def _run_loop(self, plan, loop: DecodeLoopBatch, starts, limits, generated, table,
                  version) -> LoopRun:
        out, after = self.run(self.steps.decode_loop, loop)
        rows = len(plan.decode_rows)

        def read():
            got = np.asarray(out)
            self.num_steps += int((got >= 0).any(axis=1).sum())
            return "loop", [[int(t) for t in got[:, i] if t >= 0] for i in range(rows)]
        return LoopRun(plan, starts, limits, generated, table, after,
                       TokenRead(read, version, out))

    def programs(self) -> list[tuple[str, int]]:
        """Every program serving can run (see `jaxkv.engine.warmup.engine_programs`)."""
        return compile_ahead.engine_programs(self)

    def warmup(self) -> int:
        """Compiles every program of `programs` (with ``background_warmup``, those every
        request needs, the rest in the background); returns how many there are."""
        return compile_ahead.warmup(self)

    @property
    def pending(self) -> frozenset:
        """Programs still compiling in the background (kind, size): not run until ready."""
        return frozenset() if self.warming is None else frozenset(self.warming.pending)

    def ready_tokens(self) -> int:
        """The most tokens a step may take now: the largest token bucket whose step (and every
        smaller one's) is ready."""
        pending, ready = self.pending, self.token_buckets[0]
        for t in self.token_buckets:
            if ("step", t) in pending:
                break
            ready = t
        return ready
