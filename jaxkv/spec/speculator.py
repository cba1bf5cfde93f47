"""Speculative decoding's host policy (plain Python, no jax): which sequences speculate in a
step, with how many drafts (what they are is the `Proposer`'s), and the books of what was
accepted (`jaxkv.spec` explains the whole)."""

from __future__ import annotations

from jaxkv.config import cdiv
from jaxkv.engine.request import RequestStatus
from jaxkv.spec.proposer import Proposer

JUDGE_AFTER = 4  # rounds of k drafted tokens before a sequence's acceptance is judged
IDLE_LOOKS = 4  # looks without drafts after which a sequence decodes in full loops again


class Speculator:
    """Plans each step's drafts with a `Proposer`; a disabled one (None) plans none."""

    def __init__(self, proposer: Proposer | None):
        self.proposer = proposer
        self.config = None if proposer is None else proposer.config
        self.k = 0 if proposer is None else proposer.k
        self.on_device = proposer is not None and proposer.on_device

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def active(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running sequences speculates at all."""
        c = self.config
        return c is not None and (c.disable_by_batch_size is None
                                  or num_running <= c.disable_by_batch_size)

    def eligible(self, req) -> bool:
        """Whether ``req`` (a running sequence) may speculate."""
        sp = req.sampling_params
        return (self.config is not None and req.speculating and sp.speculate
                and not sp.uses_processors and not req.forks and not req.needs_prompt_logits
                and req.num_pending_tokens == 1 and req.num_computed_tokens >= req.prefill_end)

    def propose(self, req, room: int) -> tuple[int, ...]:
        """Draft tokens for ``req`` (an `eligible` one)'s next step, at most ``room`` (its
        share of the budget) and fewer than its output tokens left, and of host drafts only
        those its grammar takes; from a device proposer, placeholders the device fills."""
        left = req.sampling_params.max_tokens - req.num_output_tokens - 1
        most = min(self.k, room, left)
        if most <= 0:
            return ()
        drafts = self.proposer.propose(req, most)
        if not self.on_device and req.grammar is not None and drafts:  # up to the first token
            # it would not take (the device's drafts are cut when the verification reads them)
            drafts = drafts[:req.grammar.valid_prefix(drafts)]
        return tuple(drafts)

    def drafts(self, running, budget: int, waiting) -> dict:
        """Drafts for the decoding sequences among ``running`` in a step of ``budget`` tokens:
        {sequence: its draft}, or {} when the step does not speculate (too many running, or
        fewer than ``min_draft_tokens`` per eligible sequence: a step of k + 1 tokens a row for
        so few drafts costs more than it gains). Each gets an equal share of what one token
        per decode leaves of the budget (half of it while prefills run or requests wait)."""
        decodes = [q for q in running if q.num_pending_tokens == 1]
        eligible = [q for q in decodes if self.eligible(q)]
        found = {}
        if eligible and self.active(len(running)):
            spare = budget - len(decodes)
            if waiting or len(decodes) < len(running):
                spare //= 2
            found = {q: d for q in eligible if (d := self.propose(q, spare // len(decodes)))}
            if sum(map(len, found.values())) < self.config.min_drafts * len(eligible):
                found = {}
        for q in eligible:  # a look that speculates nothing counts as idle
            q.idle_looks = 0 if q in found else q.idle_looks + 1
        return found

    def looking(self, reqs) -> bool:
        """Whether some of ``reqs`` (decoding without drafts this step) may find drafts
        soon: an eligible one that found some within its last IDLE_LOOKS looks. Then a
        decode loop runs k steps only and the next one waits for the scheduler's look."""
        return self.active(len(reqs)) and any(
            self.eligible(q) and q.idle_looks < IDLE_LOOKS for q in reqs)

    def take_verified(self, scheduler, row, tokens, now: float) -> list:
        """Applies a speculating row's result to ``scheduler``'s books: ``tokens`` (what the
        row emitted: its accepted drafts, then the token the target drew) are appended until
        one ends the sequence; the pending token and the accepted drafts have KV, and the
        pages past the new last token go back (they held rejected KV). Returns the sequence
        in a list (empty if it ended before the step's results came back)."""
        req = row.request
        if req.status is not RequestStatus.RUNNING:  # aborted meanwhile
            return []
        counters, accepted = scheduler.counters, len(tokens) - 1
        counters.spec_verifications += 1
        counters.spec_draft_tokens += row.num_draft
        counters.spec_accepted_tokens += accepted
        req.num_draft_tokens += row.num_draft
        req.num_accepted_tokens += accepted
        if req.num_draft_tokens >= JUDGE_AFTER * self.k and \
                req.num_accepted_tokens < self.config.min_acceptance_rate * req.num_draft_tokens:
            req.speculating = False
        for j, token in enumerate(tokens):
            # the pending token and j accepted drafts have KV; this token is the next pending
            req.num_computed_tokens = row.start + j + 1
            if scheduler.take_token(req, token, now):
                return [req]
        keep = cdiv(len(req.token_ids), scheduler.page_size)
        if len(req.pages) > keep:
            scheduler.pins.trim(req, keep)
            scheduler.allocator.free(req.pages[keep:])
            del req.pages[keep:]
        scheduler.pins.hold(req)
        return [req]


def spec_stats(counters) -> dict:
    """The speculative-decoding fields of `EngineStats` from the scheduler's counters."""
    return dict(spec_verifications=counters.spec_verifications,
                spec_draft_tokens=counters.spec_draft_tokens,
                spec_accepted_tokens=counters.spec_accepted_tokens)
