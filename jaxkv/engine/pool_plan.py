"""Sizing one engine's KV pool from the settings and the device's memory (`KVPoolPlan`).

``num_pages`` if given, else what ``kv_cache_memory_bytes`` holds, else
``kv_cache_memory_fraction`` of the device's memory after the weights and the activations (on
CPU: of the available RAM, at most 2 GiB; `jaxkv.engine.kv_budget`), capped at
``max_num_seqs`` full-length sequences. KV heads replicated for tensor parallelism count as
stored. Quantized pools come in whole rows of scale words (a free view per page).
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from jaxkv.cache.window import slots_needed
from jaxkv.config import EngineConfig, KVPoolPlan, KVSpec, cdiv
from jaxkv.engine.kv_budget import kv_budget
from jaxkv.kv import kv_spec, kv_specs
from jaxkv.model.llama import Llama
from jaxkv.model.pretrained import Model
from jaxkv.runtime.steps import default_decode_steps
from pallas_kernels.quant import is_quantized, pages_per_scale_row, storage_dtype

logger = logging.getLogger("jaxkv.engine.llm")


def model_kv_spec(model: Model, kv_cache_dtype: str = "auto") -> KVSpec:
    """The KV bytes of ``model``'s tokens in pages of ``kv_cache_dtype``."""
    return kv_spec(model.config, storage_dtype(kv_cache_dtype, model.dtype))


def plan_kv_pool(model: Model, config: EngineConfig, tp: int, device) -> KVPoolPlan:
    """The KV pool of one engine on ``tp`` devices, the first of them ``device``; logged at
    INFO.

    With window-only KV the local layers' slots come first (what ``max_num_seqs`` windows
    pin), pages of the full-attention layers take the rest, and what the page cap leaves
    goes back to slots (cache for windows of finished requests). Where the windows' slots
    would cost as much as keeping every token (a pool no bigger than they are), every layer
    keeps every token."""
    cache, sched = config.cache, config.scheduler
    page_size = cache.page_size
    need = window_need(model, config)
    try:
        stored = storage_dtype(cache.kv_cache_dtype, model.dtype)
        every = kv_spec(model.config, stored)
        full_spec, window_spec = kv_specs(model.config, stored, True)
    except ValueError as e:
        raise ValueError(f"LLM: {e}") from None
    draft = _draft(config)  # speculative decoding's draft model: its pages ride along
    extra = 0 if draft is None else kv_spec(
        draft.config, storage_dtype(cache.kv_cache_dtype, draft.dtype)).replicated(tp)
    longest = sched.max_model_len or model.config.max_position_embeddings
    cap = sched.max_num_seqs * cdiv(longest, page_size) + 1  # max_num_seqs full sequences
    memory, source = None, "num_pages"
    if cache.num_pages is None:
        if cache.kv_cache_memory_bytes is None:
            budget = kv_budget(model.config, fraction=cache.kv_cache_memory_fraction,
                               max_num_batched_tokens=sched.max_num_batched_tokens,
                               max_num_seqs=sched.max_num_seqs,
                               dtype_bytes=np.dtype(model.dtype).itemsize, device=device,
                               pending_bytes=weights_to_place(model, device, tp)
                               + (0 if draft is None else weights_to_place(draft, device, tp)))
            memory, source = budget.bytes, budget.source
        else:
            memory, source = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    # every layer keeping every token: the pool, and the yardstick of window-only KV's
    plain = _pages(memory, (every.replicated(tp) + extra) * page_size, cap, cache, stored) \
        if memory is not None else cache.num_pages
    if need is not None and cache.num_window_slots is None and need >= plain:
        need = None  # the windows' slots would cost what keeping every token does
    per_token = (full_spec if need else every).replicated(tp) + extra  # per replica
    page_bytes = per_token * page_size
    slot_bytes = window_spec.replicated(tp) * page_size if need else 0
    num_pages, slots = plain, need
    if need and memory is not None:
        # every layer local (Mistral): pages cost nothing, their windows' slots do
        num_pages = _pages(memory - (need + 1) * slot_bytes, page_bytes, cap, cache, stored) \
            if page_bytes else cap + need
        if cache.num_window_slots is None:  # the rest holds windows for the cache
            left = memory - num_pages * page_bytes - (need + 1) * slot_bytes
            slots = need + max(0, left) // slot_bytes
    if slots is not None:
        slots = min(slots, num_pages)  # one slot per page at most
    max_model_len = sched.max_model_len
    if max_model_len is None:  # what the model and the pool allow
        max_model_len = min(model.config.max_position_embeddings, num_pages * page_size)
    pool = KVPoolPlan(pages=num_pages, page_size=page_size,
                      kv_cache_dtype=cache.kv_cache_dtype, bytes_per_token=per_token,
                      max_model_len=max_model_len, source=source, window_slots=slots or 0,
                      window_slot_bytes=slot_bytes)
    logger.info("KV cache: %d pages x %d tokens = %d tokens, %.2f GiB per replica (%s); "
                "%d sequences of max_model_len %d fit at once", pool.pages, page_size,
                pool.tokens, pool.bytes / 2**30, source, pool.full_sequences, max_model_len)
    if slots:
        logger.info("Window-only KV: local layers keep %d slots of %d tokens (%.2f GiB) for "
                    "windows of %d tokens", slots, page_size, (slots + 1) * slot_bytes / 2**30,
                    model.config.sliding_window)
    return pool


def _pages(memory: int, page_bytes: int, cap: int, cache, stored) -> int:
    """Pages of ``page_bytes`` that ``memory`` holds (ValueError if none), at most ``cap``
    when sized from the device (not ``kv_cache_memory_bytes``), in whole rows of scale words
    for quantized pages."""
    pages = memory // page_bytes
    if pages < 1:
        raise ValueError(f"kv_cache_memory_bytes={memory} holds no page of {page_bytes} bytes")
    if cache.kv_cache_memory_bytes is None:
        pages = min(pages, cap)
    g = pages_per_scale_row(cache.page_size)
    if is_quantized(stored) and pages >= g:
        pages -= pages % g
    return pages


def window_need(model: Model, config: EngineConfig, max_model_len: int | None = None
                ) -> int | None:
    """Slots the local layers' pool needs with window-only KV (`jaxkv.cache.window`): the
    ``num_window_slots`` setting if given, else `slots_needed`. None where every layer keeps
    every page: ``window_kv`` off, no local layers, a custom or scanned model (each layer must
    pick its pool statically), a host tier (its pages carry every layer), a window under a
    page, or sequences no longer than the window (default ``max_model_len``: the setting or
    the model's context)."""
    c, cache, sched = model.config, config.cache, config.scheduler
    w, s = c.sliding_window, cache.page_size
    longest = max_model_len or sched.max_model_len or c.max_position_embeddings
    given = cache.num_window_slots  # (LLM's plan: kept whatever the pool's max_model_len)
    if (not cache.window_kv or w is None or not c.num_local_layers or cache.host_kv_cache_bytes
            or w < s or (longest <= w and given is None)):
        return None
    module = model.module()
    if not isinstance(module, Llama) or module.layers.scan:
        return None
    return given if given is not None else _slots_needed(c, config)


def _slots_needed(c, config: EngineConfig) -> int:
    sched = config.scheduler
    steps = sched.max_decode_steps or default_decode_steps()
    return slots_needed(c.sliding_window, config.cache.page_size,
                        max_num_seqs=sched.max_num_seqs,
                        max_num_batched_tokens=sched.max_num_batched_tokens, decode_steps=steps)


def window_slots(model: Model, config: EngineConfig, num_pages: int, max_model_len: int
                 ) -> int | None:
    """The slots of an engine's local-layer pool (`window_need`, at most one per page), or
    None (every layer keeps every page) where that saves nothing: the windows need as many
    slots as the pool has pages and ``num_window_slots`` was not set."""
    need = window_need(model, config, max_model_len)
    given = config.cache.num_window_slots
    if need is None or (given is None and need >= num_pages):
        return None
    least = min(_slots_needed(model.config, config), num_pages)  # pins never exceed pages
    if given is not None and given < least:
        raise ValueError(f"num_window_slots={given} is below the {least} slots "
                         f"{config.scheduler.max_num_seqs} sequences' windows of "
                         f"{model.config.sliding_window} tokens can pin at once (leave it "
                         "unset, or lower max_num_seqs)")
    return min(need, num_pages)


def window_stats(window) -> dict:
    """The `EngineStats` fields of window-only KV's slots (none without it)."""
    if window is None:
        return {}
    return dict(window_slots_total=window.num_slots, window_slots_pinned=window.num_pinned,
                window_slots_cached=window.num_idle, window_slot_evictions=window.evictions)


def _draft(config: EngineConfig) -> Model | None:
    spec = config.scheduler.speculative_config
    return spec.model if spec is not None and isinstance(spec.model, Model) else None


def weights_to_place(model: Model, device, tp: int) -> int:
    """Bytes of weights each device of a ``tp``-way engine will receive that are not on
    ``device`` yet (a model loaded on the host for tensor parallelism or a second engine)."""
    away = sum(x.nbytes for x in jax.tree.leaves(model.params)
               if not (isinstance(x, jax.Array) and device in x.sharding.device_set))
    return away // tp
