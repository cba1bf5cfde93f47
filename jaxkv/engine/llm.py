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

from jaxkv.config import DisaggConfig, EngineConfig, field_sections, unknown_setting
from jaxkv.disagg import DisaggregatedEngine
from jaxkv.engine.engine import Engine
from jaxkv.engine.pool_plan import model_kv_spec, plan_kv_pool
from jaxkv.engine.replicas import ReplicatedEngine
from jaxkv.engine.request import EngineStats, RequestOutput
from jaxkv.model.pretrained import Model, load_default, load_pretrained, quantize
from jaxkv.model.quant import QuantScheme
from jaxkv.runtime.compile_cache import use_compile_cache
from jaxkv.sampling_params import RequestOutputKind, SamplingParams
from jaxkv.sharding import make_mesh
from jaxkv.spec import proposer_for

logger = logging.getLogger(__name__)


def kv_bytes_per_token(model: Model, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token in every layer, in pages of ``kv_cache_dtype``: 2 * layers *
    kv_heads * head_dim * dtype bytes, plus 4 bytes per layer and kv head of scales when
    quantized."""
    return model_kv_spec(model, kv_cache_dtype).bytes_per_token


class LLM:
    """A model plus an engine (any `EngineClient`); ``generate`` and ``chat`` run prompts to
    completion.

    ``model``: None (the embedded tiny model), a checkpoint folder, a ``.gguf`` file,
    "smollm2", or a `jaxkv.Model` (then ``dtype`` is unused; "auto": float32 on CPU, the
    checkpoint's bf16/fp32 on GPU/TPU).

    Settings: an `EngineConfig` (``config=``) and/or its flat keywords (``page_size=32``),
    each documented in `jaxkv.config`; an unknown keyword is a ValueError naming the nearest
    setting. The KV pool (per replica; with tensor parallelism each device holds 1/N of it)
    is sized by `jaxkv.engine.pool_plan`: ``num_pages`` if given, else what
    ``kv_cache_memory_bytes`` holds, else ``kv_cache_memory_fraction`` of the device's memory
    after the weights and the activations (on CPU: of the available RAM, at most 2 GiB),
    capped at ``max_num_seqs`` full-length sequences. ``max_model_len`` defaults to the
    model's context, or what the pool holds if less. The pool is logged at INFO and kept in
    ``kv_pool`` (a `KVPoolPlan`).

    ``tensor_parallel_size=N`` splits the model and its KV pages by head over N devices
    (`jaxkv.sharding`); ``data_parallel_size=M`` runs M such replicas on M * N devices behind
    this one LLM, each request routed to the replica caching the longest prefix of its prompt,
    else the least loaded (`jaxkv.engine.replicas`). ``kv_cache_dtype``: "int8" or
    "fp8_e4m3" pages hold about twice the tokens of bf16 KV in the same memory (four times
    fp32's); the pool sizing counts the scales. ``host_kv_cache_bytes``: host memory (per
    replica) for prefix-cache pages the device pool evicts.

    ``prefill_devices`` and ``decode_devices`` (disjoint lists of devices) disaggregate
    prefill from decode (`jaxkv.disagg`): prompts run on an engine on the first,
    decoding continues on an engine on the second, the KV pages the decode side lacks copied
    over in between. Each side is tensor parallel over all its devices:
    ``prefill_tensor_parallel_size`` / ``decode_tensor_parallel_size`` default to their
    counts (``tensor_parallel_size`` does not apply to them). Each side sizes its own pool
    as above (``kv_pool`` is the decode side's, ``prefill_kv_pool`` the prefill side's).
    """

    def __init__(self, model: Model | str | Path | None = None,
                 config: EngineConfig | None = None, **settings):
        bad = [k for k in settings if k not in field_sections()]
        if bad:
            raise ValueError(f"LLM: {unknown_setting(bad[0])}")
        cfg = EngineConfig.from_kwargs(config, **settings)
        use_compile_cache(cfg.runtime.compilation_cache_dir)
        par, dis = cfg.parallel, cfg.disagg
        tp, dp = par.tensor_parallel_size, par.data_parallel_size
        sides = _disaggregated_sides(dis, dp, [dis.prefill_tensor_parallel_size,
                                               dis.decode_tensor_parallel_size])
        devices = jax.devices()
        need = tp * dp
        if sides is None and need > len(devices):
            raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} needs "
                             f"{need} devices; {len(devices)} available")
        dtype = cfg.runtime.dtype
        quant = None if cfg.runtime.quantization == "none" else cfg.runtime.quantization
        if model is None:
            model = load_default(dtype=dtype)
        elif isinstance(model, (str, Path)):  # with N devices, each gets only its shards
            # load_pretrained resolves `quant` against the checkpoint (e.g. "int4" on an AWQ
            # folder of group 32 keeps its blocks), so its scheme may differ from parse(quant)
            model = load_pretrained(model, dtype=dtype, on_host=need > 1 or sides is not None,
                                    quantization=quant)
        elif not isinstance(model, Model):
            raise ValueError(f"model must be None, a checkpoint path or a jaxkv.Model, got "
                             f"{type(model).__name__}")
        elif quant is not None and model.quantization not in (None, QuantScheme.parse(quant)):
            raise ValueError(f"quantization={quant!r}, but the model passed is already "
                             f"quantized as {model.quantization.name!r}")
        if quant is not None and model.quantization is None:
            model = quantize(model, quant)
        split = [(devices[:need], tp)] if sides is None else sides
        proposer = proposer_for(cfg.scheduler.speculative_config)
        spec = None if proposer is None else proposer.load(model,
                                                           on_host=need > 1 or sides is not None)
        if spec is not cfg.scheduler.speculative_config:  # loaded once, for every engine
            cfg = EngineConfig.from_kwargs(cfg, speculative_config=spec)
        if sides is not None or proposer is not None and proposer.reads_every_position:
            # hand-offs carry every layer's pages, and a draft model reads every position's
            # pages of its own: local layers keep all
            cfg = EngineConfig.from_kwargs(cfg, window_kv=False)
        # disaggregated, the decode side speculates: the prefill side holds no draft
        cfgs = [cfg] if sides is None else \
            [EngineConfig.from_kwargs(cfg, speculative_config=None), cfg]
        pools = [plan_kv_pool(model, c, n, devs[0])
                 for (devs, n), c in zip(split, cfgs, strict=True)]
        self.config = cfg
        self.kv_pool = pools[-1]  # the decode side's, when disaggregated
        self.prefill_kv_pool = pools[0] if sides is not None else None
        self.model = model
        self._ids = itertools.count()
        max_len = min(p.max_model_len for p in pools)
        if sides is not None:  # one seed: the decode side continues the prefill side's samples
            prefill, decode = (Engine(model, _engine_config(c, pool, max_len),
                                      mesh=make_mesh(n, devs))
                               for (devs, n), pool, c in zip(sides, pools, cfgs, strict=True))
            self.engine = DisaggregatedEngine(prefill, decode)
        else:
            self.engine = self._colocated(model, cfg, devices, need, max_len)
        if cfg.runtime.warmup:
            self.engine.warmup()  # every program compiled before the first request

    def _colocated(self, model, cfg, devices, need: int, max_len: int):
        tp, dp = cfg.parallel.tensor_parallel_size, cfg.parallel.data_parallel_size
        meshes = [make_mesh(tp, devices[r * tp:(r + 1) * tp]) if need > 1 else None
                  for r in range(dp)]
        # Distinct seeds: unseeded requests on different replicas draw different numbers.
        engines = [Engine(model, _engine_config(cfg, self.kv_pool, max_len, seed_offset=r),
                          mesh=mesh) for r, mesh in enumerate(meshes)]
        return engines[0] if dp == 1 else ReplicatedEngine(engines)

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
        ``model`` then holds what the engines serve: a float `Model` given to a quantized LLM
        is quantized (once, for every engine) and ``model`` holds the quantized params."""
        scheme = self.model.quantization
        if isinstance(params, Model) and scheme is not None and params.quantization is None:
            params = quantize(params, scheme)
        self.engine.update_params(params, version=version, in_flight=in_flight)
        new = params.params if isinstance(params, Model) else params
        self.model = dataclasses.replace(self.model, params=new)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Waits until the programs ``background_warmup`` left compiling are ready (or
        ``timeout`` seconds pass); returns whether every one is. Immediately True without
        background_warmup."""
        return self.engine.wait_for_warmup(timeout)


def _engine_config(cfg: EngineConfig, pool, max_model_len: int, *,
                   seed_offset: int = 0) -> EngineConfig:
    """One engine's settings: the pool it was given (a `KVPoolPlan`), and its own seed."""
    return EngineConfig.from_kwargs(cfg, num_pages=pool.pages, max_model_len=max_model_len,
                                    num_window_slots=pool.window_slots or None,
                                    window_kv=bool(pool.window_slots),
                                    seed=cfg.runtime.seed + seed_offset)


def _disaggregated_sides(dis: DisaggConfig, data_parallel_size: int, tps):
    """[(prefill devices, tp), (decode devices, tp)], or None when not disaggregated."""
    if not dis.enabled:
        return None
    if dis.prefill_devices is None or dis.decode_devices is None:
        raise ValueError("prefill_devices and decode_devices go together: pass both")
    if data_parallel_size != 1:
        raise ValueError("data_parallel_size must be 1 with prefill_devices/decode_devices")
    sides = []
    for name, devs, tp in (("prefill", dis.prefill_devices, tps[0]),
                           ("decode", dis.decode_devices, tps[1])):
        devs = list(devs)
        tp = len(devs) if tp is None else tp  # a side is tensor parallel over its devices
        if len(devs) != tp:
            raise ValueError(f"{name}_devices lists {len(devs)} devices for "
                             f"{name}_tensor_parallel_size={tp}: they must match (leave it "
                             "unset: it defaults to the number of devices)")
        sides.append((devs, tp))
    if {d.id for d in sides[0][0]} & {d.id for d in sides[1][0]}:
        raise ValueError("prefill_devices and decode_devices overlap")
    return sides
