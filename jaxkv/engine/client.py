"""`EngineClient`: what every engine offers its users (`LLM`, the server, scripts).

`Engine` (one model on one mesh), `ReplicatedEngine` (data-parallel replicas behind one
front) and `DisaggregatedEngine` (a prefill and a decode engine) all implement it, so a caller
never asks which kind it holds. `Dispatched` is the seam between an engine's two step halves.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jaxkv.engine.plan import SchedulerOutput
    from jaxkv.engine.reads import TokenRead
    from jaxkv.engine.request import EngineStats, RequestOutput
    from jaxkv.model.pretrained import Model
    from jaxkv.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """Serves requests step by step. Request ids are strings, unique among unfinished
    requests; every method raises ValueError naming the bad field and changes nothing then."""

    model: Model
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids=None,
                    sampling_params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        """Queues a request (text ``prompt`` or ``prompt_token_ids``, not both)."""

    def abort(self, request_id: str) -> None:
        """Ends an unfinished request, freeing what it holds; the next `step` reports it."""

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of requests that progressed or ended."""

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running, or in transfer."""

    def num_running(self) -> int:
        """Requests (sample streams) holding KV: running, or moving between engines."""

    def num_waiting(self) -> int:
        """Sample streams waiting for admission."""

    def stats(self) -> EngineStats:
        """Counters since the engine started."""

    def check(self) -> None:
        """Asserts the host invariants (page books, prefix-cache tree)."""

    def warmup(self) -> int:
        """Compiles every program serving can run; returns how many."""

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Waits for the programs compiling in the background (``background_warmup``);
        returns whether every one is ready."""

    @property
    def weight_version(self) -> int | str:
        """The version of the weights served (see `update_params`)."""

    def update_params(self, params, *, version: int | str | None = None,
                      in_flight: str = "restart") -> None:
        """Serves new weights from the next step on, compiling nothing."""


@dataclasses.dataclass
class Dispatched:
    """One engine step between its halves (`Engine.dispatch` -> `Engine.collect`): outputs
    ready without the device (aborts), the plan, and the read of its tokens, or the error
    that stopped it (its requests fail as it is collected)."""

    outputs: list[RequestOutput]
    plan: SchedulerOutput | None
    read: TokenRead | None = None
    error: Exception | None = None

    def ready(self) -> bool:
        """True when collecting it will not wait for the device."""
        return self.error is not None or self.read is None or self.read.ready()
