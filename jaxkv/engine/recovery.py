"""Recovery after a failed device call (a step, or a copy a caller ran, e.g. `jaxkv.disagg`'s
transfers): what an `Engine` rebuilds so that the requests the failure did not touch keep
serving."""

from __future__ import annotations

from typing import Protocol

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.prefix import NullPrefixCache
from jaxkv.cache.radix import RadixCache
from jaxkv.engine.runner import ModelRunner
from jaxkv.engine.scheduler import Scheduler


class Engine(Protocol):
    """What recovery rebuilds of its `jaxkv.engine.Engine` (and nothing more)."""

    runner: ModelRunner
    scheduler: Scheduler
    allocator: PageAllocator
    radix: RadixCache | NullPrefixCache
    state_resets: int


def recover(engine: Engine) -> bool:
    """Rebuilds a KV state the failure lost (the running requests recompute from their
    tokens, as after a preemption; the prefix cache, and with it every window slot, goes),
    drops prefix entries a failed run of host copies left unfilled, and the host tier (a copy
    to or from it may not have run). Returns whether the state was lost."""
    runner = engine.runner
    lost, host = runner.state_lost(), runner.host_pool
    if lost:
        engine.scheduler.preempt_all()  # their KV is gone: recompute from their tokens
        engine.radix.clear()
        if runner.debug_nan_freed_pages:
            engine.allocator.drain_freed()  # the new state starts zeroed
        runner.reset_state()  # (and the draft's pool: it may be the one lost)
        engine.state_resets += 1  # (a DisaggregatedEngine's hand-offs lost their KV too)
    elif host is not None and host.loads_skipped:  # entries promoted for loads that never
        engine.radix.clear()  # ran: only the failed requests held them, so every such goes
    if host is not None:
        engine.radix.drop_host_tier()
        engine.radix.take_transfers()
        host.discard()
    return lost
