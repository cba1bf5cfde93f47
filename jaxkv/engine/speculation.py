"""Speculative decoding's host side (plain Python, no jax): which sequences speculate in a
step, their n-gram drafts, and the books of what was accepted.

A speculating sequence runs as one row of ``1 + d`` tokens: its pending token and d draft
tokens (`ScheduledRow.num_draft`). The target step scores every position and
`jaxkv.runtime.spec_verify` keeps the longest accepted prefix of the drafts plus one token the
target draws, so the row emits between 1 and d + 1 tokens. The scheduler then rolls the
sequence back to what was accepted: its computed length, and the pages past its last token
(`Scheduler.update`). The prefix cache only ever sees accepted tokens.

Proposers:

- ``ngram`` (prompt lookup): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), in
  its prompt and output. Drafted here, on the host; a sequence with no match runs as a plain
  decode (and a step where none matches may run as a decode loop).
- ``self``: the model's first ``num_draft_layers`` layers and its LM head draft greedily on
  device (`jaxkv.runtime.steps`); the row's draft tokens are filled in there.
- ``draft_model``: a second model drafts greedily on device, the same way, over its own KV
  pool under the same page ids (`jaxkv.engine.draft_model`).

Who speculates: a decoding sequence (its prompt computed: the pending token is an output
token) with one sample stream, no logits processor, no prompt logprobs and
``SamplingParams.speculate``; in a step with at most ``disable_by_batch_size`` running
sequences; and until its acceptance rate is judged too low
(`SpeculativeConfig.min_acceptance_rate` after ``JUDGE_AFTER`` x k drafted tokens).

Structured outputs speculate too: the drafts are cut before the first token the grammar would
not take, and the verification masks each position with the grammar's state after the drafts
before it (`jaxkv.engine.spec_runner`), so every emitted token is one the grammar allows and
the target samples from the masked distribution. n-gram drafts are cut here; the device's
(``self``, ``draft_model``) are read back before the verification is dispatched, which then
waits for the draft program (only in steps with such a sequence), and the drafts cut there
count as drafted and not accepted.
"""

from __future__ import annotations

from jaxkv.config import SpeculativeConfig, cdiv
from jaxkv.engine.request import RequestStatus

JUDGE_AFTER = 4  # rounds of k drafted tokens before a sequence's acceptance is judged
IDLE_LOOKS = 4  # looks without drafts after which a sequence decodes in full loops again


def ngram_drafts(token_ids, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens of
    ``token_ids``, for the largest n in [n_min, n_max] that occurs; [] when none does."""
    ids, size = token_ids, len(token_ids)
    best, best_at = n_min - 1, -1
    for j in range(size - 2, -1, -1):  # candidate ends of an earlier occurrence, latest first
        if ids[j] != ids[-1]:
            continue
        n = 1
        while n < n_max and n <= j and ids[j - n] == ids[size - 1 - n]:
            n += 1
        if n > best:
            best, best_at = n, j + 1
            if n == n_max:
                break
    return list(ids[best_at:best_at + k]) if best_at >= 0 else []


class Speculator:
    """Proposes each step's drafts; a disabled one (no config) proposes none."""

    def __init__(self, config: SpeculativeConfig | None):
        self.config = config
        self.k = 0 if config is None else config.k
        self.on_device = config is not None and config.method in ("self", "draft_model")

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
        share of the budget) and fewer than its output tokens left, and only those its grammar
        takes; for ``self`` and ``draft_model``, placeholders the device fills."""
        left = req.sampling_params.max_tokens - req.num_output_tokens - 1
        most = min(self.k, room, left)
        if most <= 0:
            return ()
        if self.on_device:
            return (0,) * most
        c = self.config
        drafts = ngram_drafts(req.token_ids, most, c.prompt_lookup_min, c.prompt_lookup_max)
        if req.grammar is not None and drafts:  # up to the first token it would not take
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
