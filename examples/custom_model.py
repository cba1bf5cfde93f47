"""A decoder jaxkv does not ship, served by jaxkv's engine: GPT-J-style parallel blocks
(attention and MLP read the same LayerNorm output), learned absolute positions, GELU MLP.

The protocol (docs/MODELS.md#bring-your-own-model): an NNX module with a ``config``
(`jaxkv.ModelConfig`: the KV shape and attention options), a compute ``dtype``,
``__call__(tokens, positions, attention, carry) -> (hidden, carry)`` that calls
``attention(layer, q, k, v, carry)`` once per layer, and ``logits(hidden)``.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import jaxkv


class ParallelBlockLM(nnx.Module):
    def __init__(self, config: jaxkv.ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        c, init = config, nnx.initializers.normal(0.2)
        self.config, self.dtype = c, dtype
        e, h, k, d, f = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                         c.intermediate_size)
        self.embed = nnx.Param(init(rngs.params(), (c.vocab_size, e)))
        self.positions = nnx.Param(init(rngs.params(), (c.max_position_embeddings, e)))
        self.blocks = nnx.List([nnx.Dict(
            norm=nnx.LayerNorm(e, rngs=rngs), wq=nnx.Linear(e, h * d, rngs=rngs),
            wkv=nnx.Linear(e, 2 * k * d, rngs=rngs), wo=nnx.Linear(h * d, e, rngs=rngs),
            up=nnx.Linear(e, f, rngs=rngs), down=nnx.Linear(f, e, rngs=rngs))
            for _ in range(c.num_layers)])
        self.final_norm = nnx.LayerNorm(e, rngs=rngs)
        self.head = nnx.Param(init(rngs.params(), (e, c.vocab_size)))

    def __call__(self, tokens, positions, attention, carry):
        c, t = self.config, tokens.shape[0]
        x = self.embed[...][tokens] + self.positions[...][positions]
        for i, b in enumerate(self.blocks):
            h = b["norm"](x)
            q = b["wq"](h).reshape(t, c.num_heads, c.head_dim)
            k, v = jnp.split(b["wkv"](h).reshape(t, 2 * c.num_kv_heads, c.head_dim), 2, axis=1)
            out, carry = attention(i, q, k, v, carry)  # jaxkv: paged K/V, written and read
            x = x + b["wo"](out.reshape(t, -1)) + b["down"](jax.nn.gelu(b["up"](h)))
        return self.final_norm(x), carry

    def logits(self, hidden):
        return (hidden @ self.head[...]).astype(jnp.float32)


def build(seed: int = 0) -> jaxkv.Model:
    """A small random instance, wrapped for `jaxkv.LLM` / `jaxkv.Engine`."""
    config = jaxkv.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=256,
                               num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                               max_position_embeddings=512, eos_token_ids=(2,))
    return jaxkv.Model.from_module(ParallelBlockLM(config, rngs=nnx.Rngs(seed)))


if __name__ == "__main__":
    llm = jaxkv.LLM(build(), max_model_len=256)
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]],
                       sampling_params=jaxkv.SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].token_ids)
