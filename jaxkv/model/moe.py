"""Mixture-of-experts MLP: top-k routing with Hugging Face's semantics, and a grouped matmul
over tokens sorted by expert, so each token computes only its own k experts.

Axes: T tokens, E hidden, X experts, k experts per token, F expert MLP width, M = T * k routed
rows.

Routing (Mixtral, Qwen3-MoE): router logits in the compute dtype, softmax in float32 over all
experts, the top k, renormalized to sum to 1 when ``norm_topk_prob`` (Mixtral always: the same
as a softmax over the top-k logits). The M rows are sorted by expert; each expert multiplies its
contiguous run of rows (`grouped_matmul`), and the weighted rows are added back to their tokens.

`grouped_matmul` is `jax.lax.ragged_dot` on TPU, which XLA:TPU compiles to a grouped kernel.
XLA:CPU lowers ragged_dot densely (every row times every expert: X times the work), and so
does XLA:GPU by default (its ragged-dot rewriter pads to a dense batched dot; cuDNN's grouped
GEMM is behind an experimental flag), so there it runs `grouped_matmul_tiles`: a loop over row
tiles, each inside one expert's run. The work is the routed rows plus at most one partial tile
per expert, and each tile reads one expert's weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def route(x, router, k: int, normalize: bool, weights_dtype=jnp.float32):
    """(weights [T, k], experts i32[T, k]) of tokens x[T, E] under ``router`` [E, X]; the
    weights rounded to ``weights_dtype`` (Qwen3-MoE: the compute dtype; Mixtral: float32)."""
    probs = jax.nn.softmax(jnp.dot(x, router.astype(x.dtype)).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(weights_dtype), experts.astype(jnp.int32)


def _tile_rows(m: int, groups: int) -> int:
    """Rows per tile: the mean rows per expert, as a power of two in [8, 128]."""
    mean = max(1, m // groups)
    return min(128, max(8, 1 << (mean - 1).bit_length()))


def grouped_matmul_tiles(rows, w, group_sizes, row_offset=0, tile: int | None = None):
    """[M, N] = each run of ``rows`` [M, K] times its expert's ``w`` [X, K, N], the runs'
    lengths in ``group_sizes`` i32[X], the first starting at row ``row_offset``; rows outside
    the runs are zero. A loop over tiles of rows, each inside one run (see the module
    docstring); ``tile`` rows each (default: from the mean rows per group)."""
    m, kdim = rows.shape
    groups, _, n = w.shape
    tile = tile or _tile_rows(m, groups)
    ends = row_offset + jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles = (group_sizes + tile - 1) // tile  # per expert
    tile_ends = jnp.cumsum(tiles)
    padded = jnp.concatenate([rows, jnp.zeros((tile, kdim), rows.dtype)])

    def body(t, out):
        g = jnp.searchsorted(tile_ends, t, side="right")
        row0 = starts[g] + (t - (tile_ends[g] - tiles[g])) * tile
        y = jnp.dot(jax.lax.dynamic_slice(padded, (row0, 0), (tile, kdim)), w[g],
                    preferred_element_type=jnp.float32).astype(out.dtype)
        keep = (row0 + jnp.arange(tile) < ends[g])[:, None]  # rows past the run: the next's
        old = jax.lax.dynamic_slice(out, (row0, 0), (tile, n))
        return jax.lax.dynamic_update_slice(out, jnp.where(keep, y, old), (row0, 0))

    out = jax.lax.fori_loop(0, tile_ends[-1], body, jnp.zeros((m + tile, n), rows.dtype))
    return out[:m]


def grouped_matmul(rows, w, group_sizes, *, platform: str, row_offset=0,
                   tile: int | None = None):
    """`jax.lax.ragged_dot` on TPU, `grouped_matmul_tiles` elsewhere (arguments as there)."""
    if platform != "tpu":
        return grouped_matmul_tiles(rows, w, group_sizes, row_offset, tile)
    m = rows.shape[0]
    if isinstance(row_offset, int) and row_offset == 0:
        local = rows
    else:  # the runs first, then rows past them (which ragged_dot must not count)
        local = jax.lax.dynamic_slice(jnp.concatenate([rows, jnp.zeros_like(rows)]),
                                      (row_offset, 0), rows.shape)
    out = jax.lax.ragged_dot(local, w, group_sizes, preferred_element_type=jnp.float32)
    out = jnp.where((jnp.arange(m) < jnp.sum(group_sizes))[:, None], out, 0).astype(rows.dtype)
    if isinstance(row_offset, int) and row_offset == 0:
        return out
    placed = jnp.zeros((2 * m, out.shape[1]), out.dtype)
    return jax.lax.dynamic_update_slice(placed, out, (row_offset, 0))[:m]


def moe_mlp(x, p: dict, *, k: int, normalize: bool, activation, platform: str, mesh=None,
            expert_parallel: bool = False, weights_dtype=jnp.float32):
    """The MoE MLP of tokens x[T, E] with params ``p`` (router [E, X], experts_gate and
    experts_up [X, E, F], experts_down [X, F, E]) -> [T, E].

    With a ``mesh`` (one axis), tokens are routed on every device and each device computes
    its share of the experts, the shares summed: by width (tensor parallel, every expert's F
    split) or, with ``expert_parallel``, by expert (each device holds X / n whole experts and
    computes only the rows routed to them)."""
    t = x.shape[0]
    num_experts = p["router"].shape[-1]
    weights, experts = route(x, p["router"], k, normalize, weights_dtype)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # rows sorted by expert
    token = order // k
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[token]
    axis = None if mesh is None else mesh.axis_names[0]
    tile = _tile_rows(rows.shape[0], num_experts)  # the same under expert parallelism

    def mlp(rows, sizes, w_gate, w_up, w_down):
        offset, local = 0, sizes
        if expert_parallel:  # this device's experts: a run of groups, and of sorted rows
            n = w_gate.shape[0]
            first = jax.lax.axis_index(axis) * n
            offset = jnp.sum(jnp.where(jnp.arange(num_experts) < first, sizes, 0))
            local = jax.lax.dynamic_slice(sizes, (first,), (n,))

        def mm(a, w):
            return grouped_matmul(a, w.astype(x.dtype), local, platform=platform,
                                  row_offset=offset, tile=tile)

        h = mm(activation(mm(rows, w_gate)) * mm(rows, w_up), w_down)
        return h if axis is None else jax.lax.psum(h, axis)

    if mesh is not None:
        gate, down = (P(axis), P(axis)) if expert_parallel else (P(None, None, axis),
                                                                 P(None, axis))
        mlp = jax.shard_map(mlp, mesh=mesh, in_specs=(P(), P(), gate, gate, down),
                            out_specs=P(), check_vma=False)
    h = mlp(rows, sizes, p["experts_gate"], p["experts_up"], p["experts_down"])
    w = weights.reshape(-1)[order][:, None]  # HF: rows times weights in the weights' dtype
    h = (h.astype(w.dtype) * w).astype(x.dtype)  # (float32 for Mixtral, as its promotion)
    return jnp.zeros((t, x.shape[1]), x.dtype).at[token].add(h)
