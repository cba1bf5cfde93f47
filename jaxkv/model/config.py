"""Model configuration: a frozen, hashable description of a decoder (Llama family, Gemma 1-3).

`ModelConfig.from_hf` reads a Hugging Face ``config.json`` (through ``transformers.AutoConfig``)
and refuses, by name, any architecture or option this implementation does not compute exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxkv.errors import CheckpointNotFoundError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                         "mixtral", "qwen3_moe", "phi3")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's `layer_types` values
_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (`rope_type` "llama3", "linear" or "longrope"), as in HF
    `rope_parameters`. LongRoPE (Phi-3): each frequency divided by its ``short_factor`` at
    positions below ``original_max_position_embeddings`` and by its ``long_factor`` from there
    on, cos and sin scaled by ``attention_factor``."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


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
    sliding_window: int | None = None  # None = full attention everywhere
    # Per layer, SLIDING or FULL (Gemma 2/3): the window applies to SLIDING layers only;
    # None: to every layer (Mistral).
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # RoPE base of SLIDING layers (Gemma 3), unscaled
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (Gemma)
    gemma_norm: bool = False  # RMSNorm scales by (1 + w), in float32 (Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norm: bool = False  # also normalize attention and MLP outputs (Gemma 2/3)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) (Gemma 2/3)
    attn_softcap: float | None = None  # attention logits -> cap * tanh(x / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits (Gemma 2)
    # Mixture of experts (Mixtral, Qwen3-MoE): each token's MLP is the weighted sum of its
    # top `num_experts_per_tok` of `num_experts` gated MLPs of width `moe_intermediate_size`.
    num_experts: int = 0  # 0: every layer has one dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model with a dense MLP (Qwen3-MoE)
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
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries "
                                 f"for {self.num_layers} layers")
            bad = sorted(set(self.layer_types) - {SLIDING, FULL})
            if bad:
                raise ValueError(f"ModelConfig.layer_types: unknown {bad}; each is "
                                 f"{SLIDING!r} or {FULL!r}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok must be in 1..{self.num_experts}, "
                             f"got {self.num_experts_per_tok}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("ModelConfig.moe_intermediate_size must be positive with experts")
        rs = self.rope_scaling
        if rs is not None and rs.rope_type not in _SUPPORTED_ROPE_TYPES[1:]:
            raise ValueError(f"ModelConfig.rope_scaling.rope_type must be one of "
                             f"{_SUPPORTED_ROPE_TYPES[1:]}, got {rs.rope_type!r}")
        if rs is not None and rs.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(rs, name)) != self.head_dim // 2:
                    raise ValueError(f"ModelConfig.rope_scaling.{name} has "
                                     f"{len(getattr(rs, name))} entries; head_dim "
                                     f"{self.head_dim} needs {self.head_dim // 2}")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"ModelConfig.dense_layers: {bad} are not layers of a "
                             f"{self.num_layers}-layer model")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"ModelConfig.hidden_act must be 'silu' or 'gelu_tanh', "
                             f"got {self.hidden_act!r}")

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through a sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it sees the whole sequence)."""
        return self.sliding_window if self.is_sliding(layer) else None

    # layers that attend through a sliding window
    num_local_layers = property(lambda self: sum(map(self.is_sliding, range(self.num_layers))))

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's window, in layer order."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def attention_options(self, layer: int) -> dict[str, Any]:
        """The keyword options of attention in layer ``layer`` (a Python int): ``sm_scale``,
        ``soft_cap`` and ``sliding_window``, as every attention function takes them."""
        return dict(sm_scale=self.sm_scale, soft_cap=self.attn_softcap,
                    sliding_window=self.layer_window(layer))

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
            path = Path(path_or_config)
            folder = path.parent if path.name == "config.json" else path
            if not (folder / "config.json").is_file():
                raise CheckpointNotFoundError(
                    f"no config.json in checkpoint folder {str(folder)!r}")
            plain = _plain_llama(folder / "config.json")
            if plain is not None:
                return _from_hf_config(plain)
            from transformers import AutoConfig

            try:
                hf = AutoConfig.from_pretrained(str(folder))
            except (ValueError, KeyError) as e:
                raise UnsupportedModelError(f"config.json in {str(folder)!r}: {e}") from e
        return _from_hf_config(hf)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` content for this config (used to save checkpoints)."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM"}[self.model_type]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**dataclasses.asdict(self.rope_scaling), "rope_theta": self.rope_theta}
            if self.rope_scaling.rope_type == "longrope":
                rope = {k: rope[k] for k in ("rope_type", "rope_theta", "factor",
                                             "original_max_position_embeddings",
                                             "attention_factor")}
                rope.update(short_factor=list(self.rope_scaling.short_factor),
                            long_factor=list(self.rope_scaling.long_factor),
                            partial_rotary_factor=1.0)
            else:
                for key in ("short_factor", "long_factor", "attention_factor"):
                    rope.pop(key)
        if self.model_type == "gemma3_text":
            local = self.rope_theta if self.local_rope_theta is None else self.local_rope_theta
            rope = {FULL: rope, SLIDING: {"rope_type": "default", "rope_theta": local}}
        eos = list(self.eos_token_ids)
        out = {
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
        if self.model_type in GEMMA_TYPES:
            del out["hidden_act"], out["rope_theta"]
            out["hidden_activation"] = "gelu_pytorch_tanh"
        if self.model_type in ("gemma2", "gemma3_text"):
            scalar = self.query_pre_attn_scalar
            out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                       attn_logit_softcapping=self.attn_softcap,
                       final_logit_softcapping=self.final_softcap,
                       sliding_window=self.sliding_window,
                       layer_types=list(self.layer_types or [FULL] * self.num_layers))
        if self.model_type in ("mistral", "mixtral", "phi3"):
            out["sliding_window"] = self.sliding_window
        if self.model_type == "phi3":  # its config's default pad id (32000) may not exist
            out["pad_token_id"] = None
        if self.model_type == "phi3" and self.rope_scaling is not None:
            out["original_max_position_embeddings"] = \
                self.rope_scaling.original_max_position_embeddings
        if self.model_type == "mixtral":
            out.update(num_local_experts=self.num_experts,
                       num_experts_per_tok=self.num_experts_per_tok,
                       intermediate_size=self.moe_intermediate_size)
        if self.model_type == "qwen3_moe":
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                       mlp_only_layers=list(self.dense_layers))
        return out


# What a Llama config.json must spell out for `_plain_llama` to read it as transformers would:
# each key whose LlamaConfig default differs from what `_from_hf_config` assumes when absent.
_LLAMA_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "max_position_embeddings")


def _plain_llama(path: Path) -> types.SimpleNamespace | None:
    """A Llama config.json read without transformers (importing its configs imports torch, most
    of a warm start), or None: then `AutoConfig` reads it. Only where nothing is left to
    transformers' defaults or checks (every key of _LLAMA_INTS an int, rms_norm_eps, the RoPE
    base, bos/eos ids, whole heads of an even width, real booleans), so both readers give the
    same config (tests/test_config.py
    compares them)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama":
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    theta = (rope or {}).get("rope_theta", raw.get("rope_theta")) \
        if isinstance(rope, dict) or rope is None else None
    ids_ok = all(key in raw and (raw[key] is None or _ints(raw[key]))
                 for key in ("bos_token_id", "eos_token_id"))
    if not (all(_ints(raw.get(key)) and not isinstance(raw.get(key), list) for key in _LLAMA_INTS)
            and isinstance(raw.get("rms_norm_eps"), (int, float))
            and isinstance(theta, (int, float)) and ids_ok
            and raw["hidden_size"] % raw["num_attention_heads"] == 0
            and all(_ints(raw.get(k)) or raw.get(k) is None
                    for k in ("num_key_value_heads", "head_dim"))
            and (raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]) % 2 == 0
            and all(isinstance(raw.get(k, False), bool)
                    for k in ("tie_word_embeddings", "attention_bias", "mlp_bias"))):
        return None
    hf = types.SimpleNamespace(**raw)
    if rope is None:  # transformers' standard form (what its configs hold)
        hf.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return hf


def _ints(value) -> bool:
    """An int (not a bool), or a non-empty list of them."""
    if isinstance(value, list):
        return bool(value) and all(_ints(v) and not isinstance(v, list) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


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
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        sandwich_norm=model_type in ("gemma2", "gemma3_text"),
        **_expert_dims(model_type, get),
    )


def _expert_dims(model_type, get) -> dict[str, int]:
    """num_experts and moe_intermediate_size of a MoE config (none for a dense one)."""
    if model_type == "mixtral":
        return dict(num_experts=int(get("num_local_experts")),
                    moe_intermediate_size=int(get("intermediate_size")))
    if model_type == "qwen3_moe" and int(get("num_experts", 0) or 0):
        step = int(get("decoder_sparse_step", 1) or 1)
        only = set(get("mlp_only_layers", None) or ())
        dense = tuple(i for i in range(int(get("num_hidden_layers")))
                      if i in only or (i + 1) % step)
        return dict(num_experts=int(get("num_experts")),
                    moe_intermediate_size=int(get("moe_intermediate_size")), dense_layers=dense)
    return {}


def count_params(shape) -> int:
    """Parameter count of a Llama-family decoder (gated MLP, RMSNorm; q/k/v biases, q/k
    norms and Gemma's post-attention/post-MLP norms when the shape has them), from any object
    with `read_dims`' fields."""
    e, h, k, d, f, v = (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                        shape.intermediate_size, shape.vocab_size)
    layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f + 2 * e
    layer += (h * d + 2 * k * d) if shape.attention_bias else 0
    layer += 2 * d if shape.qk_norm else 0
    layer += 2 * e if shape.sandwich_norm else 0
    total = v * e * (1 if shape.tie_word_embeddings else 2) + shape.num_layers * layer + e
    x, fm = getattr(shape, "num_experts", 0), getattr(shape, "moe_intermediate_size", 0)
    if x:  # MoE layers: a router and x experts in place of the dense MLP
        moe = sum(1 for i in range(shape.num_layers) if i not in getattr(shape, "dense_layers", ()))
        total += moe * (e * x + 3 * x * e * fm - 3 * e * f)
    return total


def _rope(rope: dict, hf, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of one HF rope-parameters dict; ``where`` names it in errors."""
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"{where}partial_rotary_factor={partial} is not supported "
                                    "(only 1)")
    theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"{where}rope_type {rope_type!r} is not supported; jaxkv "
                                    f"implements {_SUPPORTED_ROPE_TYPES}")
    if rope_type == "llama3":
        return theta, RopeScaling(
            rope_type="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(rope["factor"]))
    if rope_type == "longrope":
        original = int(rope.get("original_max_position_embeddings")
                       or hf.original_max_position_embeddings)
        factor = rope.get("factor") or hf.max_position_embeddings / original
        attention = rope.get("attention_factor")
        if attention is None:  # HF's default: from the context extension factor
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) /
                                                          math.log(original))
        return theta, RopeScaling(
            rope_type="longrope", factor=float(factor), original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in rope["short_factor"]),
            long_factor=tuple(float(f) for f in rope["long_factor"]),
            attention_factor=float(attention))
    return theta, None


def _gemma_options(hf, model_type: str) -> dict[str, Any]:
    """The ModelConfig fields that set Gemma 1/2/3 apart from Llama."""
    field = "hidden_act" if model_type == "gemma" else "hidden_activation"  # what HF reads
    act = getattr(hf, field, None) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{field} {act!r} is not supported on {model_type} "
                                    "(only 'gelu_pytorch_tanh')")
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention=True is not supported "
                                    "(jaxkv serves causal decoders)")
    out: dict[str, Any] = dict(hidden_act="gelu_tanh", gemma_norm=True, scale_embeddings=True)
    if model_type == "gemma":
        return out
    types = tuple(getattr(hf, "layer_types", None) or ())
    out.update(query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
               attn_softcap=getattr(hf, "attn_logit_softcapping", None),
               final_softcap=getattr(hf, "final_logit_softcapping", None),
               layer_types=types or None,
               sliding_window=getattr(hf, "sliding_window", None) if SLIDING in types else None)
    return out


def _moe_options(hf, model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of Mixtral and Qwen3-MoE configs."""
    if model_type == "mixtral":  # softmax, top-k, renormalized: softmax over the top-k
        return dict(num_experts_per_tok=int(hf.num_experts_per_tok), norm_topk_prob=True)
    if not int(getattr(hf, "num_experts", 0) or 0):
        return {}
    return dict(num_experts_per_tok=int(hf.num_experts_per_tok),
                norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)))


def _from_hf_config(hf) -> ModelConfig:
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; jaxkv implements {SUPPORTED_MODEL_TYPES}"
        )
    gemma = model_type in GEMMA_TYPES
    if not gemma and getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf.hidden_act!r} is not supported "
                                    "(only 'silu')")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    if getattr(hf, "pretraining_tp", 1) not in (None, 1):
        raise UnsupportedModelError(f"pretraining_tp={hf.pretraining_tp} is not supported")

    rope = _rope_dict(hf)
    local_theta = None
    if FULL in rope or SLIDING in rope:  # Gemma 3: a rope per layer type
        rope_theta, scaling = _rope(rope.get(FULL) or {}, hf, f"rope_parameters[{FULL!r}]: ")
        local_theta, local_scaling = _rope(rope.get(SLIDING) or {}, hf,
                                           f"rope_parameters[{SLIDING!r}]: ")
        if local_scaling is not None:
            raise UnsupportedModelError(f"rope_parameters[{SLIDING!r}]: scaled RoPE on "
                                        "sliding layers is not supported")
    else:
        rope_theta, scaling = _rope(rope, hf, "")

    options: dict[str, Any] = {}
    if gemma:
        options = _gemma_options(hf, model_type)
    elif model_type in ("mistral", "mixtral", "phi3", "qwen3_moe"):
        # (Qwen3-MoE's config keeps its window only with use_sliding_window, for every layer)
        options = dict(sliding_window=getattr(hf, "sliding_window", None))
    elif getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"use_sliding_window=True on {model_type} (per-layer windows) is not supported"
        )
    if model_type in ("mixtral", "qwen3_moe"):
        options.update(_moe_options(hf, model_type))
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))

    def get(key, default=REQUIRED):
        return getattr(hf, key) if default is REQUIRED else getattr(hf, key, default)

    return ModelConfig(
        **read_dims(get),
        **options,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta if local_theta != rope_theta or scaling else None,
        max_position_embeddings=hf.max_position_embeddings,
        model_type=model_type,
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=tuple(int(i) for i in eos_ids),
    )
