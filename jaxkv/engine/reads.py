"""What a dispatched program hands back for the host to read later: a `TokenRead` (one step's
tokens) and a `LoopRun` (a decode loop: its rows, the host's view of their inputs, and the
inputs of its continuation)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from jaxkv.engine.plan import SchedulerOutput
from jaxkv.runtime.steps import DecodeLoopBatch


@dataclasses.dataclass(frozen=True)
class TokenRead:
    """Reads a dispatched program's tokens back: () -> (kind, tokens per row), kind "step"
    or "loop". ``version``: the weights it was dispatched with, which sampled those tokens
    (`Engine.update_params`)."""

    fn: Callable[[], tuple[str, list]]
    version: int | str
    tokens: object = None  # the device arrays it reads (`ready` looks at them)

    def __call__(self) -> tuple[str, list]:
        return self.fn()

    def ready(self) -> bool:
        """True once the program has produced its tokens (reading them will not wait)."""
        return all(x.is_ready() for x in jax.tree.leaves(self.tokens))


@dataclasses.dataclass
class LoopRun:
    """A dispatched decode loop: its rows, the host's view of their inputs, its outputs."""

    plan: SchedulerOutput  # the plan whose decode rows it runs
    starts: list[int]  # position of each row's pending token at the loop's start
    limits: list[int]  # tokens each row may sample in it
    generated: list[int]  # output tokens of each row at its start
    table: np.ndarray  # i32[R, W]: the page table it was given (host)
    after: DecodeLoopBatch  # device: the inputs of a continuation
    read: TokenRead  # () -> ("loop", tokens per row)
    chained: int = 0  # loops dispatched before it without the scheduler (`launch.chain`)
