"""One engine loop on a background thread, serving every connection of the server.

The engine is not thread-safe: a lock guards it. The loop thread holds the lock for each
`step` and hands each request's outputs to the asyncio queue of the connection that submitted
it (``loop.call_soon_threadsafe``); handlers take the lock briefly, in a worker thread, to add
a request. An abort never waits: it is queued, and the loop carries it out before its next
step. A request that fails inside the engine arrives as an output with
``error`` set; an exception escaping `step` itself fails every request in flight and the loop
keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from jaxkv.engine.request import RequestOutput

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are unfinished than the server accepts (``max_pending``)."""


class AsyncEngine:
    def __init__(self, engine, *, max_pending: int = 256, on_step=None):
        self.engine = engine
        self.max_pending = max_pending
        self.on_step = on_step  # called on the loop thread after each step: (outputs, seconds)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._aborts: collections.deque[str] = collections.deque()
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    def add(self, request_id: str, prompt_token_ids, sampling_params, loop,
            cache_salt: str | None = None) -> asyncio.Queue:
        """Queues a request (call from a worker thread) in the prefix-cache namespace
        ``cache_salt``; raises ValueError for bad input and QueueFullError when
        ``max_pending`` requests are unfinished."""
        queue: asyncio.Queue = asyncio.Queue()

        def check():  # before waiting for the lock too: a full server answers at once
            if len(self._queues) >= self.max_pending:
                raise QueueFullError(f"{len(self._queues)} requests are already unfinished "
                                     f"(max_pending={self.max_pending}); retry later")

        check()
        with self._lock:
            check()
            self.engine.add_request(request_id, prompt_token_ids=prompt_token_ids,
                                    sampling_params=sampling_params, cache_salt=cache_salt)
            self._queues[request_id] = (loop, queue)
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Ends a request whose client went away (any thread, never blocks): the engine
        thread aborts it, freeing its pages, before its next step."""
        if self._queues.pop(request_id, None) is not None:
            self._aborts.append(request_id)
        self._wake.set()

    def _drain_aborts(self) -> bool:
        """Aborts what clients gave up on (engine thread, lock held); whether any was."""
        drained = False
        while self._aborts:
            request_id = self._aborts.popleft()
            try:
                self.engine.abort(request_id)
                drained = True
            except ValueError:
                pass  # it finished in the meantime
        return drained

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _deliver(self, request_id: str, item) -> None:
        target = self._queues.get(request_id)
        if target is None:
            return  # aborted: nobody listens
        if isinstance(item, RequestOutput) and item.finished or isinstance(item, Exception):
            self._queues.pop(request_id, None)
        loop, queue = target
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def _run(self) -> None:
        while not self._stop:
            try:
                self._once()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad step
                logger.exception("engine loop iteration failed")

    def _once(self) -> None:
        with self._lock:
            aborted = self._drain_aborts()
            busy = self.engine.has_unfinished_requests()
            outputs, error, t = [], None, time.perf_counter()
            if busy or aborted:  # a step also reports (and frees) what was aborted
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - reported to every waiting client
                    error = e
            seconds = time.perf_counter() - t
            if error is not None:
                for request_id in list(self._queues):
                    try:
                        self.engine.abort(request_id)
                    except ValueError:
                        pass
                    self._deliver(request_id, RuntimeError(f"engine step failed: {error}"))
            if self.on_step is not None and (busy or aborted):
                # Under the lock, and before any client sees this step's outputs: /metrics
                # read after a streamed chunk already counts the step that produced it.
                self.on_step(outputs, seconds)
            for out in outputs:
                self._deliver(out.request_id, out)
        if not busy:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
