"""Fault points: every device call an engine makes, counted per kind, and one of them failing.

`FaultPoints` wraps the call sites on the objects themselves (never a module global), so a
second engine in the same process is untouched:

    kind          wraps                                   modes
    step          engine.steps.step                       raise, consume, late
    decode_loop   engine.steps.decode_loop                raise, consume, late
    copy_pages    engine.runner.copy_pages                raise, consume, late
    poison_pages  engine.runner.poison_pages              raise, consume, late
    host_save     each run of saves in host_pool.run      raise, late
    host_load     each run of loads in host_pool.run      raise, consume, late
    export        mover.send (a payload leaves)           raise
    pull          a sent payload's arrival (ready/wait)   late
    import        mover.receive (a payload lands)         raise, consume, late

The modes are those of tests/test_faults.py: "raise" fails before the call donates anything;
"consume" deletes the donated state's buffers, then raises (a failure after donation; only for
calls that donate); "late" returns, but the failure surfaces later, where the engine first
uses the result: a program's outputs are deleted (read, or handed to the next program); a
save's pages never reach the host (the `flush` that lands them raises); a payload never
arrives (its `ready`/`wait` raise).

A save's host copy is not donated, so it has no "consume"; a gather for export reads only, so
"export" is a raise at dispatch and its asynchronous failure is "pull". Payload arrays are
not deleted for "pull": `jax.Array.is_ready()` on a deleted array crashes the process (jax
0.10.2), so the payload's own `ready`/`wait` raise instead.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import weakref

import jax

from jaxkv.engine import host_tier

MODES = {
    "step": ("raise", "consume", "late"),
    "decode_loop": ("raise", "consume", "late"),
    "copy_pages": ("raise", "consume", "late"),
    "poison_pages": ("raise", "consume", "late"),
    "host_save": ("raise", "late"),
    "host_load": ("raise", "consume", "late"),
    "export": ("raise",),
    "pull": ("late",),
    "import": ("raise", "consume", "late"),
}
KINDS = tuple(MODES)


class InjectedFault(RuntimeError):
    pass


@contextlib.contextmanager
def _failing(module, name: str, error: Exception):
    """``module.name`` raises ``error`` while the block runs."""
    real = getattr(module, name)

    def fail(*_args, **_kwargs):
        raise error

    setattr(module, name, fail)
    try:
        yield
    finally:
        setattr(module, name, real)


def _delete(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        if not leaf.is_deleted():
            leaf.delete()


class FaultPoints:
    """Counts device calls by point ("side:kind") and fails call ``index`` of ``point`` the
    way ``mode`` says (no target: counts only). ``fired`` names the call once it failed."""

    def __init__(self, point: str | None = None, index: int = 0, mode: str = "raise"):
        self.calls: collections.Counter = collections.Counter()
        self.point, self.index, self.mode = point, index, mode
        self.fired: str | None = None
        self.payloads: list[weakref.ref] = []  # every payload sent (for the leak check)
        self.before_late: collections.Counter = collections.Counter()  # (set by the caller)

    def hit(self, point: str) -> str | None:
        """Counts a call of ``point``; returns the mode if this call is the one to fail."""
        self.calls[point] += 1
        if point == self.point and self.calls[point] == self.index and self.fired is None:
            self.fired = f"{point}#{self.index} ({self.mode})"
            return self.mode
        return None

    def fault(self) -> InjectedFault:
        return InjectedFault(f"injected fault at {self.fired}")

    # ---- an engine -----------------------------------------------------------------------

    def instrument(self, engine, side: str = "engine") -> None:
        """Wraps every device call site of ``engine`` (an `Engine`)."""
        steps = engine.steps
        engine.steps = steps._replace(step=self._program(steps.step, f"{side}:step"),
                                      decode_loop=self._program(steps.decode_loop,
                                                                f"{side}:decode_loop"))
        runner = engine.runner
        runner.copy_pages = self._state_call(runner, runner.copy_pages, f"{side}:copy_pages")
        runner.poison_pages = self._state_call(runner, runner.poison_pages,
                                               f"{side}:poison_pages")
        if runner.host_pool is not None:
            self._host_pool(runner.host_pool, side)

    def _program(self, fn, point: str):
        """A jitted step taking (params, state, ...) with the state donated."""
        def run(params, state, *rest):
            mode = self.hit(point)
            if mode is None:
                return fn(params, state, *rest)
            if mode == "late":
                out = fn(params, state, *rest)
                _delete(out)
                return out
            if mode == "consume":
                _delete(state)
            raise self.fault()
        return run

    def _state_call(self, runner, method, point: str):
        """A runner method that replaces ``runner.state`` by a donated program's output
        (it makes no device call for an empty list)."""
        def run(items, *rest):
            if not items:
                return method(items, *rest)
            mode = self.hit(point)
            if mode is None or mode == "late":
                method(items, *rest)
                if mode == "late":
                    _delete(runner.state)
                return None
            if mode == "consume":
                _delete(runner.state)
            raise self.fault()
        return run

    def _host_pool(self, pool, side: str) -> None:
        """Each run of consecutive saves or loads in `HostKVPool.run` is one call (the pool
        groups them the same way, so running them group by group changes nothing)."""
        real_run, real_flush = pool.run, pool.flush
        lost = []  # a "late" save: the flush that would land it fails

        def run(state, transfers):
            groups = [(k, list(g)) for k, g in itertools.groupby(transfers, key=lambda t: t[0])]
            for i, (kind, group) in enumerate(groups):
                mode = self.hit(f"{side}:host_{kind}")
                if mode in ("raise", "consume"):
                    if mode == "consume":
                        _delete(state)
                    # The device call inside the pool fails, so the pool sees its own failure
                    # (with the copies after it still queued), as a real one would.
                    rest = [t for _, g in groups[i:] for t in g]
                    with _failing(host_tier, "gather_pages" if kind == "save" else "load_pages",
                                  self.fault()):
                        real_run(state, rest)
                    raise AssertionError("the injected copy did not raise")
                state = real_run(state, group)
                if mode == "late" and kind == "load":
                    _delete(state)
                elif mode == "late":
                    lost.append(True)
            return state

        def flush():
            if lost:
                lost.clear()
                raise self.fault()
            real_flush()

        pool.run, pool.flush = run, flush

    # ---- a disaggregated pair ------------------------------------------------------------

    def instrument_disagg(self, engine) -> None:
        """Wraps both engines of a `DisaggregatedEngine` and its page transport."""
        self.instrument(engine.prefill, "prefill")
        self.instrument(engine.decode, "decode")
        mover = engine.mover
        real_send, real_receive = mover.send, mover.receive

        def send(state, src):
            if self.hit("transfer:export") is not None:
                raise self.fault()
            payload = real_send(state, src)
            payload.wait()  # landed at once: where the engine polls, it repeats exactly
            self.payloads.append(weakref.ref(payload))
            if self.hit("transfer:pull") is not None:
                def lost(*_):
                    raise self.fault()
                payload.ready = payload.wait = lost
            return payload

        def receive(state, payload, dst):
            mode = self.hit("transfer:import")
            if mode is None or mode == "late":
                out = real_receive(state, payload, dst)
                if mode == "late":
                    _delete(out)
                return out
            if mode == "consume":
                _delete(state)
            raise self.fault()

        mover.send, mover.receive = send, receive

    def payloads_alive(self) -> int:
        """Payloads sent that something still references."""
        return sum(ref() is not None for ref in self.payloads)
