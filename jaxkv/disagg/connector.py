"""The scheduler halves of disaggregation's connector (`jaxkv.engine.connector`).

`PrefillConnector` takes a request off the prefill scheduler once its prompt ran and each
sample drew its first token, and holds its pages (a `Handoff`) until the decode side has them.
`DecodeConnector` reserves pages and slots on the decode scheduler for a handed-off request (an
`Arrival`), sharing whole pages its prefix cache already holds, and starts it once the rest of
its KV has been copied in. Both go through the scheduler's public methods only, and both count
what they hold in its page books (`held_pages`).

Plain Python (no jax): the page runs themselves move in the worker half
(`jaxkv.disagg.transport`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv.config import cdiv
from jaxkv.engine.request import Request, RequestStatus
from jaxkv.engine.scheduler import Scheduler


@dataclasses.dataclass(eq=False)
class Handoff:
    """A request whose prompt ran on the prefill side: its sample streams (each holding its
    first token) and the pages holding the KV of its first ``num_tokens`` tokens."""

    seqs: list[Request]
    pages: list[int]
    num_tokens: int


@dataclasses.dataclass(eq=False)
class Arrival:
    """A handed-off request's place on the decode side while its KV is in transfer: its
    pages, of which the first ``num_shared`` came from the local prefix cache (the rest wait
    for the copy), and its sample streams, each holding a slot."""

    seqs: list[Request]
    pages: list[int]
    num_shared: int
    num_tokens: int


class PrefillConnector:
    """Hands every request off after its prompt: the scheduler's connector on the prefill side."""

    hands_off = True

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.handoffs: list[Handoff] = []  # in hand-off order, pages held

    def on_prefilled(self, seqs: Sequence[Request]) -> bool:
        """Slots freed, prompt KV offered to the prefix cache, pages held by a `Handoff`."""
        scheduler = self.scheduler
        first, s = seqs[0], scheduler.page_size
        n = first.num_computed_tokens  # the prompt (every sample shares its pages)
        pages = list(first.pages)
        scheduler.radix.insert(first.token_ids[:n], pages[:cdiv(n, s)], first.cache_namespace)
        for seq in seqs:
            scheduler.running.remove(seq)
            if seq is not first:
                scheduler.allocator.free(seq.pages)  # the Handoff keeps one reference
            if seq.prefix_handle is not None:
                scheduler.radix.unlock(seq.prefix_handle)
                seq.prefix_handle = None
            scheduler.free_slots.append(seq.slot)
            seq.slot, seq.pages, seq.pages_offered = None, [], 0
            seq.status = RequestStatus.TRANSFERRING
        self.handoffs.append(Handoff(list(seqs), pages, n))
        return True

    def release(self, handoff: Handoff) -> None:
        """Drops a handoff's pages (its transfer has been dispatched, or it was aborted)."""
        self.handoffs.remove(handoff)
        self.scheduler.allocator.free(handoff.pages)

    def held_pages(self) -> list[list[int]]:
        return [list(h.pages) for h in self.handoffs]


class DecodeConnector:
    """Holds the pages reserved for requests whose KV is on its way: the decode side's."""

    hands_off = False

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.arrivals: list[Arrival] = []  # in reservation order

    def on_prefilled(self, seqs) -> bool:  # (a request recomputed here decodes here)
        return False

    def reserve(self, handoff: Handoff) -> Arrival | None:
        """Gives a handed-off request pages and slots: whole pages the prefix cache already
        holds are shared, fresh pages take the rest of the prompt's KV, which the caller
        copies in from the prefill side. None (changing nothing) when the slots or pages are
        not there now; it never preempts."""
        sched, seqs, n = self.scheduler, handoff.seqs, handoff.num_tokens
        s = sched.page_size
        if len(sched.free_slots) < len(seqs):
            return None
        first = seqs[0]
        shared, match = [], None
        if not first.needs_prompt_logits:
            space = first.cache_namespace  # pages of the weights that computed its prompt
            sched.radix.promote(first.token_ids[:n], space)
            match = sched.radix.match_prefix(first.token_ids[:n], space, peek=True)
            shared = list(match.pages[:match.num_tokens // s])
        sched.allocator.share(shared)
        need = cdiv(n, s) - len(shared)
        if not sched.make_room(need):
            sched.allocator.free(shared)
            return None
        pages = shared + sched.allocator.allocate(need)
        if match is not None:
            sched.radix.record(match, n, len(shared) * s)
        for i, seq in enumerate(seqs):
            if i:
                sched.allocator.share(pages)
            seq.pages, seq.slot = list(pages), sched.free_slots.pop()
            seq.num_computed_tokens = seq.prefill_end = n
        arrival = Arrival(list(seqs), pages, len(shared), n)
        self.arrivals.append(arrival)
        return arrival

    def land(self, arrival: Arrival) -> None:
        """The arrival's pages hold its KV now (copies queued on device): its samples run."""
        self.arrivals.remove(arrival)
        for seq in arrival.seqs:
            seq.status = RequestStatus.RUNNING
            self.scheduler.running.append(seq)
        self.scheduler.cache_full_pages(arrival.seqs[0])

    def cancel(self, arrival: Arrival) -> None:
        """Gives back an arrival's pages and slots (its request was aborted in transfer)."""
        self.arrivals.remove(arrival)
        for seq in arrival.seqs:
            self.scheduler.allocator.free(seq.pages)
            self.scheduler.free_slots.append(seq.slot)
            seq.pages, seq.slot = [], None

    def held_pages(self) -> list[list[int]]:
        return [list(seq.pages) for a in self.arrivals for seq in a.seqs]
