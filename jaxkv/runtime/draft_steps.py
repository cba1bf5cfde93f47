"""The draft model's programs (speculative decoding's ``draft_model`` method), over the draft's
own PagedKVState: the same page ids as the target's, pages of the draft's shape.

``fill(params, state, batch) -> state`` writes the K/V of a ragged batch of known tokens: the
positions of a sequence the draft has not seen yet (its prompt, or tokens a decode loop of the
target made), in chunks of at most the largest token bucket.

``propose(params, state, batch, last, loop) -> (drafts i32[K, R], state)`` drafts K tokens per
row greedily: one ragged forward over each row's last unseen tokens, ending in its pending
token (``last`` i32[R]: that token's index in the batch), gives the first draft; a decode loop
of K - 1 steps (`jaxkv.runtime.steps`) the rest. A row's K/V is written up to its last draft
but one.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jaxkv.kv import PagedKVState
from jaxkv.runtime.batch import StepBatch
from jaxkv.runtime.sampling import RowSettings, argmax
from jaxkv.runtime.steps import MAX_STOP_IDS, DecodeLoopBatch, _decode_loop, _ragged
from jaxkv.runtime.stored_jit import stored_jit


def draft_loop_inputs(r: int, width: int, num_steps: int, window_table=None) -> DecodeLoopBatch:
    """A draft's decode-loop inputs for r idle rows (the caller fills in its rows): greedy,
    no stop ids, no token limit, ``num_steps`` steps, page tables ``width`` wide."""
    z = np.zeros(r, np.int32)
    return DecodeLoopBatch(
        tokens=z.copy(), positions=z.copy(), page_table=np.zeros((r, width), np.int32),
        live=np.zeros(r, bool), limit=z.copy(), generated=z, min_tokens=z,
        max_tokens=np.full(r, 2**30, np.int32),
        stop_ids=np.full((r, MAX_STOP_IDS), -1, np.int32), keys=np.zeros((r, 2), np.uint32),
        settings=RowSettings.of(r), num_steps=np.int32(num_steps), window_page_table=window_table)


def _fill(graphdef, impl: str, mesh, params, state: PagedKVState, batch: StepBatch):
    _, _, state = _ragged(graphdef, impl, mesh, params, state, batch)
    return state


def _propose(graphdef, impl: str, mesh, k: int, params, state: PagedKVState, batch: StepBatch,
             last, loop: DecodeLoopBatch):
    model, hidden, state = _ragged(graphdef, impl, mesh, params, state, batch)
    first = argmax(model.logits(hidden[last]))
    if k == 1:
        return first[None], state
    out, _, state = _decode_loop(graphdef, impl, mesh, k - 1, params, state,
                                 loop.replace(tokens=first))
    return jnp.concatenate([first[None], out]), state


@functools.lru_cache(maxsize=8)
def make_draft_steps(graphdef, attention_impl: str, mesh, k: int) -> tuple:
    """(fill, propose), jitted for a draft model graph and K drafts; the state is donated."""
    fill = stored_jit(functools.partial(_fill, graphdef, attention_impl, mesh),
                   donate_argnums=(1,))
    propose = stored_jit(functools.partial(_propose, graphdef, attention_impl, mesh, k),
                      donate_argnums=(1,))
    return fill, propose
