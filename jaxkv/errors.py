"""The error types jaxkv raises for bad input; every one is a ValueError.

Each message names the offending field (or tensor, or file) and the value it got, so a caller
can catch ``ValueError`` at its API edge and report the message as is.
"""

from __future__ import annotations


class FieldError(ValueError):
    """A request field jaxkv refuses or cannot read; ``field`` names it (the server's 400
    carries it as ``param``)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


class UnsupportedModelError(ValueError):
    """A checkpoint asks for an architecture or option jaxkv does not implement."""


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match its config (missing, unexpected, wrong shape)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint folder, or a file it must contain, does not exist."""


class KVStateError(ValueError):
    """A PagedKVState whose fields do not have the required shapes or dtypes."""
