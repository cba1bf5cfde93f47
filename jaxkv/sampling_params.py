"""SamplingParams: how one request samples, with vLLM's field names and meanings."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options; invalid values raise ValueError naming the field.

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 disables top-k; ``top_p=1`` disables
    nucleus sampling. ``seed=None`` lets the caller derive a reproducible seed from the
    request's index. Stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) end a
    sequence and are included in its token ids, once ``min_tokens`` have been generated.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        def fail(field, value, why):
            raise ValueError(f"SamplingParams.{field}={value!r}: {why}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            fail("n", self.n, "must be an int >= 1")
        t = self.temperature
        if not is_real(t) or t < 0:
            fail("temperature", t, "must be a finite number >= 0 (0 means greedy)")
        p = self.top_p
        if not is_real(p) or not 0 < p <= 1:
            fail("top_p", p, "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", self.top_k, "must be an int >= -1 (0 or -1 disables top-k)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", self.max_tokens, "must be an int >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", self.min_tokens, "must be an int in [0, max_tokens]")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            fail("seed", self.seed, "must be None or an int >= 0")
        if isinstance(self.stop_token_ids, (str, bytes, int)):
            fail("stop_token_ids", self.stop_token_ids, "must be a sequence of token ids")
        stop = tuple(self.stop_token_ids or ())
        if any(not is_int(i) or i < 0 for i in stop):
            fail("stop_token_ids", self.stop_token_ids, "must be non-negative ints")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", self.ignore_eos, "must be a bool")
        object.__setattr__(self, "stop_token_ids", stop)

    def finish_reason(self, token: int, num_generated: int, eos_token_ids) -> str | None:
        """Why a sequence ends after sampling `token` as its `num_generated`-th output token:
        "stop" (a stop token, once min_tokens are out), "length" (max_tokens), or None."""
        stop = token in self.stop_token_ids or (token in eos_token_ids and not self.ignore_eos)
        if stop and num_generated >= self.min_tokens:
            return "stop"
        return "length" if num_generated >= self.max_tokens else None
