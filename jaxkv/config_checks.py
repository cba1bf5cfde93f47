"""The checks every config dataclass runs on its fields, and the choices they take (no jax)."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable, Sequence

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
QUANTIZATIONS = ("none", "int8", "int8-g32", "int4", "int4-g32", "int4-g64", "int4-g128",
                 "gguf")
ATTENTION_IMPLS = ("auto", "reference", "pallas", "interpret", "interpret-tpu", "pallas-gpu",
                   "pallas-tpu")
MODEL_DTYPES = ("auto", "float32", "bfloat16")


def positive(owner: str, name: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")


def power_of_two(label: str, value, why: str = "") -> None:
    """ValueError unless ``value`` is an int power of two (the page-size rule of every
    attention kernel); the message names ``label`` and ends with ``why``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1 \
            or value & (value - 1):
        raise ValueError(f"{label} must be a power of two, got {value!r}{why}")


def one_of(owner: str, name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {', '.join(map(repr, choices))}, got "
                         f"{value!r}")


def nearest_name(key: str, known: Iterable[str]) -> str:
    """The error for an unknown setting: its name and the nearest known one."""
    known = sorted(known)
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"unknown setting {key!r}{hint} (settings: {', '.join(known)})"
