"""Counting XLA compiles (through `jax.monitoring`), for tests and benchmarks."""

from __future__ import annotations

import contextlib

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCount:
    """How many backend compiles ran, and how long they took."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def listen(self, event: str, duration: float, **_) -> None:
        if event == _COMPILE_EVENT:
            self.count += 1
            self.seconds += duration


@contextlib.contextmanager
def count_compiles():
    """``with count_compiles() as c: ...`` counts the compiles inside into ``c.count``."""
    counter = CompileCount()
    jax.monitoring.register_event_duration_secs_listener(counter.listen)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(counter.listen)
