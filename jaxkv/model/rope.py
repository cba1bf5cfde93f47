"""Rotary position embeddings, computed as Hugging Face computes them (float32, half-rotation)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxkv.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, *, local: bool = False) -> np.ndarray:
    """f32[D/2] inverse frequencies, with Llama-3 or linear scaling applied if configured.
    ``local``: those of sliding-window layers with a base of their own (Gemma 3's
    ``local_rope_theta``, never scaled)."""
    d = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv = inv.astype(np.float32)
    rs = None if local else config.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "longrope":  # the short factors; `rope_tables` switches to the long ones
        return (inv / np.asarray(rs.short_factor, np.float32)).astype(np.float32)
    if rs.rope_type == "linear":
        return (inv / rs.factor).astype(np.float32)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old = rs.original_max_position_embeddings
    low_wavelen = old / rs.low_freq_factor
    high_wavelen = old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(config: ModelConfig, positions_t, *, local: bool = False):
    """cos, sin f32[T, D] of each position under ``config``'s RoPE (``local``: the base of
    sliding-window layers). LongRoPE takes each token's factors from its own position: short
    below ``original_max_position_embeddings``, long from there on, so a token's KV depends on
    its position only. transformers' model stepped with its cache computes the same; a
    forward whose sequence is longer than that uses the long factors at every position (its
    `generate` recomputes the cache once at the crossing), and vLLM switches per batch: for a
    prompt longer than the original context, jaxkv's early keys differ from theirs."""
    rs = None if local else config.rope_scaling
    cos, sin = rope_cos_sin(positions_t, inverse_frequencies(config, local=local))
    if rs is None or rs.rope_type != "longrope":
        return cos, sin
    base = inverse_frequencies(dataclasses.replace(config, rope_scaling=None))
    long_cos, long_sin = rope_cos_sin(positions_t, (base / np.asarray(
        rs.long_factor, np.float32)).astype(np.float32))
    far = (positions_t >= rs.original_max_position_embeddings)[:, None]
    scale = jnp.float32(rs.attention_factor)
    return (jnp.where(far, long_cos, cos) * scale, jnp.where(far, long_sin, sin) * scale)


def rope_cos_sin(positions_t, inv_freq):
    """cos, sin of shape f32[T, D] for integer positions."""
    freqs = positions_t.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_thd, cos_td, sin_td):
    """Rotates [T, heads, D] by the angles of each token (HF's rotate_half convention)."""
    half = x_thd.shape[-1] // 2
    x1, x2 = x_thd[..., :half], x_thd[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_td[:, None, :], sin_td[:, None, :]
    return (x_thd.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x_thd.dtype)
