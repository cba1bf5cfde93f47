"""Speculative decoding: a cheap proposer drafts tokens, one target step verifies them.

- `methods`: the methods as data (what the config checks, where each proposer lives);
- `proposer`: the `Proposer` protocol, with one module per method: `ngram`, `self_draft`,
  `draft_model`; `proposer_for` builds the one a `SpeculativeConfig` names;
- `speculator`: the host's policy (no jax): which sequences speculate in a step, with how
  many drafts, and the books of what was accepted;
- the device's verification is `jaxkv.engine.spec_runner` (the runner's half) and
  `jaxkv.runtime.spec_verify` (the rule).

A speculating sequence runs as one row of ``1 + d`` tokens: its pending token and d draft
tokens (`ScheduledRow.num_draft`). The target step scores every position and
`jaxkv.runtime.spec_verify` keeps the longest accepted prefix of the drafts plus one token the
target draws, so the row emits between 1 and d + 1 tokens. The scheduler then rolls the
sequence back to what was accepted: its computed length, and the pages past its last token
(`Scheduler.update`). The prefix cache only ever sees accepted tokens.

Proposers: ``ngram`` (prompt lookup, on the host), ``self`` (the model's first layers, on
device), ``draft_model`` (a second model over its own KV pool under the same page ids).

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

import importlib
from typing import TYPE_CHECKING

from jaxkv.spec.methods import METHODS  # (all the config imports: plain data)

if TYPE_CHECKING:
    from jaxkv.spec.proposer import Proposer


def proposer_for(config) -> Proposer | None:
    """The proposer of ``config`` (a SpeculativeConfig; None: no speculation, None)."""
    if config is None:
        return None
    module, _, name = METHODS[config.method].proposer.partition(":")
    return getattr(importlib.import_module(module), name)(config)
