"""The jit boundary: pure prefill and decode steps over a donated PagedKVState.

``prefill(params, state, batch) -> (logits_last f32[B, V], state)`` runs a chunk of each
row's prompt (its earlier part may already be cached) and returns each row's last-token
logits; ``decode`` is the same computation with one token per row. The NNX graphdef is split
from the params before jit: the params are an ordinary pytree argument (fresh weights need no
recompile) and the traced program does not embed them as constants.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.attention import check_attention_impl, paged_attention
from jaxkv.errors import KVStateError
from jaxkv.kv import PagedKVState, write_kv
from jaxkv.runtime.batch import StepBatch
from jaxkv.sharding import kv_sharding, sharded_attention


def _step(graphdef, impl: str, decode: bool, mesh, params, state: PagedKVState,
          batch: StepBatch):
    if decode and batch.max_q_len != 1:
        raise ValueError(f"decode takes one token per row, got max_q_len={batch.max_q_len}")
    model = nnx.merge(graphdef, params)
    c = model.config
    _check_state(state, model, batch)  # at trace time: a new shape or dtype retraces

    def attend(q, k, v, kv_pages, layer, write_pages, write_offsets, page_table, kv_lens,
               cu_q_lens, num_seqs):
        kv_pages = write_kv(kv_pages, layer, k, v, write_pages, write_offsets)
        out = paged_attention(
            q, kv_pages, layer, page_table, kv_lens, cu_q_lens, num_seqs,
            decode=decode, sm_scale=c.sm_scale, sliding_window=c.sliding_window,
            max_q_len=batch.max_q_len, impl=impl,
        )
        return out, kv_pages

    if mesh is not None:  # each device: its heads, its kv heads' pages (no communication)
        attend = sharded_attention(attend, mesh)

    def attention(layer, q, k, v, kv_pages):
        return attend(q, k, v, kv_pages, layer, batch.write_pages, batch.write_offsets,
                      batch.page_table, batch.kv_lens, batch.cu_q_lens, batch.num_seqs)

    hidden, kv_pages = model(batch.tokens, batch.positions, attention, state.kv_pages)
    last = jnp.maximum(batch.cu_q_lens[1:] - 1, 0)
    logits = model.logits(hidden[last])
    rows = jnp.zeros((batch.page_table.shape[0], state.max_pages_per_seq), jnp.int32)
    rows = rows.at[:, : batch.page_table.shape[1]].set(batch.page_table)
    new_state = state.replace(
        kv_pages=kv_pages,
        page_table=state.page_table.at[batch.slots].set(rows, mode="drop"),
        lengths=state.lengths.at[batch.slots].set(batch.kv_lens, mode="drop"),
    )
    if mesh is not None:  # keep the donated layout, so the next step reuses the buffers
        new_state = jax.lax.with_sharding_constraint(new_state, kv_sharding(mesh))
    return logits, new_state


def _check_state(state: PagedKVState, model, batch: StepBatch) -> None:
    """Raises KVStateError if `state` cannot hold this model's KV for this batch."""
    state.validate()
    state.validate_for(model.config)
    if state.kv_pages.dtype != model.dtype:
        raise KVStateError(f"PagedKVState.kv_pages: dtype {state.kv_pages.dtype} does not match "
                           f"the model's compute dtype {jnp.dtype(model.dtype)}")
    if batch.page_table.shape[1] > state.max_pages_per_seq:
        raise KVStateError(f"PagedKVState.page_table: {state.max_pages_per_seq} pages per "
                           f"sequence, but the batch's page table has {batch.page_table.shape[1]}")


class Steps(NamedTuple):
    """The jitted steps of one model graph and attention backend."""

    prefill: callable
    decode: callable


@functools.lru_cache(maxsize=16)
def make_steps(graphdef, attention_impl: str = "auto", mesh=None) -> Steps:
    """Jitted ``prefill`` and ``decode`` for a model graph; cached so they compile once.

    With a ``mesh`` (see `jaxkv.sharding`), params and state are expected on it, sharded
    for tensor parallelism, and attention runs per device inside ``shard_map``."""
    check_attention_impl(attention_impl)
    prefill = jax.jit(functools.partial(_step, graphdef, attention_impl, False, mesh),
                      donate_argnums=(1,))
    decode = jax.jit(functools.partial(_step, graphdef, attention_impl, True, mesh),
                     donate_argnums=(1,))
    return Steps(prefill=prefill, decode=decode)
