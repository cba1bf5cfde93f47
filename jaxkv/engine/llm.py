"""`LLM`: offline batched generation and chat over the `Engine`, in the style of vLLM's LLM."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxkv.engine.disagg import DisaggregatedEngine
from jaxkv.engine.engine import Engine
from jaxkv.engine.kv_budget import kv_budget
from jaxkv.engine.replicas import ReplicatedEngine
from jaxkv.engine.request import EngineStats, RequestOutput
from jaxkv.kv import kv_bytes_per_token as kv_state_bytes_per_token
from jaxkv.model.pretrained import Model, load_default, load_pretrained
from jaxkv.sampling_params import RequestOutputKind, SamplingParams
from jaxkv.sharding import make_mesh
from pallas_kernels.quant import is_quantized, pages_per_scale_row, storage_dtype

DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.9
logger = logging.getLogger(__name__)


def kv_bytes_per_token(model: Model, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token in every layer, in pages of ``kv_cache_dtype``: 2 * layers *
    kv_heads * head_dim * dtype bytes, plus 4 bytes per layer and kv head of scales when
    quantized."""
    return kv_state_bytes_per_token(model.config, storage_dtype(kv_cache_dtype, model.dtype))


class LLM:
    """A model plus an Engine; ``generate`` and ``chat`` run prompts to completion.

    ``model``: None (the embedded tiny model), a checkpoint folder, a ``.gguf`` file,
    "smollm2", or a `jaxkv.Model` (then ``dtype`` is unused; "auto": float32 on CPU, the
    checkpoint's bf16/fp32 on GPU/TPU).

    The KV pool (per replica; with tensor parallelism each device holds 1/N of it): ``num_pages``
    if given, else what ``kv_cache_memory_bytes`` holds, else ``kv_cache_memory_fraction`` of
    the device's memory after the weights and the activations (on CPU: of the available RAM,
    at most 2 GiB; see `jaxkv.engine.kv_budget`), capped at ``max_num_seqs`` full-length
    sequences. ``max_model_len`` defaults to the model's context, or what the pool holds if
    less. The pool is logged at INFO and kept in ``kv_pool``.

    ``tensor_parallel_size=N`` splits the model and its KV pages by head over N devices
    (`jaxkv.sharding`); ``data_parallel_size=M`` runs M such replicas on M * N devices behind
    this one LLM, each request routed to the replica caching the longest prefix of its prompt,
    else the least loaded (`jaxkv.engine.replicas`). ``max_decode_steps``: decode steps run on
    device per host round trip while nothing waits (see `Engine`). ``kv_cache_dtype``: "auto"
    (the compute dtype), "int8" or "fp8_e4m3": quantized pages, so the same memory holds about
    twice the tokens of bf16 KV (four times fp32's); the pool sizing counts the scales.
    ``host_kv_cache_bytes``: host memory (per replica) for prefix-cache pages the device pool
    evicts; a later hit copies them back instead of recomputing (see `Engine`).

    ``prefill_devices`` and ``decode_devices`` (disjoint lists of devices) disaggregate
    prefill from decode (`jaxkv.engine.disagg`): prompts run on an engine on the first,
    decoding continues on an engine on the second, the KV pages the decode side lacks copied
    over in between. Each side is tensor parallel over all its devices: their count must equal
    ``prefill_tensor_parallel_size`` / ``decode_tensor_parallel_size``, which default to
    ``tensor_parallel_size``. Each side sizes its own pool as above (``kv_pool`` is the decode
    side's, ``prefill_kv_pool`` the prefill side's).
    """

    def __init__(self, model: Model | str | Path | None = None, *, page_size: int = 16,
                 num_pages: int | None = None,
                 kv_cache_memory_bytes: int | None = None,
                 kv_cache_memory_fraction: float = DEFAULT_KV_CACHE_MEMORY_FRACTION,
                 max_num_seqs: int = 32, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 attention_impl: str = "auto", seed: int = 0, dtype: str = "auto",
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 max_decode_steps: int | None = None, kv_cache_dtype: str = "auto",
                 host_kv_cache_bytes: int = 0, prefill_devices: Sequence | None = None,
                 decode_devices: Sequence | None = None,
                 prefill_tensor_parallel_size: int | None = None,
                 decode_tensor_parallel_size: int | None = None):
        for name, value in (("tensor_parallel_size", tensor_parallel_size),
                            ("data_parallel_size", data_parallel_size),
                            ("prefill_tensor_parallel_size", prefill_tensor_parallel_size),
                            ("decode_tensor_parallel_size", decode_tensor_parallel_size)):
            if value is None and name.endswith("_tensor_parallel_size"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        sides = _disaggregated_sides(prefill_devices, decode_devices, data_parallel_size, [
            prefill_tensor_parallel_size or tensor_parallel_size,
            decode_tensor_parallel_size or tensor_parallel_size])
        devices = jax.devices()
        need = tensor_parallel_size * data_parallel_size
        if sides is None and need > len(devices):
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size"
                             f"={data_parallel_size} needs {need} devices; {len(devices)} "
                             "available")
        if model is None:
            model = load_default(dtype=dtype)
        elif isinstance(model, (str, Path)):  # with N devices, each gets only its shards
            model = load_pretrained(model, dtype=dtype, on_host=need > 1 or sides is not None)
        elif not isinstance(model, Model):
            raise ValueError(f"model must be None, a checkpoint path or a jaxkv.Model, got "
                             f"{type(model).__name__}")
        sizing = dict(page_size=page_size, num_pages=num_pages, max_model_len=max_model_len,
                      kv_cache_memory_bytes=kv_cache_memory_bytes,
                      kv_cache_memory_fraction=kv_cache_memory_fraction,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      kv_cache_dtype=kv_cache_dtype)
        split = [(devices[:need], tensor_parallel_size)] if sides is None else sides
        pools = [_kv_pool(model, tp, devs[0], **sizing) for devs, tp in split]
        self.kv_pool = pools[-1]  # the decode side's, when disaggregated
        self.prefill_kv_pool = pools[0] if sides is not None else None
        self.model = model
        kwargs = dict(page_size=page_size, max_num_seqs=max_num_seqs,
                      max_model_len=min(p["max_model_len"] for p in pools),
                      max_num_batched_tokens=max_num_batched_tokens,
                      enable_prefix_caching=enable_prefix_caching, attention_impl=attention_impl,
                      seed=seed, max_decode_steps=max_decode_steps,
                      kv_cache_dtype=kv_cache_dtype, host_kv_cache_bytes=host_kv_cache_bytes)
        if sides is not None:  # one seed: the decode side continues the prefill side's samples
            prefill, decode = (Engine(model, mesh=make_mesh(tp, devs), num_pages=pool["pages"],
                                      **kwargs) for (devs, tp), pool in zip(sides, pools,
                                                                           strict=True))
            self.engine = DisaggregatedEngine(prefill, decode)
            self._ids = itertools.count()
            return
        tp = tensor_parallel_size
        meshes = [make_mesh(tp, devices[r * tp:(r + 1) * tp]) if need > 1 else None
                  for r in range(data_parallel_size)]
        # Distinct seeds: unseeded requests on different replicas draw different numbers.
        engines = [Engine(model, mesh=mesh, num_pages=self.kv_pool["pages"],
                          **dict(kwargs, seed=seed + r))
                   for r, mesh in enumerate(meshes)]
        self.engine = engines[0] if data_parallel_size == 1 else ReplicatedEngine(engines)
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the prompts' order.

        ``prompts`` (text) or ``prompt_token_ids``: one prompt or a list. ``sampling_params``:
        one for all prompts or one per prompt.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts and prompt_token_ids")
        if prompts is not None:
            items = [prompts] if isinstance(prompts, str) else list(prompts)
            field = "prompt"
        else:
            ids = list(prompt_token_ids)
            single = bool(ids) and not isinstance(ids[0], (Sequence, np.ndarray))
            items, field = ([ids] if single else ids), "prompt_token_ids"
        if not items:
            raise ValueError(f"{field}s is empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(items)} "
                                 "prompts")
        order = {}
        try:
            for item, sp in zip(items, params, strict=True):
                if isinstance(sp, SamplingParams):  # whole outputs only, as vLLM's LLM does
                    sp = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                rid = str(next(self._ids))
                self.engine.add_request(rid, sampling_params=sp, **{field: item})
                order[rid] = len(order)
        except ValueError as e:
            for rid in order:  # all or nothing
                self.engine.abort(rid)
            name = "prompts" if field == "prompt" else field
            raise ValueError(f"{name}[{len(order)}]: {e}") from None
        return self._run(order, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        return results

    def chat(self, conversations, sampling_params=None, use_tqdm: bool = True
             ) -> list[RequestOutput]:
        """Replies to one conversation (a list of {"role", "content"} dicts) or a list of
        them, rendered with the tokenizer's chat template (with the generation prompt)."""
        tok = self.model.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("chat needs a model whose tokenizer has a chat template")
        convs = list(conversations)
        if convs and isinstance(convs[0], dict):
            convs = [convs]
        if not convs:
            raise ValueError("conversations is empty")
        for i, conv in enumerate(convs):
            if not conv or any(not isinstance(m, dict) or "role" not in m or "content" not in m
                               for m in conv):
                raise ValueError(f"conversations[{i}] must be a non-empty list of "
                                 "{'role': ..., 'content': ...} dicts")
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in convs]
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm)

    def update_params(self, params, *, version: int | str | None = None,
                      in_flight: str = "restart") -> None:
        """Serves new weights (a `jaxkv.Model` or a params pytree of the loaded model's
        structure) from the next generate on, compiling nothing; see `Engine.update_params`.
        ``model`` then holds them too."""
        self.engine.update_params(params, version=version, in_flight=in_flight)
        new = params.params if isinstance(params, Model) else params
        self.model = dataclasses.replace(self.model, params=new)

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _disaggregated_sides(prefill_devices, decode_devices, data_parallel_size: int, tps):
    """[(prefill devices, tp), (decode devices, tp)], or None when not disaggregated."""
    if prefill_devices is None and decode_devices is None:
        return None
    if prefill_devices is None or decode_devices is None:
        raise ValueError("prefill_devices and decode_devices go together: pass both")
    if data_parallel_size != 1:
        raise ValueError("data_parallel_size must be 1 with prefill_devices/decode_devices")
    sides = []
    for name, devs, tp in (("prefill", prefill_devices, tps[0]),
                           ("decode", decode_devices, tps[1])):
        devs = list(devs)
        if len(devs) != tp:
            raise ValueError(f"{name}_devices lists {len(devs)} devices for a tensor-parallel "
                             f"size of {tp} ({name}_tensor_parallel_size, else "
                             "tensor_parallel_size): they must match")
        sides.append((devs, tp))
    if {d.id for d in sides[0][0]} & {d.id for d in sides[1][0]}:
        raise ValueError("prefill_devices and decode_devices overlap")
    return sides


def _kv_pool(model: Model, tp: int, device, *, page_size: int, num_pages: int | None,
             max_model_len: int | None, kv_cache_memory_bytes: int | None,
             kv_cache_memory_fraction: float, max_num_seqs: int, max_num_batched_tokens: int,
             kv_cache_dtype: str) -> dict:
    """The KV pool of one engine on ``tp`` devices, the first of them ``device`` (see `LLM`),
    logged at INFO."""
    copies = max(1, tp // model.config.num_kv_heads)
    try:
        per_token = kv_bytes_per_token(model, kv_cache_dtype)
    except ValueError as e:
        raise ValueError(f"LLM: {e}") from None
    page_bytes = per_token * copies * page_size  # per replica
    source = "num_pages"
    if num_pages is None:  # KV heads replicated for tensor parallelism count as stored
        if kv_cache_memory_bytes is None:
            budget = kv_budget(model.config, fraction=kv_cache_memory_fraction,
                               max_num_batched_tokens=max_num_batched_tokens,
                               max_num_seqs=max_num_seqs,
                               dtype_bytes=np.dtype(model.dtype).itemsize, device=device,
                               pending_bytes=_weights_to_place(model, device, tp))
            memory, source = budget.bytes, budget.source
        else:
            memory, source = kv_cache_memory_bytes, "kv_cache_memory_bytes"
        num_pages = memory // page_bytes
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory_bytes={memory} holds no page of "
                             f"{page_bytes} bytes")
        if kv_cache_memory_bytes is None:  # never more than max_num_seqs full sequences
            longest = max_model_len or model.config.max_position_embeddings
            num_pages = min(num_pages, max_num_seqs * -(-longest // page_size) + 1)
        g = pages_per_scale_row(page_size)
        if is_quantized(storage_dtype(kv_cache_dtype, model.dtype)) and num_pages >= g:
            num_pages -= num_pages % g  # whole rows of scale words: a free view per page
    if max_model_len is None:  # what the model and the pool allow
        max_model_len = min(model.config.max_position_embeddings, num_pages * page_size)
    pool = {"pages": num_pages, "page_size": page_size, "kv_cache_dtype": kv_cache_dtype,
            "bytes_per_token": per_token * copies, "tokens": num_pages * page_size,
            "bytes": num_pages * page_bytes, "max_model_len": max_model_len,
            "full_sequences": num_pages * page_size // max_model_len, "source": source}
    logger.info("KV cache: %d pages x %d tokens = %d tokens, %.2f GiB per replica (%s); "
                "%d sequences of max_model_len %d fit at once", num_pages, page_size,
                num_pages * page_size, num_pages * page_bytes / 2**30, source,
                pool["full_sequences"], max_model_len)
    return pool


def _weights_to_place(model: Model, device, tp: int) -> int:
    """Bytes of weights each device of a ``tp``-way engine will receive that are not on
    ``device`` yet (a model loaded on the host for tensor parallelism or a second engine)."""
    away = sum(x.nbytes for x in jax.tree.leaves(model.params)
               if not (isinstance(x, jax.Array) and device in x.sharding.device_set))
    return away // tp
