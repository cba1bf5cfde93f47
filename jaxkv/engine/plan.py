"""What one scheduler step plans (`SchedulerOutput`: rows and page copies) and the counters it
keeps: plain data shared by the scheduler, the runner and the launch code (no jax)."""

from __future__ import annotations

import dataclasses

from jaxkv.engine.request import Request


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One sequence's part of a step; has the fields of `jaxkv.runtime.batch.Row`."""

    slot: int
    tokens: tuple[int, ...]  # new tokens: a prompt chunk, or the last sampled token
    start: int  # position of tokens[0] (tokens already cached)
    pages: tuple[int, ...]  # the sequence's pages, enough for start + len(tokens)
    request: Request
    samples: tuple[Request, ...] = ()  # sequences sampling from this row's last logits
    # Speculative decoding: tokens[1:] are drafts (placeholders the device fills, for
    # ``self``); the row emits the accepted ones and one more (`jaxkv.spec`).
    num_draft: int = 0

    @property
    def owner(self) -> tuple[Request, int]:
        """Who holds the row's pages since it last got them (see `jaxkv.runtime.batch.Row`)."""
        return self.request, self.request.num_preemptions


@dataclasses.dataclass
class SchedulerOutput:
    """The plan of one step: rows to run, and page copies to make on device before them."""

    decode_rows: list[ScheduledRow] = dataclasses.field(default_factory=list)
    prefill_rows: list[ScheduledRow] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst)
    # The same copies in the local layers' pool (window-only KV): (src slot, dst slot).
    window_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)

    @property
    def rows(self) -> list[ScheduledRow]:
        return self.decode_rows + self.prefill_rows


@dataclasses.dataclass
class SchedulerCounters:
    cached_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
