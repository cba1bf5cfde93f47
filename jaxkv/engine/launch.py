"""Device launch of one planned step, and the chaining of decode loops: what `Engine.dispatch`
runs between the scheduler's plan and the device.

A plan runs as one ragged step, or (only decodes, nothing waiting) as a decode loop of up to
``max_decode_steps`` steps on device; with async scheduling, the continuation of a loop is
dispatched before the loop's tokens are read (`chain`).
"""

from __future__ import annotations

from typing import Protocol

from jaxkv.cache.allocator import PageAllocator
from jaxkv.engine.plan import SchedulerOutput
from jaxkv.engine.reads import LoopRun, TokenRead
from jaxkv.engine.request import RequestStatus
from jaxkv.engine.runner import ModelRunner
from jaxkv.engine.scheduler import Scheduler
from jaxkv.runtime.batch import fit
from jaxkv.runtime.processors import has_processors
from jaxkv.runtime.steps import MAX_STOP_IDS


class Engine(Protocol):
    """What launching reads of its `jaxkv.engine.Engine` (and nothing more)."""

    runner: ModelRunner
    scheduler: Scheduler
    allocator: PageAllocator
    async_scheduling: bool

    @property
    def weight_version(self) -> int | str: ...

    def run_cache_copies(self) -> None: ...


SPEC_CHAIN = 2  # loops chained past a speculation-eligible sequence's last look for drafts
LOOK_STEPS = 2  # decode steps between two looks for drafts while a sequence may find some


def launch(engine: Engine, plan: SchedulerOutput) -> TokenRead | LoopRun | None:
    """Dispatches the device part of a step (copies, then a ragged step or a decode
    loop); returns its `TokenRead`, a `LoopRun`, or None when no row runs."""
    engine.run_cache_copies()  # first: saves read pages this plan freed, loads fill pages
    # a copy's source may have been freed by the plan
    engine.runner.copy_pages(plan.copies, plan.window_copies)
    if engine.runner.debug_nan_freed_pages:  # poison what is free now (a copy's
        engine.runner.poison_pages(engine.allocator.drain_freed())  # destination never is)
    if not plan.rows:
        return None
    n = loop_steps(engine, plan)
    if n > 1:
        reqs = [r.request for r in plan.decode_rows]
        limits = engine.scheduler.reserve(reqs, [r.start for r in plan.decode_rows], [
            min(n, q.sampling_params.max_tokens - q.num_output_tokens) for q in reqs])
        engine.run_cache_copies()  # reserving may have moved cache entries to the host
        return engine.runner.launch_loop(plan, limits, n, engine.weight_version)
    return engine.runner.launch_step(plan.rows, engine.weight_version)


def loop_steps(engine: Engine, plan: SchedulerOutput) -> int:
    """How many decode steps to run on device for this plan (1: a plain step): only
    decodes, no request waiting, and every row's stop ids checkable on device."""
    runner = engine.runner
    most = runner.steps.max_decode_steps
    if (most == 1 or plan.prefill_rows or engine.scheduler.waiting
            or ("decode_loop", fit(len(plan.decode_rows), runner.row_buckets)) in runner.pending
            or any(r.num_draft for r in plan.decode_rows)  # speculating: a verify step
            or engine.scheduler.connector.hands_off  # a prompt's last token: hand off
            or any(len(r.samples) != 1 or r.samples[0].logprobs is not None
                   or has_processors(r.samples[0].sampling_params)
                   for r in plan.decode_rows)):
        return 1  # (logprobs and processors work on the single step's logits)
    left = 0
    for r in plan.decode_rows:
        seq = r.samples[0]
        if len(engine.runner.stop_ids(seq)) > MAX_STOP_IDS:
            return 1
        left = max(left, seq.sampling_params.max_tokens - seq.num_output_tokens)
    spec = engine.scheduler.speculator
    if spec.looking([r.request for r in plan.decode_rows]):
        most = min(most, LOOK_STEPS)  # back soon to look for drafts again
    return min(most, left)


def chain(engine: Engine, current: LoopRun) -> LoopRun | None:
    """Dispatches the continuation of a loop whose tokens are not read yet, or returns
    None: when a request waits, or the loop no longer holds every running sequence.

    The host reserves pages past the furthest position each row can have reached. A row
    that ends on the host meanwhile (an abort) ends the chain before its pages can be
    reused, and a stale write is ordered before any later program on the device."""
    reqs = [r.request for r in current.plan.decode_rows]
    if (not engine.async_scheduling or engine.scheduler.waiting
            or len(reqs) != len(engine.scheduler.running)
            or any(q.status is not RequestStatus.RUNNING for q in reqs)
            or not _may_chain(engine, reqs, current.chained)):
        return None
    starts = [s + k for s, k in zip(current.starts, current.limits, strict=True)]
    generated = [g + k for g, k in zip(current.generated, current.limits, strict=True)]
    left = [q.sampling_params.max_tokens - g for q, g in zip(reqs, generated, strict=True)]
    n = min(engine.runner.steps.max_decode_steps, max(left))
    if n < 1:
        return None
    wants = [min(n, x) for x in left]
    limits = engine.scheduler.reserve(reqs, starts, wants)
    engine.run_cache_copies()
    if any(w > 0 and k == 0 for w, k in zip(wants, limits, strict=True)):
        return None  # a row without pages: `schedule` (which may preempt) takes over
    run = engine.runner.continue_loop(current, starts, limits, generated, n,
                                      engine.weight_version)
    run.chained = current.chained + 1
    return run


def _may_chain(engine: Engine, reqs, chained: int) -> bool:
    """Whether loops may go on without the scheduler (which looks for drafts): with
    speculation, not while a sequence may find drafts soon, and SPEC_CHAIN loops at most
    past one that may speculate at all."""
    spec = engine.scheduler.speculator
    if not spec.active(len(reqs)) or not any(spec.eligible(q) for q in reqs):
        return True
    return chained < SPEC_CHAIN and not spec.looking(reqs)
