"""Model configuration: a frozen, hashable description of a Llama-family decoder.

`ModelConfig.from_hf` reads a Hugging Face ``config.json`` (through ``transformers.AutoConfig``)
and refuses, by name, any architecture or option this implementation does not compute exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxkv.errors import CheckpointNotFoundError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (`rope_type` "llama3" or "linear"), as in HF `rope_parameters`."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a decoder. Field names follow the HF config where they exist."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # every layer (Mistral); None = full attention
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def num_params(self) -> int:
        """Parameter count, for memory planning and model cards."""
        return count_params(self)

    @classmethod
    def bench(cls, num_layers: int = 12, hidden_size: int = 768) -> ModelConfig:
        """The benchmarks' model: ~110M params at the defaults (GPT-2-small-like Llama, fp32
        in use, vocab 32,000, tied embeddings, MHA with 64-wide heads). Smaller `num_layers`
        and `hidden_size` shrink it for quick runs, keeping the MLP at 8/3 of the width."""
        heads = max(1, hidden_size // 64)
        return cls(vocab_size=32000, hidden_size=hidden_size,
                   intermediate_size=2048 * hidden_size // 768, num_layers=num_layers,
                   num_heads=heads, num_kv_heads=heads, head_dim=hidden_size // heads,
                   tie_word_embeddings=True, max_position_embeddings=2048)

    @classmethod
    def from_hf(cls, path_or_config: str | Path | Any) -> ModelConfig:
        """Builds a config from a checkpoint folder, a config.json path, or an HF config."""
        hf = path_or_config
        if isinstance(path_or_config, (str, Path)):
            from transformers import AutoConfig

            path = Path(path_or_config)
            folder = path.parent if path.name == "config.json" else path
            if not (folder / "config.json").is_file():
                raise CheckpointNotFoundError(
                    f"no config.json in checkpoint folder {str(folder)!r}")
            try:
                hf = AutoConfig.from_pretrained(str(folder))
            except (ValueError, KeyError) as e:
                raise UnsupportedModelError(f"config.json in {str(folder)!r}: {e}") from e
        return _from_hf_config(hf)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` content for this config (used to save checkpoints)."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**dataclasses.asdict(self.rope_scaling), "rope_theta": self.rope_theta}
        eos = list(self.eos_token_ids)
        return {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        }


def _rope_dict(hf) -> dict[str, Any]:
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    return dict(rope)


REQUIRED = object()


def read_dims(get: Callable[..., Any]) -> dict[str, Any]:
    """The dimensions of an HF ``config.json`` that shapes and memory depend on, read through
    ``get(key, default)`` (``get(key)`` for a required key): the one reader behind
    `ModelConfig.from_hf` and the memory calculator's `ModelShape.from_hf_config`."""
    model_type = get("model_type", None)
    num_heads, hidden = int(get("num_attention_heads")), int(get("hidden_size"))
    return dict(
        num_layers=int(get("num_hidden_layers")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_heads=num_heads,
        num_kv_heads=int(get("num_key_value_heads", None) or num_heads),
        head_dim=int(get("head_dim", None) or hidden // num_heads),
        vocab_size=int(get("vocab_size")),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
    )


def count_params(shape) -> int:
    """Parameter count of a Llama-family decoder (gated MLP, RMSNorm; q/k/v biases and q/k
    norms when the shape has them), from any object with `read_dims`' fields."""
    e, h, k, d, f, v = (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                        shape.intermediate_size, shape.vocab_size)
    layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f + 2 * e
    layer += (h * d + 2 * k * d) if shape.attention_bias else 0
    layer += 2 * d if shape.qk_norm else 0
    return v * e * (1 if shape.tie_word_embeddings else 2) + shape.num_layers * layer + e


def _from_hf_config(hf) -> ModelConfig:
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; jaxkv implements {SUPPORTED_MODEL_TYPES}"
        )
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    if getattr(hf, "pretraining_tp", 1) not in (None, 1):
        raise UnsupportedModelError(f"pretraining_tp={hf.pretraining_tp} is not supported")

    rope = _rope_dict(hf)
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported (only 1)")
    rope_theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; jaxkv implements {_SUPPORTED_ROPE_TYPES}"
        )
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            rope_type="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(rope["factor"]))

    sliding_window = None
    if model_type == "mistral":
        sliding_window = getattr(hf, "sliding_window", None)
    elif getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"use_sliding_window=True on {model_type} (per-layer windows) is not supported"
        )
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))

    def get(key, default=REQUIRED):
        return getattr(hf, key) if default is REQUIRED else getattr(hf, key, default)

    return ModelConfig(
        **read_dims(get),
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.max_position_embeddings,
        sliding_window=sliding_window,
        model_type=model_type,
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=tuple(int(i) for i in eos_ids),
    )
