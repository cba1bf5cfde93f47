"""The speculation methods jaxkv knows, as data: what `SpeculativeConfig` checks for each and
where its proposer lives (no jax: the config and the scheduler read this). A new method is one
entry here and one proposer module in `jaxkv.spec`; nothing else compares method names."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Method:
    """One speculation method."""

    name: str
    default_k: int
    """Draft tokens per sequence per step when num_speculative_tokens is not given."""
    own_fields: tuple[str, ...] = ()
    """SpeculativeConfig settings only this method reads (set for another: an error)."""
    needs_one_of: tuple[str, ...] = ()
    """Settings of which this method needs at least one."""
    needs: str = ""
    """What the error says the method needs when none of those is set."""
    proposer: str = ""
    """``module:Class`` of its `jaxkv.spec.Proposer`, imported when an engine builds it."""


METHODS = {m.name: m for m in (
    # ngram's k + 1 = 8 tokens cost a CPU step what 5 do; the device drafts run one by one
    Method("ngram", 7, proposer="jaxkv.spec.ngram:NgramProposer"),
    Method("self", 3, own_fields=("num_draft_layers",),
           proposer="jaxkv.spec.self_draft:SelfDraftProposer"),
    Method("draft_model", 3, own_fields=("model", "quantization"),
           needs_one_of=("model", "quantization"),
           needs="a model (or a quantization, to draft with a quantized copy of the target)",
           proposer="jaxkv.spec.draft_model:DraftModelProposer"),
)}
