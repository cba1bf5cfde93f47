"""Simulated int8 key schemes, for `jaxkv bench kv-accuracy --schemes`: how the int8 KV format
was chosen.

Each scheme says what attention would see of a layer's keys f32[T, K, D] after int8 storage
(transform, quantize, dequantize, transform back); values are quantized per token in all of them,
as pages store them. The model runs with dense causal attention over the simulated K/V (no pages:
a scheme needs no kernel to be measured), against the same dense path with exact K/V:

* ``per-token``: one absmax scale per token and kv head (the format before rotated keys);
* ``smooth-weights``: keys divided by a static per-(layer, kv head, channel) factor before
  quantizing and multiplied back (= q times the factor): the column norms of
  ``diag(attn_norm) W_k``, max over each RoPE pair (c, c + D/2), as no data is needed;
* ``smooth-calib``: the same with each channel's absmax of the keys on a calibration text
  (``jaxkv/assets/texts/held_text.txt``, public-domain prose; never the held text);
* ``mean``: a per-channel key mean (calibrated) subtracted before quantizing; exact because
  ``q . mu`` is the same for every key of a query and softmax ignores it (not with soft caps);
* ``rotate``: keys times R (`pallas_kernels.quant.key_rotation`, a sign-flipped Hadamard
  matrix; queries alike): the default since; ``mean-rotate``: both;
* ``kivi-16``: KIVI's per-channel key scales over each aligned group of 16 tokens (a page), the
  newest incomplete group kept exact (KIVI's residual); greedy decoding recomputes every token,
  so groups fill as they would in decode.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.attention import dense_attention
from jaxkv.model.quant import dequantize_host, is_quantized
from pallas_kernels import quant

SCHEMES = ("per-token", "smooth-weights", "smooth-calib", "mean", "rotate", "mean-rotate",
           "kivi-16")
CALIBRATION = Path(jaxkv.__file__).resolve().parent / "assets" / "texts" / "held_text.txt"


def _qdq(x):
    """Per-token int8 quantize-dequantize, as pages store a key or value."""
    q, s = quant.quantize(x, jnp.int8)
    return quant.dequantize(q, s)


def _pair_max(x):
    """Channels c and c + D/2 rotate together under RoPE: give both the larger factor."""
    h = x.shape[-1] // 2
    m = np.maximum(x[..., :h], x[..., h:])
    return np.concatenate([m, m], -1)


def _forward(model, scheme, *, next_token: bool = False):
    """jitted (tokens i32[N], length i32[]) -> hidden f[N, E] with K/V through ``scheme``
    (None: exact); with ``next_token``, the greedy token after ``tokens[:length]`` instead."""
    module, c = model.module(), model.config

    @jax.jit
    def run(tokens, length):
        exact = dense_attention(c)

        def attention(layer, q, k, v, carry):
            if scheme is not None:
                k = scheme(k.astype(jnp.float32), layer, length).astype(k.dtype)
                v = _qdq(v).astype(v.dtype)
            return exact(layer, q, k, v, carry)

        hidden = module(tokens, jnp.arange(tokens.shape[0]), attention, None)[0]
        return jnp.argmax(module.logits(hidden[length - 1])) if next_token else hidden
    return run


def key_statistics(model, ids):
    """Per-(layer, kv head, channel) mean and absmax of the keys of ``ids``: f32[L, K, D] each."""
    module, c = model.module(), model.config

    @jax.jit
    def keys(tokens):
        exact = dense_attention(c)

        def attention(layer, q, k, v, carry):
            out, (mean, amax) = exact(layer, q, k, v, carry)
            return out, (mean.at[layer].set(k.mean(0)), amax.at[layer].set(jnp.abs(k).max(0)))
        zeros = jnp.zeros((c.num_layers, c.num_kv_heads, c.head_dim), jnp.float32)
        return module(tokens, jnp.arange(tokens.shape[0]), attention, (zeros, zeros))[1]

    return tuple(np.asarray(x) for x in keys(jnp.asarray(ids, jnp.int32)))


def weight_factors(model):
    """f32[L, K, D]: column norms of ``diag(attn_norm) W_k`` per kv head (pair max)."""
    c, layers = model.config, model.module().layers
    out = []
    for i in range(c.num_layers):
        g = np.asarray(layers.param("attn_norm", i).get_value(), np.float32)
        w = layers.param("wk", i).get_value()
        if layers.scan:  # stacked [L, ...]: this layer's slice
            g, w = g[i], jax.tree.map(lambda x, i=i: x[i], w)
        g = g + 1 if c.gemma_norm else g  # Gemma's norms scale by (1 + w)
        w = dequantize_host(w) if is_quantized(w) else np.asarray(w, np.float32)
        out.append(np.linalg.norm(g[:, None] * w, axis=0).reshape(c.num_kv_heads, c.head_dim))
    return _pair_max(np.stack(out))


def make_scheme(name: str, model):
    """The key function ``(k f32[T, K, D], layer, length) -> k as attention sees it``."""
    if name not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {name!r}")
    if name == "per-token":
        return lambda k, layer, n: _qdq(k)
    if name == "rotate":
        return lambda k, layer, n: quant.unrotate(_qdq(quant.rotate(k)))
    if name == "kivi-16":
        return _kivi(16)
    if name == "smooth-weights":
        f = jnp.asarray(weight_factors(model))
        return lambda k, layer, n: _qdq(k / f[layer]) * f[layer]
    calib = model.tokenizer.encode(CALIBRATION.read_text(), add_special_tokens=False)
    mean, absmax = key_statistics(model, calib)
    mean = jnp.asarray(mean)
    if name == "smooth-calib":
        f = jnp.asarray(_pair_max(absmax))
        return lambda k, layer, n: _qdq(k / f[layer]) * f[layer]
    if name == "mean":
        return lambda k, layer, n: _qdq(k - mean[layer]) + mean[layer]
    return lambda k, layer, n: quant.unrotate(_qdq(quant.rotate(k - mean[layer]))) + mean[layer]


def _kivi(group: int):
    def f(k, layer, n):
        t = k.shape[0]
        pad = -t % group
        kg = jnp.pad(k, ((0, pad), (0, 0), (0, 0))).reshape(-1, group, *k.shape[1:])
        q, s = quant.quantize(jnp.swapaxes(kg, 1, -1), jnp.int8)  # absmax over each group
        deq = jnp.swapaxes(quant.dequantize(q, s), 1, -1).reshape(-1, *k.shape[1:])[:t]
        full = jnp.arange(t) < n // group * group  # tokens of complete groups
        return jnp.where(full[:, None, None], deq, k)
    return f


def teacher_forced(model, ids, names, chunk: int = 512) -> dict:
    """Per scheme: max / mean |logit error|, top-1 agreement and perplexity change vs exact KV."""
    toks, n = jnp.asarray(ids, jnp.int32), len(ids)
    targets = jnp.asarray(ids[1:] + [0], jnp.int32)
    module = model.module()

    @jax.jit
    def compare(h_ref, h, tg):
        ref, lg = module.logits(h_ref), module.logits(h)

        def nll(z):
            return jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, tg[:, None], -1)[:, 0]
        err = jnp.abs(lg - ref)
        return err.max(-1), err.mean(-1), lg.argmax(-1) == ref.argmax(-1), nll(ref), nll(lg)

    h_ref = _forward(model, None)(toks, jnp.int32(n))
    res = {}
    for name in names:
        h = _forward(model, make_scheme(name, model))(toks, jnp.int32(n))
        parts = [jax.device_get(compare(h_ref[a:a + chunk], h[a:a + chunk], targets[a:a + chunk]))
                 for a in range(0, n, chunk)]
        mx, mn, top1, nll_ref, nll = (np.concatenate(x).astype(np.float64)
                                      for x in zip(*parts, strict=True))
        res[name] = {"max_err": float(mx.max()), "mean_err": float(mn.mean()),
                     "top1": float(top1.mean()),
                     "ppl_change_pct": 100 * float(np.exp(nll[:-1].mean() - nll_ref[:-1].mean())
                                                   - 1)}
    return res


def greedy(model, prompts, new_tokens: int, names) -> dict:
    """Per scheme: greedy replies (every token recomputed) identical to exact KV's, of all
    prompts and of the first 4."""
    ids = [model.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    width = max(len(p) for p in ids) + new_tokens

    def replies(scheme):
        run = _forward(model, scheme, next_token=True)
        outs = []
        for p in ids:
            seq = list(p)
            for _ in range(new_tokens):  # causal: the padding past seq never reaches it
                tokens = jnp.asarray(seq + [0] * (width - len(seq)), jnp.int32)
                seq.append(int(run(tokens, jnp.int32(len(seq)))))
            outs.append(seq[len(p):])
        return outs

    ref = replies(None)
    res = {}
    for name in names:
        same = [a == b for a, b in zip(ref, replies(make_scheme(name, model)), strict=True)]
        res[name] = {"identical": sum(same), "prompts": len(same), "first4": sum(same[:4])}
    return res


def report(tf: dict, gr: dict) -> None:
    """Prints the scheme table (markdown)."""
    print("\n| int8 key scheme (simulated, dense attention) | max abs err | mean abs err "
          "| top-1 agree | ppl change | greedy identical | first 4 |")
    print("|---|---|---|---|---|---|---|")
    for name, t in tf.items():
        g = gr.get(name)
        same = (f"{g['identical']} / {g['prompts']} | {g['first4']} / {min(4, g['prompts'])}"
                if g else "| ")
        print(f"| {name} | {t['max_err']:.4g} | {t['mean_err']:.4g} | {100 * t['top1']:.2f}% "
              f"| {t['ppl_change_pct']:+.3f}% | {same} |")
