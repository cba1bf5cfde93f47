"""Tiny random Hugging Face models, saved as offline checkpoints, for oracle tests.

Each spec builds a `transformers` PyTorch model (fp32) of a supported family, perturbs every
weight (HF initializes biases to zero and norm weights to one, which would hide those code
paths), and writes it with ``save_pretrained`` so jaxkv loads it like any downloaded checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxkv.attention import dense_attention

# Tiny models gain nothing from intra-op threads, and on a small shared CI machine torch's
# thread pool contends with XLA's (a 64-token `generate` went from ~0.25 s to 3-7 s).
torch.set_num_threads(1)

# initializer_range 0.1 (HF default 0.02): sharper logits, so 64 greedy tokens wander instead of
# repeating one token, and top-2 logit gaps stay far above fp32 rounding differences.
_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2)

PHI3_ROPE = dict(rope_type="longrope", rope_theta=10000.0,
                 short_factor=[1.0 + 0.1 * i for i in range(8)],
                 long_factor=[1.0 + 0.5 * i for i in range(8)],
                 original_max_position_embeddings=256)

# name -> (HF config class, overrides of _SMALL)
SPECS: dict[str, tuple[type, dict]] = {
    "llama_mha": (transformers.LlamaConfig, dict(num_key_value_heads=4)),
    # 4 query heads per kv head here; Qwen2/Qwen3/Mistral below use 2.
    "llama_gqa": (transformers.LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama_mqa": (transformers.LlamaConfig, dict(num_key_value_heads=1)),
    "llama3_rope": (transformers.LlamaConfig, dict(
        num_key_value_heads=2,
        rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64,
                             rope_theta=500000.0),
    )),
    "qwen2": (transformers.Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=32)),
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
    "mistral_swa": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=16)),
    # Gemma: head_dim 32 (not hidden / heads), GeGLU, (1 + w) norms, scaled embeddings.
    "gemma": (transformers.GemmaConfig, dict(num_key_value_heads=1, head_dim=32)),
    # Gemma 2: soft caps small enough to bite on these logits (the real ones are 50 and 30),
    # a query scale other than head_dim, local/global alternation over 3 layers. Gemma 2 and 3
    # untie the LM head: on tiny random weights the tied head, reading the sqrt(E)-scaled
    # embedding still in the residual stream, repeats the last token (greedy loops in 1-2
    # tokens); the tied head is checked on "gemma".
    "gemma2": (transformers.Gemma2Config, dict(tie_word_embeddings=False,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=3, sliding_window=16,
        query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # Gemma 3: q/k norms, two local layers then a global one (the real pattern is 5:1), the
    # local RoPE base 10k and a linearly scaled global base 1M, no soft caps.
    "gemma3": (transformers.Gemma3TextConfig, dict(tie_word_embeddings=False,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=3, sliding_window=16,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "sliding_attention",
                                               "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0,
                                                rope_theta=1_000_000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10_000.0)})),
    # Phi-3: fused qkv and gate_up projections, a window on every layer, LongRoPE (short
    # factors and the attention factor of a 2x context extension; `phi3_rope` crosses the
    # original context to the long factors).
    "phi3": (transformers.Phi3Config, dict(
        num_key_value_heads=2, sliding_window=48, pad_token_id=0,
        original_max_position_embeddings=256, rope_parameters=PHI3_ROPE)),
    # Mixtral: top-2 of 4 experts, renormalized.
    "mixtral": (transformers.MixtralConfig, dict(num_key_value_heads=2, num_local_experts=4,
                                                 num_experts_per_tok=2, sliding_window=None)),
    # Qwen3-MoE: top-3 of 8 narrower experts, not renormalized, q/k norms, and layer 1 dense
    # (mlp_only_layers) between two MoE layers. Init 0.2: at 0.1 the greedy reply to the
    # 128-token prompt loops over 3 tokens.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        initializer_range=0.2, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1])),
}


def hf_config(name: str):
    """The HF config of spec `name`."""
    cls, overrides = SPECS[name]
    return cls(**{**_SMALL, **overrides})


def build_hf_model(name: str, *, seed: int = 0, noise: float = 0.02, **overrides):
    """An fp32 HF causal LM of spec `name` (config fields changed by ``overrides``) with every
    weight perturbed, in eval mode."""
    torch.manual_seed(seed)
    config = hf_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"  # the plainest reference math
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # tied parameters appear once, so they stay tied
            p.add_(torch.randn_like(p) * noise)
    return model.eval()


def save_hf_model(model, folder: str | Path, **kwargs) -> Path:
    """Writes `model` as a safetensors checkpoint folder and returns it."""
    folder = Path(folder)
    model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
    return folder


def hf_logits(hf, ids) -> np.ndarray:
    """f32[T, V] logits of every position of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def dense_logits(model, ids, config=None) -> np.ndarray:
    """f32[T, V] jaxkv logits of every position, with dense causal attention (no pages)."""
    module = model.module()
    if config is not None:  # the same weights, computed with some option switched off
        module.config = config
    c = module.config

    tokens = jnp.asarray(ids, jnp.int32)
    hidden, _ = module(tokens, jnp.arange(len(ids), dtype=jnp.int32), dense_attention(c), None)
    return np.asarray(module.logits(hidden))
