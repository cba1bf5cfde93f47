"""Per-request sampling on device: greedy, temperature, top-k, top-p.

Each row carries its own PRNG key and step counter; the key used at a step is
``fold_in(key, step)``, so a request's samples depend only on its own seed and position,
never on which other requests share the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingArrays:
    temperature: jax.Array  # f32[B]  0 means greedy
    top_k: jax.Array  # i32[B]  <= 0 means disabled
    top_p: jax.Array  # f32[B]  1 means disabled
    step: jax.Array  # i32[B]  tokens generated so far by the row's request

    @classmethod
    def build(cls, temperature, top_k, top_p, step, rows: int) -> SamplingArrays:
        """Host builder: pads lists to `rows` entries (padding rows are greedy)."""
        def pad(values, dtype, fill):
            out = np.full(rows, fill, dtype)
            out[:len(values)] = values
            return out

        return cls(pad(temperature, np.float32, 0.0), pad(top_k, np.int32, 0),
                   pad(top_p, np.float32, 1.0), pad(step, np.int32, 0))


def request_key(seed: int, sample_index: int = 0) -> np.ndarray:
    """The raw u32[2] base key of sample `sample_index` of a request seeded with `seed`."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), sample_index)
    return np.asarray(jax.random.key_data(key), np.uint32)


def _sample_row(logits_v, key, temperature, top_k, top_p, step):
    key = jax.random.fold_in(key, step)
    scaled = logits_v / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_v = scaled[order]
    rank = jnp.arange(sorted_v.shape[0])
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_v, -jnp.inf))
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    keep &= (jnp.cumsum(probs) - probs) < top_p
    choice = jax.random.categorical(key, jnp.where(keep, sorted_v, -jnp.inf))
    sampled = order[choice]
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits_v)).astype(jnp.int32)


@jax.jit
def sample(logits, keys, sampling: SamplingArrays):
    """i32[B] next tokens from f32[B, V] logits; ``keys`` are raw u32[B, 2] PRNG keys."""
    def stochastic():
        return jax.vmap(_sample_row)(logits, keys, sampling.temperature, sampling.top_k,
                                     sampling.top_p, sampling.step)

    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    # An all-greedy batch skips the per-row vocabulary sort.
    return jax.lax.cond(jnp.any(sampling.temperature > 0), stochastic, greedy)
