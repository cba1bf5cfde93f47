"""The scheduler half of a KV connector: where a request's KV goes when it leaves the engine.

A colocated engine keeps every request until it finishes, and its connector is `NullConnector`.
Prefill/decode disaggregation (`jaxkv.disagg`) plugs its own in: on the prefill side a
connector takes a request off the scheduler once its prompt ran (`on_prefilled`) and holds its
pages until the decode side has them; on the decode side one holds the pages and slots reserved
for requests whose KV is still on the way. The scheduler asks the connector only these two
things, and counts the pages it holds (`held_pages`) in its page books; everything else a
connector does goes through the scheduler's public members (`running`, `free_slots`,
`allocator`, `radix`, `make_room`, `cache_full_pages`).

The worker half (moving page runs between pools) is the connector's own business: see
`jaxkv.disagg.transport`.

Plain Python (no jax).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from jaxkv.engine.request import Request


class SchedulerConnector(Protocol):
    """What a `Scheduler` asks of its connector."""

    hands_off: bool  # True: every request leaves after its prompt's last token (no decode here)

    def on_prefilled(self, seqs: Sequence[Request]) -> bool:
        """Called once a request's prompt ran and each of its unfinished sample streams drew
        its first token; True if the connector took them off the scheduler."""

    def held_pages(self) -> list[list[int]]:
        """One page list per reference the connector holds (for the page books)."""


class NullConnector:
    """No connector: requests stay on their engine until they finish."""

    hands_off = False

    def on_prefilled(self, seqs) -> bool:
        return False

    def held_pages(self) -> list[list[int]]:
        return []
