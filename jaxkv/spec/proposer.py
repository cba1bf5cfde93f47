"""`Proposer`: what one speculation method does (no jax here; a method's device parts are
imported by its own module).

The host side (`jaxkv.spec.speculator`) decides which sequences speculate and how many
drafts each may have; the proposer says what they are: tokens found on the host (``ngram``),
or placeholders that a device program fills in the same step (``self``, ``draft_model``). What
a method needs on the device it builds for the runner: a draft program in the target's own
steps (`draft_program`), or a drafter with its own weights and KV pool (`drafter`).
"""

from __future__ import annotations


class Proposer:
    """A speculation method (one subclass per method, registered in `jaxkv.spec.methods`)."""

    on_device = False
    """Whether the drafts come from a device program (the host plans placeholders)."""
    reads_every_position = False
    """Whether its drafter keeps every position's K/V of its own (then local layers keep
    every page too: window-only KV is off)."""

    def __init__(self, config):
        self.config = config  # the SpeculativeConfig
        self.k = config.k

    def load(self, target, *, on_host: bool = False):
        """The config with whatever the method loads before engines are built (once, for
        every engine of an `LLM`); by default the config as is."""
        return self.config

    def propose(self, req, most: int) -> tuple[int, ...]:
        """Up to ``most`` (>= 1) draft tokens for ``req``'s next step (host drafts), or the
        placeholders a device program fills."""
        raise NotImplementedError

    def draft_program(self, model_config) -> tuple[int, int] | None:
        """(k, layers) of a draft that the target's own steps run (its first layers), or
        None."""
        return None

    def drafter(self, runner, max_model_len: int):
        """The device drafter with weights and a KV pool of its own, for ``runner``, or
        None."""
        return None


class DeviceProposer(Proposer):
    """A method whose drafts a device program writes into the step's tokens."""

    on_device = True

    def propose(self, req, most: int) -> tuple[int, ...]:
        return (0,) * most
