"""Hugging Face checkpoints <-> jaxkv parameters (safetensors, single file or sharded; GGUF
files come in through `load_tensors` under HF names, see gguf.py).

Every problem with a checkpoint is reported by tensor name: missing, unexpected, or of the
wrong shape. HF stores linear weights as [out, in]; jaxkv stores [in, out] (``x @ w``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxkv.errors import CheckpointError, CheckpointNotFoundError
from jaxkv.model.config import ModelConfig
from jaxkv.model.llama import LINEAR, Llama
from jaxkv.model.quant import (
    QuantizedTable,
    QuantizedWeight,
    QuantScheme,
    as_table,
    dequantize_host,
    is_quantized,
    quantize,
    quantize_embedding,
)

# jaxkv stacked layer param -> (HF name inside model.layers.{i}., transpose?)
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# Gemma 2/3 normalize each block's output too: HF's post_attention_layernorm is then the norm
# after attention, and the MLP's input norm is pre_feedforward_layernorm.
_SANDWICH_TENSORS = {
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
}
# Mixture-of-experts layers: the router, and expert {j}'s MLP (stacked on jaxkv's X axis).
_MOE_TENSORS = {
    "mixtral": {"router": ("block_sparse_moe.gate.weight", True),
                "experts_gate": ("block_sparse_moe.experts.{j}.w1.weight", True),
                "experts_up": ("block_sparse_moe.experts.{j}.w3.weight", True),
                "experts_down": ("block_sparse_moe.experts.{j}.w2.weight", True)},
    "qwen3_moe": {"router": ("mlp.gate.weight", True),
                  "experts_gate": ("mlp.experts.{j}.gate_proj.weight", True),
                  "experts_up": ("mlp.experts.{j}.up_proj.weight", True),
                  "experts_down": ("mlp.experts.{j}.down_proj.weight", True)},
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def layer_tensors(config: ModelConfig) -> dict[str, tuple[str, bool]]:
    """jaxkv layer param -> (HF name inside ``model.layers.{i}.``, transposed?); an expert's
    name holds ``{j}`` for its index."""
    out = {**_LAYER_TENSORS, **_SANDWICH_TENSORS} if config.sandwich_norm else _LAYER_TENSORS
    return {**out, **_MOE_TENSORS[config.model_type]} if config.num_experts else out


def tensor_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (one, or the shards of its index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {str(folder)!r}"
    )


def abstract_model(config: ModelConfig, dtype=jnp.float32, param_dtype=jnp.float32,
                   scan_layers: bool | None = None,
                   quantization: QuantScheme | None = None,
                   table_rows: bool | None = None) -> Llama:
    """A model whose params are shape-only placeholders (no memory, no random init)."""
    return nnx.eval_shape(lambda: Llama(config, dtype=dtype, param_dtype=param_dtype,
                                        scan_layers=scan_layers, rngs=nnx.Rngs(0),
                                        quantization=quantization, table_rows=table_rows))


def host_value(name: str, array: np.ndarray, quantization: QuantScheme | None,
               rows: bool = False):
    """What param ``name`` stores for the float tensor ``array`` (jaxkv layout): the array,
    or its quantized form under ``quantization`` (one tensor at a time, on the host; ``rows``:
    a quantized embedding as a `QuantizedTable`)."""
    if quantization is None:
        return array
    if name in LINEAR:
        return quantize(array, quantization)
    if quantization.embedding and name == "embed":
        return as_table(quantize_embedding(array)) if rows else quantize_embedding(array)
    if quantization.embedding and name == "lm_head":
        return quantize(array, QuantScheme(8, None))
    return array


class Slot(NamedTuple):
    """Where one HF tensor goes: a jaxkv param, its layer (None: not a layer param), whether
    HF's layout is the transpose, HF's shape, and the expert (None: not an expert's)."""

    name: str
    layer: int | None
    transpose: bool
    shape: tuple[int, ...]
    expert: int | None = None


def _expected(model: Llama) -> dict[str, Slot]:
    """HF tensor name -> its `Slot`."""
    out = {}
    c = model.config
    out["model.embed_tokens.weight"] = Slot("embed", None, False, (c.vocab_size, c.hidden_size))
    out["model.norm.weight"] = Slot("final_norm", None, False, (c.hidden_size,))
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = Slot("lm_head", None, True, (c.vocab_size, c.hidden_size))
    for name, (hf, transpose) in layer_tensors(c).items():
        if name not in model.layers.names:
            continue
        for i in range(c.num_layers):
            param = model.layers.param(name, i)
            if param is None:  # e.g. the experts of a dense layer
                continue
            shape = tuple(param.shape[1 if model.layers.scan else 0:])
            if "{j}" not in hf:
                out[f"model.layers.{i}.{hf}"] = Slot(name, i, transpose,
                                                     shape[::-1] if transpose else shape)
                continue
            one = shape[1:][::-1] if transpose else shape[1:]
            for j in range(shape[0]):
                out[f"model.layers.{i}.{hf.format(j=j)}"] = Slot(name, i, transpose, one, j)
    return out


def _safetensors_items(folder: Path):
    """(name, loader) for every tensor of a safetensors checkpoint folder."""
    for path in tensor_files(folder):
        with safe_open(str(path), framework="np") as f:
            for key in f.keys():
                yield key, lambda f=f, key=key: f.get_tensor(key)


def load_params(folder: str | Path, config: ModelConfig, *, dtype=jnp.float32,
                param_dtype=jnp.float32, scan_layers: bool | None = None,
                on_host: bool = False, quantization: QuantScheme | None = None) -> Llama:
    """Loads a checkpoint folder into a `Llama`, checking every tensor against the config.

    ``on_host`` keeps the weights in host memory (numpy) instead of the default device: for a
    model larger than one device, which `jaxkv.shard` then places shard by shard.
    ``quantization``: each weight is quantized as it is read (`jaxkv.model.quant`)."""
    folder = Path(folder)
    return load_tensors(_safetensors_items(folder), str(folder), config, dtype=dtype,
                        param_dtype=param_dtype, scan_layers=scan_layers, on_host=on_host,
                        quantization=quantization)


_FUSED = {  # Phi-3: HF tensor -> the unfused names it splits into, along its output rows
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def unfused(items, config: ModelConfig):
    """``items`` with Phi-3's fused qkv and gate_up projections split into the tensors jaxkv
    keeps (q | k | v and gate | up, by output rows); a fused tensor is read once, when its
    first part is loaded."""
    c = config
    rows = {"self_attn.qkv_proj.weight": (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                          c.num_kv_heads * c.head_dim),
            "mlp.gate_up_proj.weight": (c.intermediate_size, c.intermediate_size)}
    for key, load in items:
        suffix = next((f for f in _FUSED if key.endswith("." + f)), None)
        if suffix is None:
            yield key, load
            continue
        prefix, held = key[: -len(suffix)], {}

        def part(i, load=load, held=held, sizes=rows[suffix], key=key):
            if "tensor" not in held:
                held["tensor"] = load()
            tensor = held["tensor"]
            if is_quantized(tensor):
                raise CheckpointError(f"{key}: a quantized fused projection (Phi-3's qkv_proj "
                                      "or gate_up_proj) is not supported; load a float "
                                      "checkpoint and quantize it on load")
            if sum(sizes) != tensor.shape[0]:
                raise CheckpointError(f"{key}: {tensor.shape[0]} rows, expected "
                                      f"{' + '.join(map(str, sizes))}")
            start = sum(sizes[:i])
            return tensor[start:start + sizes[i]]

        for i, name in enumerate(_FUSED[suffix]):
            yield prefix + name, lambda i=i, part=part: part(i)


def load_tensors(items, source: str, config: ModelConfig, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, scan_layers: bool | None = None,
                 on_host: bool = False, quantization: QuantScheme | None = None,
                 table_rows: bool | None = None) -> Llama:
    """Builds a `Llama` from (HF tensor name, loader) pairs: a loader is called only for a
    tensor the config expects, and its tensor is quantized (``quantization``) before the next
    is read, so the host holds one float tensor at a time. An item's loader may also return a
    `QuantizedWeight` already in jaxkv's layout (a GGUF block format kept as it is).
    ``source`` names the checkpoint in errors; ``table_rows``: see `Llama`."""
    model = abstract_model(config, dtype, param_dtype, scan_layers, quantization, table_rows)
    expected = _expected(model)
    if config.model_type == "phi3":
        items = unfused(items, config)
    rows = isinstance(model.embed.get_value(), QuantizedTable)

    def place(value):  # on_host: numpy, for `jaxkv.shard` to send each device its part only
        put = np.asarray if on_host else jnp.asarray
        if is_quantized(value):  # integer weights and float32 scales keep their dtypes
            return jax.tree.map(put, value)
        return put(value, dtype=param_dtype)

    # Each tensor is placed as it is read (the host copy dropped at once), except the layers of
    # a stacked layout, which wait on the host to be stacked.
    loaded: dict[tuple[str, int | None], np.ndarray] = {}
    experts: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    seen, unexpected, bad_shapes, bad_keys = set(), [], [], set()
    for key, load in items:
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        if key not in expected:
            if key == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            unexpected.append(key)
            continue
        name, layer, transpose, shape, expert = expected[key]
        tensor = load()
        got = tuple(tensor.shape)  # a quantized tensor comes in jaxkv's [in, out] layout
        # (the embedding's too: [E, V], the tied LM head's)
        if tuple(got[::-1] if is_quantized(tensor) and (transpose or name == "embed")
                 else got) != shape:
            bad_shapes.append(f"{key}: expected {shape}, got {tuple(tensor.shape)}")
            bad_keys.add(key)
            continue
        seen.add(key)
        if expert is not None:  # stacked with the layer's other experts once all are read
            experts.setdefault((name, layer), {})[expert] = tensor.T if transpose else tensor
            if len(experts[name, layer]) < config.num_experts:
                continue
            parts = experts.pop((name, layer))
            tensor, transpose = np.stack([parts[j] for j in range(len(parts))]), False
        value = tensor if is_quantized(tensor) else host_value(
            name, tensor.T if transpose else tensor, quantization, rows)
        if rows and name == "embed" and isinstance(value, QuantizedWeight):
            value = as_table(value)  # a checkpoint's kept blocks, row by row
        del tensor
        if layer is None:
            getattr(model, name).set_value(place(value))
        elif not model.layers.scan:
            model.layers.param(name, layer).set_value(place(value))
        else:
            loaded[name, layer] = value
    missing = sorted(set(expected) - seen - bad_keys)
    problems = []
    if bad_shapes:
        problems.append("wrong shape: " + "; ".join(bad_shapes))
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(missing[:8])
                        + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected[:8])
                        + (" ..." if len(unexpected) > 8 else ""))
    if problems:
        raise CheckpointError(f"checkpoint {source!r} does not match its config: "
                              + " | ".join(problems))
    if model.layers.scan:
        for name in model.layers.names:
            parts = [loaded.pop((name, i)) for i in range(config.num_layers)]
            if len({jax.tree.structure(p) for p in parts}) > 1:
                raise CheckpointError(f"checkpoint {source!r}: the layers' {name} weights are "
                                      "stored in different formats, which a stacked layout "
                                      "cannot hold; load with scan_layers=False")
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *parts)
            del parts
            getattr(model.layers, name).set_value(place(stacked))
    return model


def hf_tensors(model: Llama):
    """(HF name, loader) for every tensor of ``model`` in the Hugging Face layout (host numpy,
    quantized weights dequantized to float32), one tensor at a time."""
    def load(name, layer, transpose, expert):
        var = getattr(model, name) if layer is None else model.layers.param(name, layer)
        value = var.get_value()
        if layer is not None and model.layers.scan:
            value = jax.tree.map(lambda x: x[layer], value)
        if expert is not None:
            value = value[expert]
        if is_quantized(value):  # [in, out]; a quantized embedding is [E, V] too, or a table
            array = dequantize_host(value)
            columns = name == "embed" and isinstance(value, QuantizedWeight)
            return array.T if transpose or columns else array
        array = np.asarray(jax.device_get(value))
        return array.T if transpose else array

    items = ((key, lambda s=slot: load(s.name, s.layer, s.transpose, s.expert))
             for key, slot in _expected(model).items())
    yield from (fused(items) if model.config.model_type == "phi3" else items)


def fused(items):
    """``items`` with Phi-3's q/k/v and gate/up tensors joined into its fused ones (the inverse
    of `unfused`)."""
    parts: dict[str, list] = {}
    whole = {name: fused for fused, names in _FUSED.items() for name in names}
    for key, load in items:
        suffix = next((n for n in whole if key.endswith("." + n)), None)
        if suffix is None:
            yield key, load
            continue
        prefix = key[: -len(suffix)]
        group = parts.setdefault(prefix + whole[suffix], [])
        group.append(load)
        if len(group) == len(_FUSED[whole[suffix]]):
            yield prefix + whole[suffix], lambda g=tuple(group): np.concatenate([f() for f in g])


def save_params(model: Llama, folder: str | Path, *, dtype=None) -> None:
    """Writes config.json and model.safetensors in the Hugging Face layout (quantized weights
    dequantized to float32: the HF layout has no place for jaxkv's blocks)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, load in hf_tensors(model):
        array = load()
        tensors[key] = np.ascontiguousarray(array.astype(dtype) if dtype is not None else array)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = model.config.to_hf_dict()
    hf["torch_dtype"] = str(np.dtype(next(iter(tensors.values())).dtype))
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
