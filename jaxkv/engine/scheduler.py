"""Continuous-batching scheduler: which sequences run this step, on which pages.

Plain Python (no jax). Each step, under a token budget (max_num_batched_tokens) and a cap on
running sequences (max_num_seqs, one state slot each):

1. running decodes, oldest first: one token each, with a new page when the token starts one,
   and a private copy of a shared page (copy-on-write) before writing into it;
2. running prefills, oldest first: the next chunk of each (chunked prefill);
3. admissions: preempted sequences first, then sequences passed over MAX_SKIPS times (aging,
   in arrival order), then the longest cached prefix first (arrival order when more than
   FCFS_QUEUE_LEN wait). A sequence is admitted only if the pages of its next chunk can be
   allocated after prefix matching; admission stops at the first that cannot.

When more sequences decode than the budget has tokens, decodes take turns (round robin from
where the last step stopped), so in steady state none waits more than ceil(decodes / budget)
steps. A preemption victim is still the newest sequence not yet scheduled in the step, which
with turns may be older than one already scheduled.

The prefix cache is any `jaxkv.cache.prefix.PrefixCache`. With prefix caching off
(`NullPrefixCache`) nothing matches, every page is freed as soon as its sequence lets go of it,
and the waiting queue is served in its own order (preempted sequences at its front, then
arrivals). With a host tier (`jaxkv.cache.host_radix.HostTieredRadixCache`), admission first
brings back to device pages the host-resident entries on the request's cached path
(`PrefixCache.promote`), and eviction moves entries to the host instead of dropping them; the
cache queues the copies for the engine to run before the step.

With window-only KV (`jaxkv.cache.window`), a running sequence also pins the local-layer slots
of the pages from the first one its next query sees to its last (`WindowPins`). With
speculative decoding, a decode row carries draft tokens too (`jaxkv.spec`).

Prefix-cache entries live in the namespace (cache_salt, weight version) of the request that
computed them (`Request.cache_namespace`; the version is ``weight_version`` at its admission),
so after `Engine.update_params` no admission reuses KV of other weights.

Pages come from the free list, then from evicting the prefix cache (LRU), and for running
sequences (1-2) from preempting the newest running sequence not scheduled this step. Preemption
is by recompute: the victim's computed KV goes to the prefix cache, its pages and slot are
released, and it waits again with its generated tokens, which re-admission prefills again
(hitting the cache for whatever was not evicted meanwhile). Admission never preempts, and a
step that preempted admits nothing, so a victim is not re-admitted at once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.prefix import PrefixCache
from jaxkv.cache.window import WindowSlots
from jaxkv.config import cdiv
from jaxkv.engine.connector import NullConnector, SchedulerConnector
from jaxkv.engine.plan import ScheduledRow, SchedulerCounters, SchedulerOutput
from jaxkv.engine.request import Request, RequestStatus, cache_namespace
from jaxkv.engine.window_pins import WindowPins
from jaxkv.spec.speculator import Speculator

FCFS_QUEUE_LEN = 64  # longer waiting queues are served in arrival order (no prefix probing)
MAX_SKIPS = 16  # steps that admit a later arrival ahead of a waiting sequence, before it goes first


class Scheduler:
    """Owns the waiting and running queues and every page a sequence holds."""

    def __init__(self, allocator: PageAllocator, radix: PrefixCache, *, page_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Collection[int] = (), window: WindowSlots | None = None,
                 speculator: Speculator | None = None):
        for name, v in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Scheduler: {name} must be an int >= 1, got {v!r}")
        self.allocator, self.radix, self.page_size = allocator, radix, page_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # state slots no sequence holds
        self._fork_slots: dict[Request, list[int]] = {}  # reserved for a parent's samples
        self._decode_turn = 0  # where the next step's decodes start when they exceed the budget
        # The weights admissions compute KV with (`Engine.update_params`): part of the prefix-
        # cache namespace, so no request reuses KV computed by other weights.
        self.weight_version: int | str = 0
        self.counters = SchedulerCounters()
        # Where a request's KV goes when it leaves before finishing (`jaxkv.engine.connector`;
        # prefill/decode disaggregation plugs one in).
        self.connector: SchedulerConnector = NullConnector()
        self.pins = WindowPins(window, allocator)  # window-only KV's slots (no-op without)
        self.speculator = speculator or Speculator(None)  # drafts (none without a config)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ------------------------------------------------------------------------

    def schedule(self, max_tokens: int | None = None) -> SchedulerOutput:
        """Plans one step of at most ``max_tokens`` tokens (default and most:
        max_num_batched_tokens); allocates (and may evict or preempt) the pages it needs."""
        budget = self.max_num_batched_tokens if max_tokens is None else \
            min(max_tokens, self.max_num_batched_tokens)
        out, scheduled = SchedulerOutput(), set()
        try:
            for decode in (True, False):
                queue = list(self.running)
                if decode and len(queue) > budget:
                    decodes = [r for r in queue if r.num_pending_tokens == 1]
                    if len(decodes) > budget:  # take turns: start after the last one served
                        k = self._decode_turn % len(decodes)
                        queue = decodes[k:] + decodes[:k]
                        self._decode_turn = k + budget
                drafts = self.speculator.drafts(self.running, budget, self.waiting) \
                    if decode else {}
                for req in queue:
                    if budget == 0:
                        break
                    if (req.status is not RequestStatus.RUNNING or req in scheduled
                            or decode != (req.num_pending_tokens == 1)):
                        continue
                    n = min(req.num_pending_tokens, budget)
                    draft = drafts.get(req, ())[:budget - n]
                    if self._grow(req, n, scheduled, out):  # drafts never preempt:
                        draft = draft[:self.reserve([req], [req.num_computed_tokens + n],
                                                    [len(draft)])[0]] if draft else ()
                        row = self._row(req, n, draft)
                        (out.decode_rows if decode else out.prefill_rows).append(row)
                        scheduled.add(req)
                        budget -= len(row.tokens)
            if not out.preempted:
                self._admit_waiting(budget, out)
            self.pins.plan_copies(out)
        finally:  # (also when planning failed: no pin or reference outlives the plan)
            self.pins.release_sources()
        return out

    def _row(self, req: Request, n: int, draft: tuple[int, ...] = ()) -> ScheduledRow:
        start = req.num_computed_tokens
        samples = (req, *req.forks) if start + n == len(req.token_ids) else ()
        return ScheduledRow(req.slot, tuple(req.token_ids[start:start + n]) + draft, start,
                            tuple(req.pages), req, samples, len(draft))

    def _pages_needed(self, req: Request, n: int) -> tuple[int, int | None]:
        """(pages to allocate, index of a shared page to copy before writing, or None)."""
        s, start = self.page_size, req.num_computed_tokens
        new = max(0, cdiv(start + n, s) - len(req.pages))
        cow = start // s if start % s and self.allocator.refcount(req.pages[start // s]) > 1 \
            else None
        return new + (cow is not None), cow

    def _grow(self, req: Request, n: int, scheduled: set, out: SchedulerOutput) -> bool:
        """Gives a running sequence writable pages for its next n tokens; False if it was
        preempted to find them."""
        while True:
            need, cow = self._pages_needed(req, n)
            if self.allocator.num_free >= need:
                break
            if self._evict(need):
                continue
            victim = next(r for r in reversed(self.running) if r not in scheduled)
            self._preempt(victim, out)
            if victim is req:
                return False
        if cow is not None:
            page, copied = self.allocator.copy_on_write(req.pages[cow])
            if copied:
                self.pins.copy(req.pages[cow], page, out)
                self.pins.moved(req, cow, page)
                req.pages[cow] = page
            need -= 1
        req.pages += self.allocator.allocate(need)
        self.pins.hold(req)
        return True

    def make_room(self, need: int) -> bool:
        """Evicts from the prefix cache until ``need`` pages are free (True), never preempting."""
        while self.allocator.num_free < need and self._evict(need):
            pass
        return self.allocator.num_free >= need

    def _evict(self, need: int) -> bool:
        """Evicts from the prefix cache toward `need` free pages; True if any page was freed."""
        short = need - self.allocator.num_free
        return short > 0 and self.radix.evict(short) > 0

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        if budget == 0 or not self.waiting or not self.free_slots:
            return
        admitted = []
        for req in self._waiting_order():
            if budget == 0:
                break
            ok = self._admit(req, budget, out, reuse_partial=True)
            if not ok and not self.running:
                # It fits alone (checked at submission), but the partly matched page it locks
                # may be the one missing: admit it reusing only whole pages, nothing locked.
                ok = self._admit(req, budget, out, reuse_partial=False)
                if not ok and self.radix.clear():
                    # Still short: the path it shares pins cache pages only an inner node
                    # holds (evictions take leaves). Nothing runs, so the whole cache goes.
                    ok = self._admit(req, budget, out, reuse_partial=False)
            if not ok:
                break
            admitted.append(req.arrival_index)
            budget -= len(out.prefill_rows[-1].tokens)
        if admitted:  # age everyone a later arrival overtook
            last = max(admitted)
            for req in self.waiting:
                if req.arrival_index < last:
                    req.skipped += 1

    def _waiting_order(self) -> list[Request]:
        if not self.radix.enabled or len(self.waiting) == 1 or len(self.waiting) > FCFS_QUEUE_LEN:
            return list(self.waiting)
        hit = {r: self._peek_hit(r) for r in self.waiting}
        return sorted(self.waiting, key=lambda r: (
            r.num_preemptions == 0, r.skipped < MAX_SKIPS,
            r.arrival_index if r.skipped >= MAX_SKIPS else -hit[r], r.arrival_index))

    def _peek_hit(self, req: Request) -> int:
        """Cached prefix length of a waiting request (a look: no LRU refresh, no hit count),
        matched again only when the cache or the request's tokens changed since last time."""
        if req.needs_prompt_logits:
            return 0
        key = (self.radix.version, self.weight_version, len(req.token_ids))
        if req.peeked is None or req.peeked[0] != key:
            n = self.radix.cached_length(req.token_ids[:-1],  # both tiers
                                         cache_namespace(req.cache_salt, self.weight_version))
            req.peeked = (key, n)
        return req.peeked[1]

    def _admit(self, req: Request, budget: int, out: SchedulerOutput, *,
               reuse_partial: bool) -> bool:
        if len(self.free_slots) < 1 + len(req.forks):
            return False
        s, tokens = self.page_size, req.token_ids
        match, cached, promoted = None, 0, 0
        space = cache_namespace(req.cache_salt, self.weight_version)  # KV of these weights
        if not req.needs_prompt_logits:
            # Entries on its path held off the device (a host tier): copied back first.
            promoted = self.radix.promote(tokens[:-1], space)
            # At most len - 1 tokens: the last token must run for its logits.
            # A peek: counted (and its recency refreshed) only if the request is admitted, so
            # an admission retried every step under memory pressure counts once.
            match = self.radix.match_prefix(tokens[:-1], space, peek=True)
            cached = match.num_tokens if reuse_partial else match.num_tokens // s * s
            # window-only KV: its local layers read the window before it
            cached = self.pins.usable_prefix(match.pages, cached)
        full, locked = cached // s, reuse_partial and cached > 0
        shared = list(match.pages[:full]) if match else []
        if locked:  # keeps the matched path, the partly matched page included, from eviction
            self.radix.lock(match.handle)
        else:  # shared pages are safe from eviction once we hold them
            self.allocator.share(shared)
        chunk = min(len(tokens) - cached, budget)
        need = cdiv(cached + chunk, s) - full
        if not self.make_room(need):
            if locked:
                self.radix.unlock(match.handle)
            else:
                self.allocator.free(shared)
            return False
        if locked:
            self.allocator.share(shared)
        fresh = self.allocator.allocate(need)
        if cached % s:  # token-exact reuse: copy the matched part of the last page
            self.pins.copy(match.pages[full], fresh[0], out)
        req.pages, req.num_computed_tokens = shared + fresh, cached
        self.pins.hold(req)
        req.kv_version = self.weight_version
        req.prefix_handle = match.handle if locked else None
        req.prefill_end, req.status = len(tokens), RequestStatus.RUNNING
        req.slot = self.free_slots.pop()
        if req.forks:
            self._fork_slots[req] = [self.free_slots.pop() for _ in req.forks]
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
        if match is not None:
            on_device = match.num_tokens - promoted  # what the device held before promotion
            self.radix.record(match, len(tokens) - 1, cached,
                              from_host=max(0, cached - on_device))
        self.counters.cached_prompt_tokens += cached
        self.waiting.remove(req)
        self.running.append(req)
        out.prefill_rows.append(self._row(req, chunk))
        return True

    # ---- after the step ------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: Sequence[Sequence[int] | None],
               now: float) -> list[Request]:
        """Applies a step's results: ``sampled[i]`` holds one token per sample of row i (None
        for a row that did not finish its prefill). Returns the sequences that got a token."""
        progressed = []
        for row, tokens in zip(out.rows, sampled, strict=True):
            req = row.request
            if row.num_draft:  # tokens: what the row emitted (its accepted drafts and one)
                progressed += self.speculator.take_verified(self, row, tokens, now)
                continue
            end = row.start + len(row.tokens)
            req.num_computed_tokens = end
            if req.status is RequestStatus.RUNNING:
                self.pins.hold(req)  # what its next query no longer sees
            self.counters.computed_prompt_tokens += max(0, min(req.prefill_end, end) - row.start)
            if row.start < req.prefill_end:
                self.cache_full_pages(req)
            if not row.samples:
                continue
            if req.forks:
                self._fork(req)
            for seq, token in zip(row.samples, tokens, strict=True):
                self.take_token(seq, token, now)
                progressed.append(seq)
            going = [seq for seq in row.samples if not seq.is_done]
            if going:
                self.connector.on_prefilled(going)
        return progressed

    def take_token(self, seq: Request, token: int, now: float) -> bool:
        """Appends a sampled token to a sequence; True if it finished the sequence."""
        reason = seq.append_token(int(token), self.eos_token_ids)
        self.counters.generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if reason is not None:
            self.finish(seq, reason, now)
        return reason is not None

    def reserve(self, reqs: Sequence[Request], starts: Sequence[int], wants: Sequence[int]
                ) -> list[int]:
        """Gives decoding sequences pages for ``wants[i]`` tokens written from position
        ``starts[i]`` on, evicting from the prefix cache if needed (fewer where pages still run
        short: a reservation never preempts); returns how many tokens each may write, 0 if its
        pages hold none."""
        s, limits = self.page_size, []
        for req, start, want in zip(reqs, starts, wants, strict=True):
            want = max(0, want)
            extra = cdiv(start + want, s) - len(req.pages)
            if extra > self.allocator.num_free:
                self._evict(extra)  # pages only the prefix cache holds are in no row's table
            if extra > self.allocator.num_free:
                extra = 0
                want = max(0, min(want, len(req.pages) * s - start))  # what its pages hold
            if extra > 0:
                req.pages += self.allocator.allocate(extra)
                self.pins.hold(req)
            limits.append(want)
        return limits

    def update_loop(self, out: SchedulerOutput, tokens: Sequence[Sequence[int]], now: float
                    ) -> list[Request]:
        """Applies a decode loop's results: ``tokens[i]`` are the tokens decode row i sampled,
        in order (each one's predecessor had its KV written). Tokens after the one that
        finishes a sequence are dropped."""
        progressed = []
        for row, toks in zip(out.decode_rows, tokens, strict=True):
            req = row.request
            if req.status is not RequestStatus.RUNNING:  # aborted while the loop ran
                continue
            for token in toks:
                req.num_computed_tokens += 1
                if req.num_computed_tokens == req.prefill_end:  # the prompt's last token ran
                    self.counters.computed_prompt_tokens += 1  # here (a one-token chunk)
                    self.cache_full_pages(req)
                if self.take_token(req, token, now):
                    break
            if req.status is RequestStatus.RUNNING:
                self.pins.hold(req)
            progressed += [req] if toks else []
        return progressed

    def cache_full_pages(self, req: Request) -> None:
        """Offers a prompt's computed whole pages to the prefix cache, so requests arriving
        while it runs can share them (a partial last page is still being written)."""
        full = req.num_computed_tokens // self.page_size
        if full > req.pages_offered:
            self.radix.insert(req.token_ids[:full * self.page_size], req.pages[:full],
                              req.cache_namespace)
            req.pages_offered = full

    def _fork(self, parent: Request) -> None:
        """Starts samples 1..n-1 on the parent's pages (shared until one writes into them)."""
        for sib, slot in zip(parent.forks, self._fork_slots.pop(parent), strict=True):
            self.allocator.share(parent.pages)
            sib.pages, sib.slot = list(parent.pages), slot
            sib.num_computed_tokens = parent.num_computed_tokens
            sib.prefill_end = parent.prefill_end
            sib.num_cached_tokens, sib.status = parent.num_cached_tokens, RequestStatus.RUNNING
            sib.kv_version = parent.kv_version
            self.pins.fork(parent, sib)
            self.running.append(sib)
        parent.forks = []

    # ---- leaving -------------------------------------------------------------------------

    def finish(self, req: Request, reason: str, now: float, *, cache: bool = True) -> None:
        """Ends a sequence ("stop", "length", "abort" or "error"): frees its pages at once,
        offering its computed KV to the prefix cache first unless ``cache`` is False."""
        if req.status is RequestStatus.RUNNING:
            self._release(req, cache=cache)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = (RequestStatus.ABORTED if reason in ("abort", "error")
                      else RequestStatus.FINISHED)
        req.finish_reason, req.finish_time = reason, now

    def preempt_all(self) -> None:
        """Sends every running sequence back to wait, caching nothing: for when the device
        KV was lost (a failed step), so they recompute from their tokens."""
        for req in list(reversed(self.running)):
            self._preempt(req, None, cache=False)

    def _preempt(self, req: Request, out: SchedulerOutput | None, *, cache: bool = True) -> None:
        self._release(req, cache=cache)
        req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)  # victims go newest first, so they queue oldest first
        if out is not None:
            out.preempted.append(req)
        self.counters.preemptions += 1

    def _release(self, req: Request, *, cache: bool = True) -> None:
        """Gives a running sequence's computed KV to the prefix cache (if ``cache``), then
        drops its pages, lock and slots."""
        self.running.remove(req)
        n = req.num_computed_tokens
        if cache and n:
            self.radix.insert(req.token_ids[:n], req.pages[:cdiv(n, self.page_size)],
                              req.cache_namespace)
        self.pins.drop(req)
        self.allocator.free(req.pages)
        req.pages, req.pages_offered = [], 0
        if req.prefix_handle is not None:
            self.radix.unlock(req.prefix_handle)
            req.prefix_handle = None
        self.free_slots.append(req.slot)
        self.free_slots.extend(self._fork_slots.pop(req, ()))
        req.slot = None

    # ---- accounting ----------------------------------------------------------------------

    def holders(self) -> list[list[int]]:
        """One page list per reference holder, for ``PageAllocator.check(holders=...)``."""
        held = [list(r.pages) for r in self.running] + list(self.connector.held_pages())
        return held + [[p] for p in self.radix.held_pages()]  # a page may have two nodes

    def page_usage(self) -> tuple[int, int]:
        """(pages held by running sequences and by requests in a prefill-to-decode transfer,
        pages held only by the prefix cache)."""
        used = {p for r in self.running for p in r.pages}
        used |= {p for pages in self.connector.held_pages() for p in pages}
        cached = set(self.radix.held_pages()) - used
        return len(used), len(cached)
