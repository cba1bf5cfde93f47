"""The jit boundary: one ragged step, and a multi-step decode loop, over a donated PagedKVState.

``step(params, state, batch, keys, sampling) -> (tokens i32[B], logits f32[B, V], hidden [T, H],
state)`` runs one ragged batch (prefill chunks whose earlier part may be cached, and one-token
decode rows, flattened; see `jaxkv.runtime.batch`) and samples each row's next token from its
last logits. ``hidden`` is every token's final hidden state (after the final norm), which
`prompt_logprobs` turns into logits only for the rows that ask. Its programs differ only by the
token bucket T.

``decode_loop(params, state, loop) -> (tokens i32[N, R], after, state)`` runs up to
``loop.num_steps`` decode steps of R rows on device (a `lax.while_loop`): each iteration writes
the K/V of every live row's pending token, samples the next one, and retires rows that hit a
stop token (once their ``min_tokens`` are out), their ``max_tokens``, or the steps their pages
were reserved for. The host reads the N x R tokens once (-1 where a row had retired). ``after``
is ``loop`` with each row's pending token, position, liveness and count after the last step:
the inputs of a next loop, which the host can dispatch before reading these tokens.

Speculative decoding (`jaxkv.spec`): ``spec_step(params, state, batch, idx, draft,
num_draft, keys, sampling, banned[, mask]) -> (tokens i32[R, K + 1], logits, state)`` runs a
ragged batch of R decode rows, each its pending token and up to K drafts, takes the logits at
those positions only and verifies them (`jaxkv.runtime.spec_verify`), masked per position for
rows with a grammar; ``verify`` does the same from a plain step's hidden states (a step with
prefill chunks). With self-speculation, ``draft`` is a decode loop of the model's first
layers, greedy.

The NNX graphdef is split from the params before jit: the params are an ordinary pytree argument
(fresh weights need no recompile) and the traced program does not embed them as constants.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxkv.attention import (
    check_attention_impl,
    kernel_for,
    paged_attention,
    windowed_attention,
)
from jaxkv.errors import KVStateError
from jaxkv.kv import PagedKVState, pool_layers, rotate_queries, write_kv
from jaxkv.runtime.batch import StepBatch
from jaxkv.runtime.processors import apply_token_bitmask
from jaxkv.runtime.sampling import (
    MAX_BANNED,
    RowSettings,
    SamplingArrays,
    sample_tokens,
    token_logprobs,
)
from jaxkv.runtime.spec_verify import accept_drawn
from jaxkv.runtime.stored_jit import stored_jit
from jaxkv.sharding import kv_sharding, sharded_attention

MAX_STOP_IDS = 8  # stop ids (EOS included) a row can check on device (<= MAX_BANNED)


@struct.dataclass
class DecodeLoopBatch:
    """The device inputs of `decode_loop`, for R rows (padding rows have ``live`` 0)."""

    tokens: jax.Array  # i32[R]  each row's pending token (sampled, its K/V not yet written)
    positions: jax.Array  # i32[R]  its position
    page_table: jax.Array  # i32[R, W]  pages reserved for every token this loop may write
    live: jax.Array  # bool[R]  a real, unfinished sequence (it runs while its limit allows)
    limit: jax.Array  # i32[R]  tokens the row may sample in this loop (its pages allow)
    generated: jax.Array  # i32[R]  output tokens so far (the pending one included)
    min_tokens: jax.Array  # i32[R]
    max_tokens: jax.Array  # i32[R]
    stop_ids: jax.Array  # i32[R, MAX_STOP_IDS]  -1 = none
    keys: jax.Array  # u32[R, 2]
    settings: RowSettings  # each row's sampling settings
    num_steps: jax.Array  # i32[]  at most N (the tokens array's rows)
    window_page_table: jax.Array | None = None  # i32[R, W]  local layers' slots (window KV)


class LoopRow(NamedTuple):
    """One live row of a decode loop: its pending token and what bounds its sampling."""

    index: int  # its row in the batch
    token: int  # the pending token (sampled, its K/V not yet written)
    position: int
    limit: int  # tokens it may sample in this loop
    generated: int  # output tokens so far, the pending one included
    params: object  # its SamplingParams
    key: np.ndarray  # u32[2]


def decode_loop_batch(rows: Sequence[LoopRow], table: np.ndarray, eos_token_ids,
                      num_steps: int, window_table: np.ndarray | None = None
                      ) -> DecodeLoopBatch:
    """The inputs of `decode_loop` for ``rows`` over page table ``table`` (i32[R, W], row i
    for row index i; ``window_table`` the same rows' local-layer slots with window-only KV);
    rows not named idle."""
    r = table.shape[0]
    tokens, positions = np.zeros(r, np.int32), np.zeros(r, np.int32)
    live, limit, generated = np.zeros(r, bool), np.zeros(r, np.int32), np.zeros(r, np.int32)
    min_tokens, max_tokens = np.zeros(r, np.int32), np.ones(r, np.int32)
    stop_ids = np.full((r, MAX_STOP_IDS), -1, np.int32)
    keys = np.zeros((r, 2), np.uint32)
    for row in rows:
        i, sp = row.index, row.params
        tokens[i], positions[i], live[i], limit[i] = row.token, row.position, True, row.limit
        generated[i], min_tokens[i], max_tokens[i] = row.generated, sp.min_tokens, sp.max_tokens
        ids = sp.stop_ids(eos_token_ids)
        stop_ids[i, :len(ids)] = ids
        keys[i] = row.key
    return DecodeLoopBatch(
        tokens=tokens, positions=positions, page_table=table, live=live, limit=limit,
        generated=generated, min_tokens=min_tokens, max_tokens=max_tokens, stop_ids=stop_ids,
        keys=keys, settings=RowSettings.of(r, [(row.index, row.params) for row in rows]),
        num_steps=np.int32(num_steps), window_page_table=window_table)


def _merge(graphdef, params, impl: str, mesh):
    """The model for a step: compiled for another chip ("pallas-gpu"/"pallas-tpu"), its
    quantized weights take that chip's matmul kernel too; with a mesh, they run per shard."""
    model = nnx.merge(graphdef, params)
    if impl in ("pallas-gpu", "pallas-tpu"):
        model.kernel_platform = kernel_for(impl)
    model.mesh = mesh
    return model


def _check_state(state: PagedKVState, model) -> None:
    """Raises KVStateError if `state` cannot hold this model's KV."""
    state.validate()
    state.validate_for(model.config)
    if state.windowed and getattr(getattr(model, "layers", None), "scan", False):
        raise KVStateError("PagedKVState.window_pages: window-only KV needs unrolled layers "
                           "(load the model with scan_layers=False, or serve with "
                           "window_kv=False)")
    if not state.quantized and state.kv_pages.dtype != model.dtype:
        raise KVStateError(f"PagedKVState.kv_pages: dtype {state.kv_pages.dtype} does not match "
                           f"the model's compute dtype {jnp.dtype(model.dtype)}")


def _forward(model, impl, mesh, kv, tokens, positions, write_pages, write_offsets,
             page_table, kv_lens, cu_q_lens, num_seqs, *, decode: bool, window=None,
             num_layers=None):
    """Hidden states of T tokens and the (pages, scales) with their K/V written; ``kv`` is
    (kv_pages, kv_scales or None), carried through the layers. Window-only KV: ``kv`` also
    holds (window_pages, window_scales), and ``window`` is the local layers' (write slots
    i32[T], slot table i32[B, W])."""
    c = model.config
    layout = pool_layers(c, window is not None)

    def attend_with(windows):
        """Attention of a layer whose window is one of ``windows`` (a layer's own, when the
        layer index is a Python int: unrolled layers, with or without a mesh)."""
        def attend(q, k, v, kv, layer, write_pages, write_offsets, page_table, kv_lens,
                   cu_q_lens, num_seqs):
            kv_pages, kv_scales = write_kv(kv[0], layer, k, v, write_pages, write_offsets,
                                           kv[1])
            q = rotate_queries(q, kv_scales)  # quantized pages hold rotated keys: q alike

            def read(window):
                return paged_attention(q, kv_pages, layer, page_table, kv_lens, cu_q_lens,
                                       num_seqs, decode=decode, sm_scale=c.sm_scale,
                                       soft_cap=c.attn_softcap, sliding_window=window,
                                       impl=impl, kv_scales=kv_scales)

            return windowed_attention(read, windows, layer), (kv_pages, kv_scales)

        # with a mesh: each device, its heads and its kv heads' pages (no communication)
        return attend if mesh is None else sharded_attention(attend, mesh)

    def attention(layer, q, k, v, kv):
        windows = (c.layer_window(layer),) if isinstance(layer, int) else c.windows
        if window is None:
            return attend_with(windows)(q, k, v, kv, layer, write_pages, write_offsets,
                                        page_table, kv_lens, cu_q_lens, num_seqs)
        pool, index = layout[layer]  # unrolled layers (checked): layer is an int
        if pool == "window":
            out, pages = attend_with(windows)(q, k, v, kv[2:], index, window[0], write_offsets,
                                              window[1], kv_lens, cu_q_lens, num_seqs)
            return out, (*kv[:2], *pages)
        out, pages = attend_with(windows)(q, k, v, kv[:2], index, write_pages, write_offsets,
                                          page_table, kv_lens, cu_q_lens, num_seqs)
        return out, (*pages, *kv[2:])

    attention.static_layers = window is not None  # window-only KV: pools picked by layer
    if num_layers is None:  # (a bring-your-own model need not take num_layers)
        return model(tokens, positions, attention, kv)
    return model(tokens, positions, attention, kv, num_layers=num_layers)


def _keep_layout(state, mesh):
    if mesh is not None:  # keep the donated layout, so the next step reuses the buffers
        state = jax.lax.with_sharding_constraint(
            state, kv_sharding(mesh, state.quantized, state.windowed))
    return state


def _pools(state: PagedKVState) -> tuple:
    """The pools a step carries through the layers: (pages, scales[, window pages, scales])."""
    kv = (state.kv_pages, state.kv_scales)
    return kv + (state.window_pages, state.window_scales) if state.windowed else kv


def _with_pools(state: PagedKVState, kv: tuple) -> PagedKVState:
    if len(kv) == 2:
        return state.replace(kv_pages=kv[0], kv_scales=kv[1])
    return state.replace(kv_pages=kv[0], kv_scales=kv[1], window_pages=kv[2],
                         window_scales=kv[3])


def _ragged(graphdef, impl: str, mesh, params, state: PagedKVState, batch: StepBatch):
    """(model, hidden states of the batch's tokens, the state with their K/V written)."""
    model = _merge(graphdef, params, impl, mesh)
    _check_state(state, model)  # at trace time: a new shape or dtype retraces
    _check_window(state, batch.window_page_table)
    window = (batch.window_write_pages, batch.window_page_table) if state.windowed else None
    hidden, kv = _forward(
        model, impl, mesh, _pools(state), batch.tokens, batch.positions,
        batch.write_pages, batch.write_offsets, batch.page_table, batch.kv_lens,
        batch.cu_q_lens, batch.num_seqs, decode=False, window=window)
    return model, hidden, _keep_layout(_with_pools(state, kv), mesh)


def _step(graphdef, impl: str, mesh, params, state: PagedKVState, batch: StepBatch, keys,
          sampling: SamplingArrays):
    model, hidden, state = _ragged(graphdef, impl, mesh, params, state, batch)
    last = jnp.maximum(batch.cu_q_lens[1:] - 1, 0)
    logits = model.logits(hidden[last])
    tokens = sample_tokens(logits, keys, sampling)
    return tokens, logits, hidden, state


def _spec_step(graphdef, impl: str, mesh, params, state: PagedKVState, batch: StepBatch, idx,
               draft, num_draft, keys, sampling: SamplingArrays, banned, mask=None):
    """A step of R decode rows, some with drafts: the ragged forward, logits only at the rows'
    positions (``idx`` i32[R, K + 1], as `_verify` takes them), then verification; a row
    without drafts samples as a plain step would (same key, same draw). Returns (tokens
    i32[R, K + 1], logits f32[R * (K + 1), V], state)."""
    model, hidden, state = _ragged(graphdef, impl, mesh, params, state, batch)
    tokens, logits, _ = _verified(model, hidden[idx.reshape(-1)], draft, num_draft, keys,
                                  sampling, banned, mask)
    return tokens, logits, state


def _check_window(state: PagedKVState, window_table) -> None:
    """A windowed state needs the local layers' slot table, and only it takes one."""
    if state.windowed != (window_table is not None):
        raise KVStateError("PagedKVState.window_pages: a state with window-only KV needs the "
                           "batch's window_page_table, and one without takes none")


def _decode_loop(graphdef, impl: str, mesh, max_steps: int, params, state: PagedKVState,
                 loop: DecodeLoopBatch, *, num_layers: int | None = None):
    model = _merge(graphdef, params, impl, mesh)
    _check_state(state, model)
    _check_window(state, loop.window_page_table)
    r = loop.tokens.shape[0]
    s, p = state.page_size, state.num_pages
    rows = jnp.arange(r)
    cu = jnp.arange(r + 1, dtype=jnp.int32)
    pad = jnp.full((r, MAX_BANNED - MAX_STOP_IDS), -1, jnp.int32)

    def sampling(generated):  # stop ids are banned until min_tokens are out (vLLM's rule)
        banned = jnp.where((generated < loop.min_tokens)[:, None], loop.stop_ids, -1)
        return SamplingArrays(loop.settings, generated, jnp.concatenate([banned, pad], axis=1))

    def body(carry):
        i, tokens, positions, running, finished, generated, out, kv = carry
        page = loop.page_table[rows, positions // s]
        window = None
        if state.windowed:  # the local layers write their slots (the last + 1: dropped)
            slot = loop.window_page_table[rows, positions // s]
            window = (jnp.where(running, slot, state.window_pages.shape[2]),
                      loop.window_page_table)
        hidden, kv = _forward(
            model, impl, mesh, kv, tokens, positions, jnp.where(running, page, p),
            positions % s, loop.page_table, jnp.where(running, positions + 1, 0), cu,
            jnp.int32(r), decode=True, window=window, num_layers=num_layers)
        new = sample_tokens(model.logits(hidden), loop.keys, sampling(generated))
        out = out.at[i].set(jnp.where(running, new, -1))
        generated = generated + running.astype(jnp.int32)
        stop = jnp.any((new[:, None] == loop.stop_ids) & (loop.stop_ids >= 0), axis=-1)
        ends = running & ((stop & (generated > loop.min_tokens))
                          | (generated >= loop.max_tokens))
        # A row out of reserved steps pauses (a continuation may go on); one that ended stops.
        running = running & ~ends & (i + 1 < loop.limit)
        tokens = jnp.where(out[i] >= 0, new, tokens)
        positions = positions + (out[i] >= 0).astype(jnp.int32)
        return (i + 1, tokens, positions, running, finished | ends, generated, out, kv)

    def cond(carry):
        i, running = carry[0], carry[3]
        return (i < jnp.minimum(loop.num_steps, max_steps)) & jnp.any(running)

    out = jnp.full((max_steps, r), -1, jnp.int32)
    carry = (jnp.int32(0), loop.tokens, loop.positions, loop.live & (loop.limit > 0),
             jnp.zeros_like(loop.live), loop.generated, out, _pools(state))
    _, tokens, positions, _, finished, generated, out, kv = \
        jax.lax.while_loop(cond, body, carry)
    after = loop.replace(tokens=tokens, positions=positions, live=loop.live & ~finished,
                         generated=generated)
    return out, after, _keep_layout(_with_pools(state, kv), mesh)


def _verify(graphdef, impl: str, mesh, params, hidden, draft, num_draft, keys,
            sampling: SamplingArrays, banned, mask=None):
    """Verifies R speculating rows: ``hidden`` [R * (K + 1), E] are each row's final hidden
    states in a step (its pending token, then its drafts; `take_rows`), ``draft`` i32[R, K]
    (< 0: none), ``num_draft`` i32[R], ``keys``/``step``/``sampling`` per row, ``banned``
    i32[R, K + 1, MAX_BANNED] per position (`jaxkv.runtime.spec_verify`); ``mask``, with
    structured outputs: (i32[R, K + 1, ceil(V / 32)] a grammar's packed mask per position,
    bool[R, K + 1] where one applies), or None. Returns (tokens i32[R, K + 1], -1 after the
    emitted ones; the raw logits f32[R * (K + 1), V])."""
    return _verified(_merge(graphdef, params, impl, mesh), hidden, draft, num_draft, keys,
                     sampling, banned, mask)[:2]


def _verified(model, hidden, draft, num_draft, keys, sampling: SamplingArrays, banned, mask):
    """(tokens, the raw logits, the logits the rows sample from: masked where ``mask`` says)."""
    r, k1 = banned.shape[:2]
    logits = scores = model.logits(hidden)
    if mask is not None:  # (a program of its own: only steps with a grammar row run it)
        words, masked = mask
        scores = apply_token_bitmask(logits, words.reshape(r * k1, -1), masked.reshape(-1))
    # Each position drawn as a plain step draws it (the row's key at that output index), so
    # the kept tokens are those sampling without speculation gives (`accept_drawn`).
    per_position = jax.tree.map(lambda a: jnp.repeat(a, k1, axis=0), sampling).replace(
        step=jnp.repeat(sampling.step, k1) + jnp.tile(jnp.arange(k1, dtype=jnp.int32), r),
        banned=banned.reshape(r * k1, -1))
    drawn = sample_tokens(scores, jnp.repeat(keys, k1, axis=0), per_position)
    tokens, _ = accept_drawn(drawn.reshape(r, k1), draft, num_draft)
    return tokens, logits, scores


@stored_jit
def take_rows(hidden, idx):
    """``hidden[idx]`` flattened: the rows a verification reads (one program per step
    bucket and row bucket, each a gather)."""
    return hidden[idx.reshape(-1)]


def _prompt_logprobs(graphdef, params, hidden, idx, targets, k: int):
    """Logprobs of ``targets`` (i32[P]) under the logits of ``hidden[idx]``, as
    `token_logprobs` gives them: (logprob f32[P], rank i32[P], top ids i32[P, k], theirs)."""
    model = nnx.merge(graphdef, params)
    return token_logprobs(model.logits(hidden[idx]), targets, k)


class Steps(NamedTuple):
    """The jitted programs of one model graph and attention backend."""

    step: callable
    decode_loop: callable  # (params, state, loop) -> (tokens, after, state): <= max steps
    max_decode_steps: int
    prompt_logprobs: callable  # (params, hidden, idx, targets, k) -> token_logprobs' four
    verify: callable  # (params, hidden rows, draft, ...) -> (tokens, logits): `_verify`
    spec_step: callable  # (params, state, batch, idx, draft, ...) -> (tokens, logits, state)
    draft: callable | None = None  # self-speculation: a decode loop of the first layers


def default_decode_steps() -> int:
    """Decode steps per loop when the settings name none: 8 on CPU, 1 on GPU/TPU (where
    longer loops are not proven yet, see docs/AOT.md)."""
    return 8 if jax.default_backend() == "cpu" else 1


@functools.lru_cache(maxsize=16)
def make_steps(graphdef, attention_impl: str = "auto", mesh=None, max_decode_steps: int = 8,
               draft: tuple[int, int] | None = None) -> Steps:
    """Jitted ``step`` and ``decode_loop`` for a model graph; cached so they compile once.
    ``draft`` (k, layers): self-speculation's draft program, a decode loop of k steps of the
    first ``layers`` layers.

    With a ``mesh`` (see `jaxkv.sharding`), params and state are expected on it, sharded
    for tensor parallelism, and attention runs per device inside ``shard_map``."""
    check_attention_impl(attention_impl)
    if not isinstance(max_decode_steps, int) or max_decode_steps < 1:
        raise ValueError(f"max_decode_steps must be an int >= 1, got {max_decode_steps!r}")
    step = stored_jit(functools.partial(_step, graphdef, attention_impl, mesh), donate_argnums=(1,))
    loop = stored_jit(functools.partial(_decode_loop, graphdef, attention_impl, mesh,
                                     max_decode_steps), donate_argnums=(1,))
    plp = stored_jit(functools.partial(_prompt_logprobs, graphdef), static_argnums=(4,))
    verify_rows = stored_jit(functools.partial(_verify, graphdef, attention_impl, mesh))
    spec = stored_jit(functools.partial(_spec_step, graphdef, attention_impl, mesh),
                   donate_argnums=(1,))
    drafter = None if draft is None else stored_jit(functools.partial(
        _decode_loop, graphdef, attention_impl, mesh, draft[0], num_layers=draft[1]),
        donate_argnums=(1,))
    return Steps(step=step, decode_loop=loop, max_decode_steps=max_decode_steps,
                 prompt_logprobs=plp, verify=verify_rows, spec_step=spec, draft=drafter)
