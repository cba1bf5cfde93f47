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


def _step(graphdef, impl: str, decode: bool, params, state: PagedKVState, batch: StepBatch):
    if decode and batch.max_q_len != 1:
        raise ValueError(f"decode takes one token per row, got max_q_len={batch.max_q_len}")
    model = nnx.merge(graphdef, params)
    c = model.config
    _check_state(state, model, batch)  # at trace time: a new shape or dtype retraces

    def attention(layer, q, k, v, carry):
        k_pages, v_pages = carry
        k_pages = write_kv(k_pages, layer, k, batch.write_pages, batch.write_offsets)
        v_pages = write_kv(v_pages, layer, v, batch.write_pages, batch.write_offsets)
        out = paged_attention(
            q, k_pages, v_pages, layer, batch.page_table, batch.kv_lens, batch.cu_q_lens,
            batch.num_seqs, decode=decode, sm_scale=c.sm_scale,
            sliding_window=c.sliding_window, max_q_len=batch.max_q_len, impl=impl,
        )
        return out, (k_pages, v_pages)

    hidden, (k_pages, v_pages) = model(batch.tokens, batch.positions, attention,
                                       (state.k_pages, state.v_pages))
    last = jnp.maximum(batch.cu_q_lens[1:] - 1, 0)
    logits = model.logits(hidden[last])
    rows = jnp.zeros((batch.page_table.shape[0], state.max_pages_per_seq), jnp.int32)
    rows = rows.at[:, : batch.page_table.shape[1]].set(batch.page_table)
    new_state = state.replace(
        k_pages=k_pages,
        v_pages=v_pages,
        page_table=state.page_table.at[batch.slots].set(rows, mode="drop"),
        lengths=state.lengths.at[batch.slots].set(batch.kv_lens, mode="drop"),
    )
    return logits, new_state


def _check_state(state: PagedKVState, model, batch: StepBatch) -> None:
    """Raises KVStateError if `state` cannot hold this model's KV for this batch."""
    state.validate()
    state.validate_for(model.config)
    if state.k_pages.dtype != model.dtype:
        raise KVStateError(f"PagedKVState.k_pages: dtype {state.k_pages.dtype} does not match "
                           f"the model's compute dtype {jnp.dtype(model.dtype)}")
    if batch.page_table.shape[1] > state.max_pages_per_seq:
        raise KVStateError(f"PagedKVState.page_table: {state.max_pages_per_seq} pages per "
                           f"sequence, but the batch's page table has {batch.page_table.shape[1]}")


class Steps(NamedTuple):
    """The jitted steps of one model graph and attention backend."""

    prefill: callable
    decode: callable


@functools.lru_cache(maxsize=16)
def make_steps(graphdef, attention_impl: str = "auto") -> Steps:
    """Jitted ``prefill`` and ``decode`` for a model graph; cached so they compile once."""
    check_attention_impl(attention_impl)
    prefill = jax.jit(functools.partial(_step, graphdef, attention_impl, False),
                      donate_argnums=(1,))
    decode = jax.jit(functools.partial(_step, graphdef, attention_impl, True),
                     donate_argnums=(1,))
    return Steps(prefill=prefill, decode=decode)
