"""The oracle of quantized weights: numpy's own unpacking of jaxkv's quantized layouts
(independent of `QuantizedWeight.dequantize`), and a float model built from it."""

import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.model.quant import QuantizedTable, is_quantized


def numpy_dequantize(w) -> np.ndarray:
    """Float32 [..., I, O] weight of a QuantizedWeight, written out in numpy (the oracle's own
    unpacking, independent of `QuantizedWeight.dequantize`)."""
    q = np.asarray(w.q)
    if w.bits == 4:
        q = np.stack([q & 15, q >> 4], axis=-2).reshape(*q.shape[:-2], 2 * q.shape[-2],
                                                          q.shape[-1])
    rows, cols = q.shape[-2:]
    scale, groups = np.asarray(w.scale), w.scale.shape[-2]
    out = np.empty(q.shape, np.float32)
    for r in range(rows):
        g = r // (rows // groups)
        out[..., r, :] = q[..., r, :].astype(np.float32) * scale[..., g, :]
        if w.offset is not None:
            out[..., r, :] += np.asarray(w.offset)[..., g, :]
    return out


def float_twin(model: jaxkv.Model) -> jaxkv.Model:
    """A float model whose every weight is the numpy dequantization of ``model``'s."""
    module = model.module()
    twin = jaxkv.random_model(model.config, scan_layers=module.layers.scan).module()

    def put(dst, src, transpose=False):
        value = src.get_value()
        if isinstance(value, QuantizedTable):  # TPU's embedding layout: int8 rows [V, E]
            value = np.asarray(value.values, np.float32) * np.asarray(value.scales, np.float32)
        elif is_quantized(value):
            value = numpy_dequantize(value).T if transpose else numpy_dequantize(value)
        dst.set_value(jnp.asarray(value))

    put(twin.embed, module.embed, transpose=True)  # quantized: [E, V], the LM head's layout
    put(twin.final_norm, module.final_norm)
    if not model.config.tie_word_embeddings:
        put(twin.lm_head, module.lm_head)
    for name in module.layers.names:
        if module.layers.scan:
            put(getattr(twin.layers, name), getattr(module.layers, name))
        else:
            for i in range(model.config.num_layers):
                put(twin.layers.param(name, i), module.layers.param(name, i))
    return jaxkv.Model.from_module(twin)


def weight_only(model):
    """``model`` computing with its dequantized weights (integer_dot off): the CPU kernel also
    rounds the activations to int8, which an fp32 oracle on the same weights does not."""
    import jaxkv

    module = model.module()
    module.integer_dot = False
    return jaxkv.Model.from_module(module, model.tokenizer, model.path)
