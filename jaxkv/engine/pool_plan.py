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

from jaxkv.config import EngineConfig, KVPoolPlan, KVSpec, cdiv
from jaxkv.engine.kv_budget import kv_budget
from jaxkv.kv import kv_spec
from jaxkv.model.pretrained import Model
from pallas_kernels.quant import is_quantized, pages_per_scale_row, storage_dtype

logger = logging.getLogger("jaxkv.engine.llm")


def model_kv_spec(model: Model, kv_cache_dtype: str = "auto") -> KVSpec:
    """The KV bytes of ``model``'s tokens in pages of ``kv_cache_dtype``."""
    return kv_spec(model.config, storage_dtype(kv_cache_dtype, model.dtype))


def plan_kv_pool(model: Model, config: EngineConfig, tp: int, device) -> KVPoolPlan:
    """The KV pool of one engine on ``tp`` devices, the first of them ``device``; logged at
    INFO."""
    cache, sched = config.cache, config.scheduler
    page_size, num_pages = cache.page_size, cache.num_pages
    try:
        spec = model_kv_spec(model, cache.kv_cache_dtype)
    except ValueError as e:
        raise ValueError(f"LLM: {e}") from None
    per_token = spec.replicated(tp)  # per replica
    page_bytes = per_token * page_size
    source = "num_pages"
    if num_pages is None:
        if cache.kv_cache_memory_bytes is None:
            budget = kv_budget(model.config, fraction=cache.kv_cache_memory_fraction,
                               max_num_batched_tokens=sched.max_num_batched_tokens,
                               max_num_seqs=sched.max_num_seqs,
                               dtype_bytes=np.dtype(model.dtype).itemsize, device=device,
                               pending_bytes=weights_to_place(model, device, tp))
            memory, source = budget.bytes, budget.source
        else:
            memory, source = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        num_pages = memory // page_bytes
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory_bytes={memory} holds no page of "
                             f"{page_bytes} bytes")
        if cache.kv_cache_memory_bytes is None:  # never more than max_num_seqs full sequences
            longest = sched.max_model_len or model.config.max_position_embeddings
            num_pages = min(num_pages, sched.max_num_seqs * cdiv(longest, page_size) + 1)
        g = pages_per_scale_row(page_size)
        if is_quantized(storage_dtype(cache.kv_cache_dtype, model.dtype)) and num_pages >= g:
            num_pages -= num_pages % g
    max_model_len = sched.max_model_len
    if max_model_len is None:  # what the model and the pool allow
        max_model_len = min(model.config.max_position_embeddings, num_pages * page_size)
    pool = KVPoolPlan(pages=num_pages, page_size=page_size,
                      kv_cache_dtype=cache.kv_cache_dtype, bytes_per_token=per_token,
                      max_model_len=max_model_len, source=source)
    logger.info("KV cache: %d pages x %d tokens = %d tokens, %.2f GiB per replica (%s); "
                "%d sequences of max_model_len %d fit at once", pool.pages, page_size,
                pool.tokens, pool.bytes / 2**30, source, pool.full_sequences, max_model_len)
    return pool


def weights_to_place(model: Model, device, tp: int) -> int:
    """Bytes of weights each device of a ``tp``-way engine will receive that are not on
    ``device`` yet (a model loaded on the host for tensor parallelism or a second engine)."""
    away = sum(x.nbytes for x in jax.tree.leaves(model.params)
               if not (isinstance(x, jax.Array) and device in x.sharding.device_set))
    return away // tp
