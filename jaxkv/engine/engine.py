"""Engine: the engine core. Continuous batching over the paged KV cache, with prefix caching
and n-way samples.

The core owns the request table, admission (`jaxkv.engine.intake`) and the loop of one step:

    plan = scheduler.schedule()            host: rows, pages, copies (may evict or preempt)
    read = launch.launch(engine, plan)     device: copies, then a ragged step or a decode loop
    tokens = read(); scheduler.update(...) host: tokens appended, finished requests freed
    outputs.build_output(...)              text, logprobs, the output kind's view

`step` is `collect(dispatch())`; the halves are public so a front over several engines
(`ReplicatedEngine`, `DisaggregatedEngine`) dispatches every engine's device work before
reading any back. While only decodes run and nothing waits, `dispatch` chains decode loops:
the next one starts from the device's own tokens before the current one is read (async
scheduling; `jaxkv.engine.launch`): the host's reading and bookkeeping overlap device work.

The device side (weights, KV state, programs, page copies) is the `ModelRunner`
(`jaxkv.engine.runner`); settings come from `jaxkv.config.EngineConfig`.
"""

from __future__ import annotations

import logging
import time

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.host_radix import HostTieredRadixCache
from jaxkv.cache.prefix import NullPrefixCache
from jaxkv.cache.radix import RadixCache
from jaxkv.cache.window import WindowSlots
from jaxkv.config import EngineConfig, field_sections, unknown_setting
from jaxkv.engine import intake, launch, recovery, weights
from jaxkv.engine.client import Dispatched
from jaxkv.engine.connector import SchedulerConnector
from jaxkv.engine.host_tier import tier_stats
from jaxkv.engine.outputs import RequestEntry, build_output
from jaxkv.engine.pool_plan import window_slots, window_stats
from jaxkv.engine.request import EngineStats, RequestOutput
from jaxkv.engine.runner import LoopRun, ModelRunner
from jaxkv.engine.scheduler import Scheduler
from jaxkv.model.pretrained import Model
from jaxkv.sampling_params import SamplingParams
from jaxkv.sharding import place_params
from jaxkv.spec.speculator import Speculator, spec_stats

_log = logging.getLogger(__name__)

# The settings an Engine reads (the rest size pools and place engines: `LLM`'s).
# Settings only `jaxkv.LLM` acts on: it sizes the pool from memory and loads the model.
LLM_ONLY = frozenset({"kv_cache_memory_bytes", "kv_cache_memory_fraction", "dtype"})
ENGINE_SETTINGS = frozenset(k for k, s in field_sections().items()
                            if s in ("cache", "scheduler", "runtime")) - LLM_ONLY


class Engine:
    """Serves requests step by step: `add_request`, `step` (streaming outputs), `abort`.

    Settings: an `EngineConfig` and/or its flat keywords (``num_pages=64, page_size=16``;
    each documented in `jaxkv.config`). ``num_pages`` is required: pages of ``page_size``
    tokens hold every sequence's KV and the prefix cache. ``mesh``
    (`jaxkv.sharding.make_mesh`): tensor parallelism, the model and KV pages split by head
    over its devices; the host side is the same, one page table for all shards.

    A decode loop (``max_decode_steps`` > 1) runs only while no request waits, and stops
    early when every row is done; on TPU, XLA copies the stacked q/k/v projection weights
    into another layout for it (192 MiB at Llama-3.2-1B), and it has not run on a GPU yet
    (docs/AOT.md), hence the default of 1 there. With ``async_scheduling`` a request arriving
    while loops run waits for at most the loop in flight.

    `update_params` swaps the weights between two steps (RL rollouts), compiling nothing:
    requests in flight restart their KV under the new weights (or keep it, by choice), the
    prefix cache is keyed by weight version so nothing computed by other weights is reused,
    and every output token records the version that sampled it (``weight_versions``).
    """

    def __init__(self, model: Model, config: EngineConfig | None = None, *, mesh=None,
                 **settings):
        bad = [k for k in settings if k not in ENGINE_SETTINGS]
        if bad and bad[0] in LLM_ONLY:
            raise ValueError(f"Engine: unknown setting {bad[0]!r}: it is a jaxkv.LLM setting "
                             "(an Engine takes num_pages and a loaded model)")
        if bad:
            raise ValueError(f"Engine: {unknown_setting(bad[0], ENGINE_SETTINGS)}")
        cfg = EngineConfig.from_kwargs(config, **settings)
        cache, sched = cfg.cache, cfg.scheduler
        if cache.num_pages is None:
            raise ValueError("Engine: num_pages is required (jaxkv.LLM sizes it from memory)")
        limit = model.config.max_position_embeddings
        max_model_len = limit if sched.max_model_len is None else sched.max_model_len
        if max_model_len > limit:
            raise ValueError(f"Engine: max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        # update_params checks new weights against the model as given (unsharded):
        self._source_config, self._param_specs = model.config, weights.param_specs(model.params)
        self.config, self.mesh = cfg, mesh
        slots = window_slots(model, cfg, cache.num_pages, max_model_len)
        # Window-only KV: the local layers' slots (None: every layer keeps every page).
        self.window = None if slots is None else \
            WindowSlots(slots, model.config.sliding_window, cache.page_size)
        self.runner = ModelRunner(model, cfg, num_pages=cache.num_pages,
                                  max_model_len=max_model_len, mesh=mesh, window=self.window)
        self.page_size, self.num_pages = cache.page_size, cache.num_pages
        self.kv_cache_dtype, self.max_model_len = cache.kv_cache_dtype, max_model_len
        self.max_num_seqs, self.seed = sched.max_num_seqs, cfg.runtime.seed
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_pages_per_seq = self.runner.max_pages_per_seq
        self.async_scheduling = sched.async_scheduling
        self.allocator = PageAllocator(cache.num_pages, track_freed=cache.debug_nan_freed_pages)
        host = self.runner.host_pool
        if host is not None:
            self.radix = HostTieredRadixCache(self.allocator, cache.page_size,
                                              PageAllocator(host.num_slots))
        elif cache.enable_prefix_caching:
            self.radix = RadixCache(self.allocator, cache.page_size)
        else:
            self.radix = NullPrefixCache()
        self.scheduler = Scheduler(self.allocator, self.radix, page_size=cache.page_size,
                                   max_num_seqs=sched.max_num_seqs,
                                   max_num_batched_tokens=sched.max_num_batched_tokens,
                                   eos_token_ids=model.config.eos_token_ids,
                                   window=self.window,
                                   speculator=Speculator(self.runner.proposer))
        self._requests: dict[str, RequestEntry] = {}  # unfinished, by id
        self._pending: list[RequestOutput] = []  # ended off-step (aborts): the next step's
        self._num_added = self._prompt_tokens = 0
        self._inflight: LoopRun | None = None  # a loop dispatched ahead, its tokens unread
        self.state_resets = 0  # KV states rebuilt after a failed step lost one
        self._served_versions = {self.scheduler.weight_version}

    # The device side, for callers that drive programs themselves (tests, benchmarks).
    model = property(lambda self: self.runner.model)
    steps = property(lambda self: self.runner.steps,
                     lambda self, steps: setattr(self.runner, "steps", steps))
    state = property(lambda self: self.runner.state)  # read-only: `write_kv` replaces it

    # ---- requests ------------------------------------------------------------------------

    @property
    def limits(self) -> intake.RequestLimits:
        """What one request may use of this engine (a prefill engine holds only prompts)."""
        return intake.RequestLimits(self.max_model_len, self.num_pages, self.page_size,
                                    self.max_num_seqs, self.scheduler.connector.hands_off)

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
        ids = self.prompt_ids(prompt, prompt_token_ids)
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be None or a string, got {cache_salt!r}")
        self.check_fits(request_id, len(ids), sp)
        samples = intake.new_samples(request_id, ids, sp, index=self._num_added,
                                     now=time.time(), cache_salt=cache_salt, model=self.model,
                                     engine_seed=self.seed, grammars=self.runner.grammars)
        self._requests[request_id] = RequestEntry(prompt, samples)
        self._num_added += 1
        self._prompt_tokens += len(ids)
        self.scheduler.add(samples[0])

    def prompt_ids(self, prompt, prompt_token_ids) -> list[int]:
        """A prompt's token ids, checked against this engine's model (ValueError naming the
        field)."""
        return intake.prompt_ids(self.model, prompt, prompt_token_ids)

    def check_fits(self, request_id: str, prompt_len: int, sp: SamplingParams) -> None:
        """Raises ValueError when such a request cannot run on this engine even alone."""
        intake.check_fits(request_id, prompt_len, sp, self.model, self.limits)

    def abort(self, request_id: str) -> None:
        """Ends an unfinished request now, freeing its pages; the next `step` reports it.

        Raises ValueError if no unfinished request has this id (never added, finished, or
        already aborted)."""
        entry = self._requests.pop(request_id, None) if isinstance(request_id, str) else None
        if entry is None:
            raise ValueError(f"abort: no unfinished request with request_id {request_id!r}")
        self.finish_entry(entry, "abort")
        self._pending.append(build_output(request_id, entry))

    def finish_entry(self, entry: RequestEntry, reason: str, *, cache: bool = True) -> None:
        """Ends every unfinished sample of ``entry`` (freeing what it holds here)."""
        now = time.time()
        for s in entry.samples:  # the parent first: it holds its unborn samples' slots
            if not s.is_done:
                self.scheduler.finish(s, reason, now, cache=cache)

    def has_request(self, request_id: str) -> bool:
        """True while ``request_id`` is an unfinished request of this engine."""
        return request_id in self._requests

    def get_request(self, request_id: str) -> RequestEntry | None:
        """The unfinished request ``request_id`` (its prompt and sample streams), or None."""
        return self._requests.get(request_id)

    def take_request(self, request_id: str) -> RequestEntry:
        """Removes an unfinished request from the table (it moves to another engine, which
        `adopt_request`s it); its samples and pages are the caller's to move."""
        return self._requests.pop(request_id)

    def adopt_request(self, request_id: str, entry: RequestEntry) -> None:
        """Takes over a request another engine started (its samples are placed on this
        engine's scheduler by the caller)."""
        self._requests[request_id] = entry

    def post_output(self, request_id: str, entry: RequestEntry) -> None:
        """Queues the output of a request ended outside a step; the next `step` returns it."""
        self._pending.append(build_output(request_id, entry))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """True when `step` has something to do or report."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    def num_unfinished(self) -> int:
        """Unfinished requests (each counted once, whatever its n): a replica's load."""
        return len(self._requests)

    num_running = lambda self: len(self.scheduler.running)  # noqa: E731
    num_waiting = lambda self: len(self.scheduler.waiting)  # noqa: E731

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

    def dispatch(self) -> Dispatched:
        """The first half of `step`: plans and launches the device work without waiting for
        it. With a loop in flight, it dispatches that loop's continuation and hands over the
        loop in flight."""
        outputs, self._pending = self._pending, []
        if self._inflight is not None:
            current, self._inflight = self._inflight, None
            try:
                self._inflight = launch.chain(self, current)
            except Exception as e:  # noqa: BLE001
                return Dispatched(outputs, current.plan, error=e)
            return Dispatched(outputs, current.plan, current.read)
        plan = self.scheduler.schedule(self.runner.ready_tokens())
        try:
            launched = launch.launch(self, plan)
            if isinstance(launched, LoopRun):
                self._inflight = launch.chain(self, launched)
                launched = launched.read
        except Exception as e:  # noqa: BLE001 - any failure of the step fails its requests
            return Dispatched(outputs, plan, error=e)
        return Dispatched(outputs, plan, launched)

    def collect(self, dispatched: Dispatched) -> list[RequestOutput]:
        """The second half of `step`: reads the tokens back and updates the requests."""
        outputs, plan, read, error = (dispatched.outputs, dispatched.plan, dispatched.read,
                                      dispatched.error)
        if error is None and read is not None:
            try:
                sampled = read()
            except Exception as e:  # noqa: BLE001
                error = e
        host = self.runner.host_pool
        if error is None and host is not None:
            try:  # saves of this step land while the next one runs
                host.flush()
            except Exception as e:  # noqa: BLE001 - a save failed: its host entries are lost
                error = e
        if error is not None:
            self._inflight = None  # a continuation of the failed requests, if any
            return outputs + self._fail(plan, error)
        if read is None:
            return outputs
        kind, tokens = sampled
        update = self.scheduler.update if kind == "step" else self.scheduler.update_loop
        progressed = update(plan, tokens, time.time())
        # The weights that sampled them: those the program was dispatched with (a loop read
        # after an update ran with the old ones); a caller's own reader
        # (jaxkv/bench/profile.py replays one) read a program of the current weights.
        version = getattr(read, "version", self.weight_version)
        for seq in progressed:
            seq.token_versions += [version] * (seq.num_output_tokens - len(seq.token_versions))
        for rid in dict.fromkeys(r.request_id for r in progressed):
            entry = self._requests[rid]
            out = build_output(rid, entry)
            if out is None:  # FINAL_ONLY, still running
                continue
            if out.finished:
                del self._requests[rid]
            outputs.append(out)
        if self._inflight is not None and all(
                r.request.is_done for r in self._inflight.plan.decode_rows):
            self._inflight = None  # every row it continues has finished: nothing to read
        return outputs

    def run_cache_copies(self) -> None:
        """Runs the copies the host tier queued (before anything reads or reuses the pages)."""
        if self.runner.host_pool is not None:
            self.runner.run_host_copies(self.radix.take_transfers())

    def write_kv(self, update) -> None:
        """Replaces the KV state by ``update(state)`` (the state is donated): how pages copied
        in from another engine (`jaxkv.disagg`) land in this one's pool."""
        self.runner.update_state(update)

    def use_connector(self, connector: SchedulerConnector) -> None:
        """Plugs in where requests go when they leave before finishing
        (`jaxkv.engine.connector`; `jaxkv.disagg` hands them from prefill to decode)."""
        if self.has_unfinished_requests():
            raise ValueError("Engine.use_connector: the engine must be idle")
        if self.window is not None:
            raise ValueError("Engine.use_connector: hand-offs carry the full-attention layers' "
                             "pages only; build this engine with window_kv=False (local layers "
                             "keeping every token)")
        self.scheduler.connector = connector

    def loop_in_flight(self) -> LoopRun | None:
        """The decode loop dispatched ahead whose tokens are not read yet, if any."""
        return self._inflight

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
        tier; old entries age out by LRU). A version names one set of weights: the current
        one or any served before is refused (else their cached KV would hit).

        ``in_flight="restart"``: running requests keep the tokens already returned and
        recompute their KV (prompt + those tokens) with the new weights, as after a
        preemption (counted as one); a decode loop in flight is dropped, its unread tokens
        never reported. ``"keep"``: they keep their KV, computed by the old weights, and
        decode on with the new ones (stale KV, by choice). Waiting requests always compute
        with the new weights. A quantized engine quantizes a float `Model` alike. Raises
        ValueError naming ``params`` (and the offending leaf path), ``version`` or
        ``in_flight``, changing nothing.
        """
        weights.check_in_flight(in_flight)
        version = weights.next_version(self.weight_version, version, self.served_versions)
        params = weights.source_params(params, self._source_config, self._param_specs,
                                       self.model.quantization)
        placed = place_params(params, self.model.params, self._source_config)
        if in_flight == "restart":
            self._inflight = None  # sampled by the old weights: its tokens are never read
            self.scheduler.preempt_all()  # nothing cached: that KV is of the old weights
        self.runner.set_params(placed)
        self.scheduler.weight_version = version
        self._served_versions.add(version)

    @property
    def served_versions(self) -> frozenset:
        """Every weight version this engine has served (none may be reused)."""
        return frozenset(self._served_versions)

    def programs(self) -> list[tuple[str, int]]:
        """Every program serving can run: ("step", T tokens), ("decode_loop", R rows),
        ("copy_pages", N), ("sample", B), ("logprobs", B), ("sample_masked", R) (structured
        outputs), ("fill_pages", N) (debug_nan_freed_pages), ("host_save" | "host_load", N)
        (host tier), with speculative decoding ("verify", (T, R)) (gather and verification
        per token and row bucket, spec step per row bucket) and ("draft", R). Not listed: the
        small programs of ``prompt_logprobs``, logits processors (per row and entry bucket)
        and speculating grammars, compiled on first use."""
        return self.runner.programs()

    def warmup(self) -> int:
        """Compiles every program serving can run (`programs`), so no request waits on a
        compile; returns how many (see `jaxkv.engine.warmup`)."""
        return self.runner.warmup()

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Waits until the programs ``background_warmup`` left compiling are ready (or
        ``timeout`` seconds pass); returns whether they are."""
        warming = self.runner.warming
        return warming is None or warming.wait(timeout)

    # ---- failures and accounting ---------------------------------------------------------

    def _fail(self, plan, error: Exception) -> list[RequestOutput]:
        """Fails every request with a row in the failed step; keeps the rest serving."""
        message = f"{type(error).__name__}: {error}"
        _log.error("engine step failed; failing its requests: %s", message, exc_info=error)
        outputs = []
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
            self.finish_entry(entry, "error", cache=False)  # its KV may be half-written
            outputs.append(build_output(rid, entry))
        self.recover()
        return outputs

    def recover(self) -> bool:
        """After a failed device call: rebuilds what it lost (`jaxkv.engine.recovery`);
        returns whether the KV state was lost."""
        lost = recovery.recover(self)
        if lost:
            self._inflight = None  # a loop on the lost state: its tokens are never read
        return lost

    def stats(self) -> EngineStats:
        used, cached = self.scheduler.page_usage()
        c = self.scheduler.counters
        return EngineStats(
            prompt_tokens=self._prompt_tokens, cached_prompt_tokens=c.cached_prompt_tokens,
            computed_prompt_tokens=c.computed_prompt_tokens,
            generated_tokens=c.generated_tokens, preemptions=c.preemptions,
            kv_pages_total=self.num_pages, kv_pages_used=used, kv_pages_cached=cached,
            kv_pages_free=self.allocator.num_free, steps=self.runner.num_steps,
            programs_compiling=len(self.runner.pending),
            **window_stats(self.window), **spec_stats(c),
            **tier_stats(self.radix, self.runner.host_pool))

    def check(self) -> None:
        """Asserts the host invariants: every page's refcount equals its holders (running
        sequences and prefix-cache references), and the radix tree's own invariants."""
        self.allocator.check(holders=self.scheduler.holders())
        self.radix.check()
        if self.window is not None:
            self.window.check(holders=self.scheduler.pins.holders(self.scheduler.running))
