"""Llama-family decoder in Flax NNX, applied to a flat batch of tokens: Llama, Mistral, Qwen2,
Qwen3, and Gemma 1/2/3 (their differences are `ModelConfig` fields: (1 + w) norms, scaled
embeddings, GeGLU, post-attention/post-MLP norms, logit soft caps, per-layer windows and RoPE).

Axes: T tokens (ragged sequences flattened), E hidden, F MLP hidden, V vocab, L layers,
H query heads, K kv heads, D head_dim.

The model does not know how attention reads its context: the caller passes an
``attention(layer, q_thd, k_tkd, v_tkd, carry) -> (out_thd, carry)`` function. The paged runtime
writes K/V into pages carried through the layer scan; training and the no-cache baseline use
dense causal attention. Layer weights are stacked on a leading L axis and applied with
``jax.lax.scan``, so compile time does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.errors import UnsupportedModelError
from jaxkv.model.config import ModelConfig
from jaxkv.model.moe import moe_mlp
from jaxkv.model.quant import (
    QuantScheme,
    embed_lookup,
    embedding_logits,
    is_quantized,
    placeholder_embedding,
    placeholder_weight,
    qdot,
)
from jaxkv.model.quant import table_rows as default_table_rows
from jaxkv.model.rope import apply_rope, rope_tables

# attention(layer, q, k, v, carry) -> (out, carry). ``layer`` is a Python int with unrolled
# layers whose attention says ``static_layers = True`` (or whose windows differ), else traced.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
LINEAR = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # quantizable [in, out] weights


def rms_norm(x, weight, eps: float, gemma: bool = False):
    """HF RMSNorm: normalize in float32, cast back, then scale. ``gemma``: scale by (1 + w) in
    float32, then cast (HF's GemmaRMSNorm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if gemma:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def gated_activation(x, kind: str):
    """The gate's activation: SiLU (Llama) or tanh-approximated GELU (Gemma's GeGLU)."""
    return jax.nn.silu(x) if kind == "silu" else jax.nn.gelu(x, approximate=True)


def default_scan_layers(config: ModelConfig, platform: str) -> bool:
    """Whether layers are stacked and scanned by default: on GPU and TPU (compile time flat in
    depth), except for mixtures of experts and models with local (sliding-window) layers. XLA
    copies a scanned layer's slice of the stacked expert weights before each grouped matmul
    (ragged_dot cannot read a slice in place: 768 MiB per Qwen3-30B-A3B layer on v6e,
    tests/aot), so MoE layers stay unrolled and are read where they are. Local layers keep only
    their window's KV in a pool of their own (`jaxkv.cache.window`), which each layer must pick
    statically. On CPU layers are unrolled (see `DecoderLayers`)."""
    w = config.sliding_window  # (Phi-3.5's 262144 reaches past its context: no local layer)
    local = w is not None and w < config.max_position_embeddings and config.num_local_layers
    return platform != "cpu" and not config.num_experts and not local


class DecoderLayers(nnx.Module):
    """All L decoder layers' weights, by name.

    Stacked (``scan=True``): one Param per name with a leading L axis, applied with
    ``jax.lax.scan`` so compile time does not grow with depth (the layout for GPU and TPU, where
    XLA fuses the per-layer slice into the matmul). Unstacked (``scan=False``): a list of L
    Params per name, applied by a Python loop; XLA:CPU copies every sliced weight before its
    matmul, which made scanned decode ~3-4x slower there, so this is the CPU default.
    """

    def __init__(self, config: ModelConfig, *, scan: bool, param_dtype, rngs: nnx.Rngs,
                 quantization: QuantScheme | None = None):
        c = config
        self.scan = scan
        e, f = c.hidden_size, c.intermediate_size
        hd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        init = nnx.initializers.normal(0.02)
        shapes = {"attn_norm": (e,), "wq": (e, hd), "wk": (e, kd), "wv": (e, kd),
                  "wo": (hd, e), "mlp_norm": (e,)}
        if c.attention_bias:
            shapes.update(bq=(hd,), bk=(kd,), bv=(kd,))
        if c.qk_norm:
            shapes.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
        if c.sandwich_norm:
            shapes.update(post_attn_norm=(e,), post_mlp_norm=(e,))
        dense = {"w_gate": (e, f), "w_up": (e, f), "w_down": (f, e)}
        x, fm = c.num_experts, c.moe_intermediate_size
        moe = {"router": (e, x), "experts_gate": (x, e, fm), "experts_up": (x, e, fm),
               "experts_down": (x, fm, e)}
        per_layer = [{**shapes, **(moe if c.is_moe(i) else dense)} for i in range(c.num_layers)]
        if scan and any(layer.keys() != per_layer[0].keys() for layer in per_layer):
            raise ValueError(f"scan_layers=True stacks identical layers; this model mixes dense "
                             f"and MoE MLPs (dense_layers={c.dense_layers}): use "
                             "scan_layers=False")

        def make(name, shape):
            if quantization is not None and name in LINEAR:  # filled by loading / quantize
                return nnx.Param(placeholder_weight(shape, quantization))
            if name.endswith("norm"):  # the identity: w = 1, or 0 for a (1 + w) norm
                return nnx.Param(jnp.full(shape, 0 if c.gemma_norm else 1, param_dtype))
            if name.startswith("b"):
                return nnx.Param(jnp.zeros(shape, param_dtype))
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        self.names = tuple(dict.fromkeys(n for layer in per_layer for n in layer))
        for name in self.names:
            if scan:
                setattr(self, name, make(name, (c.num_layers, *per_layer[0][name])))
            else:  # None where a layer lacks the param (a dense layer's experts)
                setattr(self, name, nnx.List([make(name, layer[name]) if name in layer else None
                                              for layer in per_layer]))

    def param(self, name: str, layer: int):
        """The Param holding `name` of one layer (for loading and saving); None if that layer
        has no such param."""
        return getattr(self, name) if self.scan else getattr(self, name)[layer]

    def stacked(self) -> dict:
        return {name: getattr(self, name).get_value() for name in self.names}

    def layer(self, i: int) -> dict:
        return {name: getattr(self, name)[i].get_value() for name in self.names
                if getattr(self, name)[i] is not None}


class Llama(nnx.Module):
    """A Llama/Mistral/Qwen2/Qwen3/Gemma decoder. ``dtype`` is the compute dtype.

    ``quantization`` (a `QuantScheme`): the linear layers (and, with ``embedding``, the
    embedding and LM head) hold quantized weights (`jaxkv.model.quant`), placeholders until a
    checkpoint loads or `jaxkv.quantize` fills them. ``integer_dot`` (default on) multiplies
    them with the platform's quantized-matmul kernel, which reads the integers (see
    `quant.qdot`); off, each weight is dequantized next to its dot. ``table_rows``: keep a
    quantized embedding row by row (`quant.QuantizedTable`; default: on TPU)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 scan_layers: bool | None = None, rngs: nnx.Rngs,
                 quantization: QuantScheme | None = None, integer_dot: bool | None = None,
                 table_rows: bool | None = None):
        if scan_layers is None:
            scan_layers = default_scan_layers(config, jax.default_backend())
        if quantization is not None and config.num_experts:
            raise UnsupportedModelError("quantization of mixture-of-experts models is not "
                                        "supported yet (num_experts="
                                        f"{config.num_experts}); load it with quantization=None")
        self.config = config
        self.dtype = dtype
        self.quantization = quantization
        self.integer_dot = True if integer_dot is None else integer_dot
        self.kernel_platform: str | None = None  # None: jax.default_backend()
        self.mesh = None  # a tensor-parallel Mesh: quantized kernels run per shard
        self.expert_parallel = False  # with a mesh: experts split by expert, not by width
        init = nnx.initializers.normal(0.02)
        v, e = config.vocab_size, config.hidden_size
        quant_embed = quantization is not None and quantization.embedding
        rows = default_table_rows() if table_rows is None else table_rows
        self.embed = nnx.Param(placeholder_embedding((v, e), rows) if quant_embed
                               else init(rngs.params(), (v, e), param_dtype))
        self.layers = DecoderLayers(config, scan=scan_layers, param_dtype=param_dtype,
                                    rngs=rngs, quantization=quantization)
        self.final_norm = nnx.Param(jnp.full((e,), 0 if config.gemma_norm else 1, param_dtype))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(
                placeholder_weight((e, v), QuantScheme(8, None)) if quant_embed
                else init(rngs.params(), (e, v), param_dtype))

    def __call__(self, tokens_t, positions_t, attention: AttentionFn, carry,
                 num_layers: int | None = None):
        """Hidden states f[T, E] after the final norm, and the attention carry.
        ``num_layers``: only the first layers run (a self-speculation draft), then the norm."""
        c = self.config
        depth = c.num_layers if num_layers is None else num_layers
        t = tokens_t.shape[0]
        x = embed_lookup(self.embed.get_value(), tokens_t, self.dtype)
        if c.scale_embeddings:  # HF rounds sqrt(E) to the compute dtype first
            x = x * jnp.asarray(c.hidden_size ** 0.5, self.dtype)
        # Recomputed from the static config at trace time (a host constant): an array attribute
        # would become a placeholder under `nnx.eval_shape`, which checkpoint loading uses.
        rope = rope_tables(c, positions_t)
        local_rope = rope if c.local_rope_theta is None else \
            rope_tables(c, positions_t, local=True)
        sliding = jnp.asarray([c.is_sliding(i) for i in range(c.num_layers)])
        kernel = self.matmul_kernel()
        gemma = c.gemma_norm

        def layer(state, xs):
            x, carry = state
            p, index = xs
            p = {name: w if is_quantized(w) else w.astype(self.dtype) for name, w in p.items()}

            def mm(a, name):
                split = "row" if name in ("wo", "w_down") else "column"
                return qdot(a, p[name], self.dtype, kernel=kernel, split=split, mesh=self.mesh)

            if isinstance(index, int):  # unrolled layers: each picks its RoPE statically
                cos, sin = local_rope if c.is_sliding(index) else rope
            else:
                cos, sin = (jnp.where(sliding[index], a, b)
                            for a, b in zip(local_rope, rope, strict=True))
            h = rms_norm(x, p["attn_norm"], c.rms_norm_eps, gemma)
            q, k, v = mm(h, "wq"), mm(h, "wk"), mm(h, "wv")
            if c.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q = q.reshape(t, c.num_heads, c.head_dim)
            k = k.reshape(t, c.num_kv_heads, c.head_dim)
            v = v.reshape(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, p["q_norm"], c.rms_norm_eps, gemma)
                k = rms_norm(k, p["k_norm"], c.rms_norm_eps, gemma)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out, carry = attention(index, q, k, v, carry)
            h = mm(out.reshape(t, -1).astype(self.dtype), "wo")
            if c.sandwich_norm:
                h = rms_norm(h, p["post_attn_norm"], c.rms_norm_eps, gemma)
            x = x + h
            h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps, gemma)
            if "router" in p:  # a mixture of experts
                h = moe_mlp(h, p, k=c.num_experts_per_tok, normalize=c.norm_topk_prob,
                            activation=lambda a: gated_activation(a, c.hidden_act),
                            platform=self.kernel_platform or jax.default_backend(),
                            mesh=self.mesh, expert_parallel=self.expert_parallel,
                            weights_dtype=self.dtype if c.model_type == "qwen3_moe"
                            else jnp.float32)
            else:
                h = mm(gated_activation(mm(h, "w_gate"), c.hidden_act) * mm(h, "w_up"),
                       "w_down")
            if c.sandwich_norm:
                h = rms_norm(h, p["post_mlp_norm"], c.rms_norm_eps, gemma)
            return (x + h, carry), None

        if self.layers.scan:
            stacked = self.layers.stacked()
            if depth < c.num_layers:
                stacked = jax.tree.map(lambda w: w[:depth], stacked)
            (x, carry), _ = jax.lax.scan(layer, (x, carry), (stacked, jnp.arange(depth)))
        elif getattr(attention, "static_layers", False) or len(set(c.windows)) > 1 or \
                self.mesh is not None or (self.kernel_platform or jax.default_backend()) != "cpu":
            # each layer's index static: its own window or pool (window-only KV), picked at
            # trace time
            for i in range(depth):
                (x, carry), _ = layer((x, carry), (self.layers.layer(i), i))
        else:
            # One traced layer for every layer of the same shapes: jit caches the trace, so
            # tracing and lowering a step cost one layer, not L (SmolLM2's 30: 2.0 -> 0.4 s
            # traced, 1.3 -> 0.4 s lowered); XLA inlines the calls, so the program (and its
            # speed) is the unrolled one. (One CPU device only: unrolled layers are the CPU
            # default, and this path is not measured under a mesh or elsewhere.)
            one = jax.jit(layer)
            for i in range(depth):
                (x, carry), _ = one((x, carry), (self.layers.layer(i), jnp.int32(i)))
        return rms_norm(x, self.final_norm[...], c.rms_norm_eps, gemma), carry

    def matmul_kernel(self) -> str:
        """Which `qdot` kernel multiplies quantized weights: the platform's ("cpu", "gpu",
        "tpu"; `kernel_platform` when a step compiles for another chip), or "xla" with
        ``integer_dot`` off (dequantize next to each dot)."""
        platform = self.kernel_platform or jax.default_backend()
        return platform if self.integer_dot and platform in ("cpu", "gpu", "tpu") else "xla"

    def logits(self, hidden):
        """f32[..., V] next-token logits of hidden states [..., E] (soft-capped if the model
        caps them: Gemma 2)."""
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.config.tie_word_embeddings:
            logits = embedding_logits(flat, self.embed.get_value(), self.dtype,
                                      kernel=self.matmul_kernel(), mesh=self.mesh)
        else:
            logits = qdot(flat, self.lm_head.get_value(), self.dtype,
                          kernel=self.matmul_kernel(), split="column", mesh=self.mesh)
        logits = logits.astype(jnp.float32).reshape(*lead, -1)
        cap = self.config.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
