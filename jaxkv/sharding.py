"""Tensor parallelism on a `jax.sharding.Mesh` with one axis, "tp".

Megatron-style split, written as shardings for XLA's partitioner (GSPMD):

- attention: wq, wk, wv (and their biases) split by output column, i.e. by head; wo by row;
- MLP: w_gate, w_up by column, w_down by row (one all-reduce after wo, one after w_down);
  a mixture of experts alike, every expert's MLP split by its width (the router replicated);
- embedding [V, E] and lm_head [E, V] split over the vocabulary;
- KV pages [L, K, P, S, 2D] split by kv head, so each device stores the K/V of its own heads;
  each step's page table is replicated: one page table serves all shards, and the host
  side (allocator, radix cache, scheduler) does not know the mesh exists.

The paged-attention kernels run per device inside `shard_map` (`sharded_attention`): each
device attends with its query heads over its kv heads' pages, no communication.

When ``num_kv_heads < tp``, each device still needs the kv head its query heads read, so
`shard` replicates kv heads: the model becomes one with ``tp`` kv heads, head j a copy of
original head ``j * num_kv_heads // tp``. The cost: KV memory per token (and the K/V
projection) is ``tp / num_kv_heads`` times what it would be if the heads divided evenly; each
device still holds exactly one kv head, the least any split can hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.kv import PagedKVState
from jaxkv.model.config import ModelConfig
from jaxkv.model.llama import Llama
from jaxkv.model.pretrained import Model

TP = "tp"
_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up", "experts_gate", "experts_up")  # [.., E, out]
_ROW = ("wo", "w_down", "experts_down")  # [.., in, E]: split the input
_BIAS = ("bq", "bk", "bv")
_EXPERTS = ("experts_gate", "experts_up", "experts_down")


def make_mesh(tp: int, devices: Sequence | None = None) -> Mesh:
    """A 1-D mesh of the first ``tp`` devices (of ``devices``, default `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {len(devices)} devices "
                         "available")
    return Mesh(np.asarray(devices[:tp]), (TP,))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def check_divisible(config: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Raises ValueError naming the dimension that does not split over ``tp`` devices."""
    if expert_parallel and not config.num_experts:
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model "
                         f"(model_type {config.model_type!r} has no experts)")
    experts = ("num_experts", config.num_experts) if expert_parallel else \
        ("moe_intermediate_size", config.moe_intermediate_size)
    for name, value in (("num_heads", config.num_heads),
                        ("intermediate_size", config.intermediate_size), experts,
                        ("vocab_size", config.vocab_size)):
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}")
    k = config.num_kv_heads
    if k % tp and tp % k:
        raise ValueError(f"tensor_parallel_size={tp} and num_kv_heads={k}: one must divide the "
                         "other")


def kv_replication(config: ModelConfig, tp: int) -> int:
    """How many copies of each kv head a ``tp``-way split stores (1 when tp divides them)."""
    return max(1, tp // config.num_kv_heads)


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]


def _expand_kv_params(params, config: ModelConfig, tp: int):
    """Params of a model with ``config`` given ``tp`` kv heads: head j of wk, wv (and their
    biases) a copy of head j * K // tp. On the host (numpy), so placing new weights compiles
    nothing."""
    k, d = config.num_kv_heads, config.head_dim
    source = np.arange(tp) * k // tp

    def expand(path, x):
        if not set(_names(path)) & {"wk", "wv", "bk", "bv"}:
            return x
        heads = np.asarray(x).reshape(*x.shape[:-1], k, d)[..., source, :]
        return heads.reshape(*x.shape[:-1], tp * d)

    return jax.tree_util.tree_map_with_path(expand, params)


def _expand_kv_heads(module: Llama, tp: int) -> Llama:
    """The same model with ``tp`` kv heads: head j is a copy of head j * K // tp."""
    graphdef, params = nnx.split(module)
    new = nnx.merge(graphdef, _expand_kv_params(params, module.config, tp))
    new.config = dataclasses.replace(module.config, num_kv_heads=tp)
    return new


def param_spec(path, shape: tuple[int, ...], tp: int, expert_parallel: bool = False) -> P:
    """The split of one params leaf. Quantized weights (`jaxkv.model.quant`) split like the
    float weight they hold: integers and per-group scales along the same axis, except the
    scales of a row-split weight whose G groups do not divide over ``tp`` (one per output
    channel, or Qwen2.5-0.5B's o_proj in 7 groups at tp=2): replicated ([G, O] floats), and
    `quant.qdot` repeats them into finer groups that split with each device's rows.
    ``expert_parallel``: MoE experts [X, ..] split by expert instead of by width."""
    names, ndim = _names(path), len(shape)
    if expert_parallel and set(names) & set(_EXPERTS):  # [(L,) X, in, out]: by expert
        return P(*(None,) * (ndim - 3), TP)
    if "embed" in names:  # split over the vocabulary: a float [V, E] table or a
        # `QuantizedTable` ([V, E], [V, 1]) by rows, a quantized [E, V] one by columns
        return P(None, TP) if names[-1] in ("q", "scale", "offset") else P(TP, None)
    if "lm_head" in names:
        return P(None, TP)
    name = next((n for n in names if n in _COLUMN + _ROW + _BIAS), None)
    lead = (None,) * (ndim - (1 if name in _BIAS else 2))  # a stacked layer axis, if any
    if name in _COLUMN:
        return P(*lead, None, TP)
    if name in _ROW:
        if names[-1] in ("scale", "offset") and shape[-2] % tp:
            return P()
        return P(*lead, TP, None)
    if name in _BIAS:
        return P(*lead, TP)
    return P()  # norms: replicated


def param_shardings(params, mesh: Mesh, expert_parallel: bool = False):
    """A NamedSharding for every leaf of a model's params, by parameter name."""
    tp = tp_size(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path, tuple(x.shape), tp,
                                                       expert_parallel)), params)


def kv_sharding(mesh: Mesh, quantized: bool = False, windowed: bool = False) -> PagedKVState:
    """Shardings of a PagedKVState: pages (and their scales) by kv head, in both pools."""
    pages = NamedSharding(mesh, P(None, TP, None, None, None))
    scales = NamedSharding(mesh, P(None, TP, None, None)) if quantized else None
    return PagedKVState(kv_pages=pages, kv_scales=scales,
                        window_pages=pages if windowed else None,
                        window_scales=scales if windowed else None)


def shard(model: Model, mesh: Mesh, *, expert_parallel: bool = False) -> Model:
    """The model with its params placed on ``mesh`` (tensor parallel over axis "tp";
    ``expert_parallel``: a mixture of experts split by expert over the same axis).

    A functional transform: returns a new `Model`; the input is unchanged. If the mesh has
    more devices than the model has kv heads, kv heads are replicated first (see the module
    docstring). Runs on one host or, after `jaxkv.distributed.initialize`, many.
    """
    tp = tp_size(mesh)
    check_divisible(model.config, tp, expert_parallel)
    module = model.module()
    if model.config.num_kv_heads < tp:
        if not isinstance(module, Llama):  # its params' kv heads are laid out its own way
            raise ValueError(f"tensor_parallel_size={tp} exceeds num_kv_heads="
                             f"{model.config.num_kv_heads}: jaxkv replicates kv heads only in "
                             f"its own model, not in {type(module).__name__}")
        module = _expand_kv_heads(module, tp)
    module.expert_parallel = expert_parallel  # static: in the graphdef the steps compile
    graphdef, params = nnx.split(module)
    params = jax.device_put(params, param_shardings(params, mesh, expert_parallel))
    return Model(module.config, graphdef, params, model.tokenizer, model.path)


def commit(params):
    """``params`` (any pytree) committed to the devices they are on (host leaves: the default
    device), without a copy. jit specializes on whether its arguments are committed, and
    `place_params` places new weights committed, so an engine commits its first weights and
    its KV state (whose every later version, a program's output, is committed)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.device_put(x).sharding), params)


def place_params(params, like, config: ModelConfig):
    """``params`` (a pytree of a model with ``config``, as one device or a trainer holds it)
    laid out like ``like`` (the params serving runs, e.g. `shard`'s output): kv heads
    replicated as `shard` does when the mesh has more devices than kv heads, then each leaf
    placed, committed, with the sharding of its counterpart in ``like``. The programs compiled
    for ``like`` then run the new params as they are (`Engine.update_params`)."""
    shardings = jax.tree.map(lambda x: x.sharding, like)
    mesh = getattr(jax.tree.leaves(shardings)[0], "mesh", None)
    tp = tp_size(mesh) if isinstance(mesh, Mesh) else 1
    if config.num_kv_heads < tp:
        params = _expand_kv_params(params, config, tp)
    return jax.device_put(params, shardings)


def shard_state(state: PagedKVState, mesh: Mesh) -> PagedKVState:
    """Places a KV state on ``mesh``: each device holds its kv heads' pages and scales."""
    return jax.device_put(state, kv_sharding(mesh, state.quantized, state.windowed))


def sharded_attention(attend, mesh: Mesh):
    """Runs ``attend(q, k, v, (kv_pages, kv_scales), layer, *replicated)`` per device: heads
    of q/k/v and kv heads of the pages and scales split over "tp", every other argument
    replicated. Returns the attention output (heads split) and the new (pages, scales)."""
    heads, rep = P(None, TP, None), P()

    def run(q, k, v, kv, layer, *replicated):
        pages = (P(None, TP, None, None, None), None if kv[1] is None else P(None, TP, None, None))
        fn = jax.shard_map(attend, mesh=mesh,
                           in_specs=(heads, heads, heads, pages, rep) + (rep,) * len(replicated),
                           out_specs=(heads, pages), check_vma=False)
        return fn(q, k, v, kv, jnp.asarray(layer, jnp.int32), *replicated)

    return run


def bytes_per_device(tree) -> list[int]:
    """Bytes each device of the tree's arrays holds, in device order."""
    out: dict = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
    return [out[k] for k in sorted(out)]
