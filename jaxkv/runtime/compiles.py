"""Counting XLA compiles (through `jax.monitoring`), for tests and benchmarks."""

from __future__ import annotations

import contextlib

import jax

from jaxkv.runtime.stored_jit import LOADED_EVENT

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCount:
    """How many backend compiles ran, and how long they took; of them, how many were loaded
    from the persistent compilation cache (`jaxkv.runtime.compile_cache`) instead of built;
    and how many programs came whole from the program store (`jaxkv.runtime.stored_jit`:
    neither traced nor lowered, not counted in ``count``)."""

    def __init__(self):
        self.count, self.seconds, self.cache_hits, self.stored = 0, 0.0, 0, 0

    @property
    def compiled(self) -> int:
        """Programs XLA built (not loaded from the persistent cache)."""
        return self.count - self.cache_hits

    def listen(self, event: str, duration: float, **_) -> None:
        if event == _COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def listen_hit(self, event: str, **_) -> None:
        if event == _CACHE_HIT:
            self.cache_hits += 1
        elif event == LOADED_EVENT:
            self.stored += 1


@contextlib.contextmanager
def count_compiles():
    """``with count_compiles() as c: ...`` counts the compiles inside into ``c.count`` (a
    program loaded from the persistent cache counts too, and in ``c.cache_hits``)."""
    counter = CompileCount()
    jax.monitoring.register_event_duration_secs_listener(counter.listen)
    jax.monitoring.register_event_listener(counter.listen_hit)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(counter.listen)
        jax.monitoring.unregister_event_listener(counter.listen_hit)
