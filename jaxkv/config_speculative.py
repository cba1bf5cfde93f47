"""`SpeculativeConfig`: speculative decoding's settings (`jaxkv.spec`), part of
`SchedulerConfig` (no jax)."""

from __future__ import annotations

import dataclasses
import json

from jaxkv.config_checks import QUANTIZATIONS, nearest_name, one_of, positive
from jaxkv.spec.methods import METHODS

SPECULATIVE_METHODS = tuple(METHODS)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`jaxkv.spec`): a cheap proposer drafts up to
    ``num_speculative_tokens`` tokens per decoding sequence and one target step verifies them
    (exact rejection sampling: outputs are distributed as without speculation)."""

    method: str = "ngram"
    """ngram: the continuation of the latest earlier match of the sequence's last n tokens
    (prompt lookup, on the host); self: the model's first num_draft_layers layers and its LM
    head draft greedily on device (no extra weights); draft_model: a smaller model (``model``)
    or a quantized copy of the target (``quantization`` alone) drafts greedily on device, over
    its own KV pool under the target's page ids."""
    num_speculative_tokens: int | None = None
    """Draft tokens per sequence per step (k): one step emits up to k + 1 tokens (default:
    7 for ngram, whose k + 1 = 8 tokens cost a CPU step what 5 do; 3 for self and
    draft_model, whose drafts run one after another)."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix matched."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix matched (longer matches are tried first)."""
    num_draft_layers: int | None = None
    """self: layers of the draft (default: half the model's)."""
    model: object = None
    """draft_model: the draft, as `LLM`'s ``model`` takes it (a checkpoint folder, a .gguf
    file, "smollm2" or a `jaxkv.Model`) with the target's vocabulary; None: the target
    itself, quantized as ``quantization`` says (and again by `Engine.update_params`)."""
    quantization: str | None = None
    """draft_model: the draft's weights quantized so (int8, int4, ... as
    ``RuntimeConfig.quantization``)."""
    disable_by_batch_size: int | None = 2
    """No speculation in a step with more running sequences than this (None: never off).
    On a 2-core CPU, n-gram speculation stops paying between 2 and 4 sequences (`jaxkv
    bench spec`); GPUs and TPUs, whose steps cost about the same for 8 tokens a row as for
    one, may raise it."""
    min_draft_tokens: int | None = None
    """A step speculates only if its decoding sequences drafted at least this many tokens
    each on average (a step of k + 1 tokens a row costs more than a few drafts gain on CPU);
    default: 2, or k if less."""
    min_acceptance_rate: float = 0.1
    """A sequence stops speculating once 4 * k of its drafts are verified and fewer than this
    fraction were accepted."""

    def __post_init__(self):
        name = type(self).__name__
        one_of(name, "method", self.method, SPECULATIVE_METHODS)
        positive(name, "num_speculative_tokens", self.num_speculative_tokens, optional=True)
        for field in ("prompt_lookup_min", "prompt_lookup_max"):
            positive(name, field, getattr(self, field))
        method = METHODS[self.method]
        for other in METHODS.values():  # a setting of another method
            for field in other.own_fields:
                if other is not method and getattr(self, field) is not None:
                    raise ValueError(f"{name}.{field} is for method {other.name!r}, not "
                                     f"{self.method!r}")
        if method.needs_one_of and all(getattr(self, f) is None for f in method.needs_one_of):
            raise ValueError(f"{name}.{method.needs_one_of[0]}: method {self.method!r} "
                             f"needs {method.needs}")
        if self.quantization is not None:
            one_of(name, "quantization", self.quantization, QUANTIZATIONS[1:])
        for field in ("num_draft_layers", "disable_by_batch_size"):
            positive(name, field, getattr(self, field), optional=True)
        m = self.min_drafts
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= self.k:
            raise ValueError(f"{name}.min_draft_tokens must be an int in [0, k={self.k}] "
                             f"(num_speculative_tokens), got {m!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{name}.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        r = self.min_acceptance_rate
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 <= r <= 1:
            raise ValueError(f"{name}.min_acceptance_rate must be in [0, 1], got {r!r}")

    @property
    def min_drafts(self) -> int:
        """min_draft_tokens, or its default."""
        m = self.min_draft_tokens
        return min(2, self.k) if m is None else m

    @property
    def k(self) -> int:
        """num_speculative_tokens, or the method's default."""
        n = self.num_speculative_tokens
        return n if n is not None else METHODS[self.method].default_k

    @classmethod
    def of(cls, value) -> SpeculativeConfig | None:
        """A config from None, a SpeculativeConfig, a dict of its fields, or their JSON (the
        CLI's); ValueError naming an unknown field."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON ({e}): {value!r}") from None
            if value is None:  # "null": off
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict of SpeculativeConfig fields "
                             f"(or its JSON), got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = [k for k in value if k not in known]
        if bad:
            raise ValueError(f"speculative_config: {nearest_name(bad[0], known)}")
        return cls(**value)
