"""`jaxkv.generate`: batched generation over the paged KV cache, and the no-cache baseline.

Every sequence reserves the pages for prompt + max_tokens up front (a small host allocator);
the serving engine instead allocates as it goes and shares prefixes. ``generate_no_cache``
recomputes the whole sequence at every step, the O(N^2) baseline the KV cache removes.

This is the minimal path (one function, no engine): it has no stop strings, no logprobs, no
logits processors or structured outputs (each refused with an error naming the field), no
speculative decoding, no prefix cache across calls, no preemption (every sequence reserves
its pages up front), no tensor parallelism and no streaming. `jaxkv.LLM` and `jaxkv.Engine`
have all of those, on the same step programs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from jaxkv.cache.allocator import PageAllocator
from jaxkv.config import cdiv
from jaxkv.config_checks import power_of_two
from jaxkv.kv import init_state, kv_bytes_per_token
from jaxkv.model.pretrained import Model
from jaxkv.runtime.batch import PageTable, Row, build_batch, pow2
from jaxkv.runtime.processors import has_processors
from jaxkv.runtime.sampling import (
    MAX_BANNED,
    RowSettings,
    SamplingArrays,
    check_bannable,
    request_key,
)
from jaxkv.runtime.steps import (
    MAX_STOP_IDS,
    DecodeLoopBatch,
    LoopRow,
    decode_loop_batch,
    default_decode_steps,
    make_steps,
)
from jaxkv.sampling_params import SamplingParams
from pallas_kernels.quant import storage_dtype

_DEFAULT = SamplingParams()

DEFAULT_TOKEN_BUDGET = 2048  # prompt tokens per prefill step
MIN_WIDTH = 8  # pages per sequence in the page table at least (shorter calls share programs)


@dataclasses.dataclass
class _Seq:
    slot: int
    prompt: list[int]
    params: SamplingParams
    key: np.ndarray  # u32[2]
    pages: list[int]
    out: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    done: bool = False
    own: list[int] = dataclasses.field(default_factory=list)  # pages it allocated
    owner: _Seq | None = None  # an earlier sequence whose first prompt pages it reads
    shared: int = 0  # prompt tokens whose KV those pages hold

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


@dataclasses.dataclass
class GenerationStats:
    """What one `generate` call did, for demos and benchmarks."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    kv_pages_used: int = 0
    page_size: int = 0
    kv_bytes_per_token: int = 0
    computed_prompt_tokens: int = 0  # prompt tokens prefilled (shared full pages are not)
    # After each step that sampled: seconds since the call started, tokens generated so far.
    token_times: list[float] = dataclasses.field(default_factory=list)
    token_counts: list[int] = dataclasses.field(default_factory=list)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.decode_seconds + self.prefill_seconds, 1e-9)


def _prompts_to_ids(model: Model, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        raise ValueError("prompts must be a list of prompts (strings or token-id lists), "
                         "not a single prompt")
    ids = []
    for i, p in enumerate(prompts):
        toks = model.encode(p) if isinstance(p, str) else [int(t) for t in p]
        if not toks:
            raise ValueError(f"prompts[{i}] is empty")
        bad = [t for t in toks if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the vocabulary "
                             f"[0, {model.config.vocab_size})")
        ids.append(toks)
    return ids


def _per_prompt(sampling, n_prompts) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n_prompts
    if isinstance(sampling, SamplingParams):
        return [sampling] * n_prompts
    sampling = list(sampling)
    if len(sampling) != n_prompts:
        raise ValueError(f"sampling has {len(sampling)} entries for {n_prompts} prompts")
    return sampling


def _share_prefixes(seqs: list[_Seq], page_size: int) -> None:
    """Points each sequence at an earlier one whose first full prompt pages hold the same
    tokens (the longest such run that leaves a prompt token to compute): ``owner`` and
    ``shared`` tokens. Shared prompt pages are full and never written again: nothing copies."""
    seen: dict[tuple, _Seq] = {}
    for s in seqs:
        for k in range((len(s.prompt) - 1) // page_size, 0, -1):
            owner = seen.get(tuple(s.prompt[:k * page_size]))
            if owner is not None:
                s.owner, s.shared = owner, k * page_size
                break
        for k in range(1, len(s.prompt) // page_size + 1):
            seen.setdefault(tuple(s.prompt[:k * page_size]), s)


def _loop_batch(seqs: list[_Seq], table: PageTable, eos, steps: int) -> DecodeLoopBatch:
    """The decode loop's inputs for every live sequence (row = slot); the others idle."""
    live = [s for s in seqs if not s.done]
    for s in live:
        table.update(s.slot, s.pages, 0, s.slot)
    return decode_loop_batch([LoopRow(s.slot, s.out[-1], len(s.tokens) - 1, steps, len(s.out),
                                      s.params, s.key) for s in live],
                             table.table.copy(), eos, steps)


def generate_with_stats(model: Model, prompts, sampling=None, *, page_size: int = 16,
                        prefill_chunk: int | None = None, attention_impl: str = "auto",
                        recompute: bool = False, exact_shapes: bool = False,
                        token_budget: int = DEFAULT_TOKEN_BUDGET, kv_cache_dtype: str = "auto"):
    """`generate`, also returning a GenerationStats.

    Shapes are bucketed so that calls with other lengths reuse the programs compiled before:
    rows and the page-table width are powers of two (the width at least MIN_WIDTH pages),
    the pool holds rows x width pages, and prompt tokens per step are a power of two. Decoding
    runs the runtime's multi-step decode loop (the serving engine's), the next loop dispatched
    before the current one's tokens are read.

    ``recompute=True`` is the no-cache baseline. ``exact_shapes=True`` pads token counts only
    to a multiple of 16 and sizes everything exactly (a program per 16 tokens), and decodes
    one step per host round trip, so that timing a baseline measures its work rather than
    bucket padding.
    """
    power_of_two("page_size", page_size)
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
    cfg = model.config
    kv_dtype = storage_dtype(kv_cache_dtype, model.dtype)
    ids = _prompts_to_ids(model, prompts)
    params_list = _per_prompt(sampling, len(ids))

    seqs: list[_Seq] = []
    for i, (prompt, sp) in enumerate(zip(ids, params_list, strict=True)):
        _check_supported(sp)
        check_bannable(sp, cfg.eos_token_ids)
        seed = i if sp.seed is None else sp.seed
        for j in range(sp.n):
            seqs.append(_Seq(len(seqs), prompt, sp, request_key(seed, j), []))
    if not recompute:
        _share_prefixes(seqs, page_size)
    pages_per_seq = [cdiv(len(s.prompt) + s.params.max_tokens, page_size) for s in seqs]
    if exact_shapes:
        rows, width, num_pages = len(seqs), max(pages_per_seq), sum(pages_per_seq)
    else:
        rows, width = pow2(len(seqs)), max(MIN_WIDTH, pow2(max(pages_per_seq)))
        num_pages = rows * width
    allocator = PageAllocator(num_pages)
    for s, n in zip(seqs, pages_per_seq, strict=True):
        k = s.shared // page_size
        s.own = allocator.allocate(n - k)
        s.pages = (s.owner.pages[:k] if k else []) + s.own
        s.prefilled = s.shared  # those tokens' KV: the owner's pages, once it wrote them
    state = init_state(cfg, num_pages, page_size, model.dtype, kv_cache_dtype)
    table = PageTable(rows, width, num_pages, page_size)
    eos = cfg.eos_token_ids
    loop_steps = 0 if exact_shapes or recompute else default_decode_steps()
    if any(len(s.params.stop_ids(eos)) > MAX_STOP_IDS for s in seqs):
        loop_steps = 0  # more stop ids than the loop checks on device: a step at a time
    steps = make_steps(model.graphdef, attention_impl, None, max(loop_steps, 1))
    stats = GenerationStats(prompt_tokens=sum(len(s.prompt) for s in seqs),
                            kv_pages_used=allocator.num_used, page_size=page_size,
                            kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype))

    def tokens_bucket(n):
        return cdiv(n, 16) * 16 if exact_shapes else pow2(max(n, 16))

    def took(s: _Seq, tok: int) -> None:
        s.out.append(tok)
        if s.params.finish_reason(tok, len(s.out), eos) is not None:
            s.done = True

    def tick() -> None:
        stats.token_times.append(time.perf_counter() - t0)
        stats.token_counts.append(sum(len(s.out) for s in seqs))

    def run(rows_, finishing):
        """One step; samples a token for each row in `finishing` (a slot -> seq map)."""
        nonlocal state
        batch = build_batch(rows_, table, tokens_bucket=tokens_bucket(sum(len(r.tokens)
                                                                           for r in rows_)),
                            vocab_size=cfg.vocab_size)
        # Sample every row (rows that are not finishing a prompt are greedy and ignored).
        keys, step = np.zeros((rows, 2), np.uint32), np.zeros(rows, np.int32)
        banned = np.full((rows, MAX_BANNED), -1, np.int32)
        for i, s in finishing.items():
            keys[i], step[i] = s.key, len(s.out)
            ids = s.params.banned_ids(len(s.out), eos)
            banned[i, :len(ids)] = ids
        settings = RowSettings.of(rows, [(i, s.params) for i, s in finishing.items()])
        tokens, _, _, state = steps.step(model.params, state, batch, keys,
                                         SamplingArrays(settings, step, banned))
        stats.steps += 1
        if not finishing:
            return
        tokens = np.asarray(tokens)
        for i, s in finishing.items():
            took(s, int(tokens[i]))
        tick()

    # Prefill: chunks of every prompt, packed under a token budget.
    t0 = time.perf_counter()
    if not recompute:
        pending = list(seqs)
        while pending:
            rows_, finishing, budget = [], {}, token_budget
            written = {s.slot: s.prefilled for s in seqs}  # by the steps before this one
            for s in list(pending):
                if s.owner is not None and written[s.owner.slot] < s.shared:
                    continue  # the owner has not written the pages it shares yet
                take = len(s.prompt) - s.prefilled
                take = min(take, prefill_chunk or take)
                if rows_ and take > budget:
                    break
                rows_.append(Row(s.slot, s.prompt[s.prefilled:s.prefilled + take],
                                 s.prefilled, s.pages, owner=s.slot))
                s.prefilled += take
                budget -= take
                if s.prefilled == len(s.prompt):
                    finishing[s.slot] = s
                    pending.remove(s)
            run(rows_, finishing)
    t1 = time.perf_counter()
    stats.prefill_seconds = t1 - t0

    if loop_steps:
        # Decode on device, loop after loop: each is dispatched from the one before (its
        # pending tokens and positions stay on the device) before that one's tokens are read.
        if any(not s.done for s in seqs):
            loop = _loop_batch(seqs, table, eos, loop_steps)
            out, after, state = steps.decode_loop(model.params, state, loop)
            while True:
                following = None
                if not all(s.done for s in seqs):
                    following = steps.decode_loop(model.params, state, after)
                    state = following[2]
                got = np.asarray(out)
                stats.steps += int((got >= 0).any(axis=1).sum())
                for s in seqs:
                    for tok in got[:, s.slot]:
                        if tok >= 0 and not s.done:
                            took(s, int(tok))
                tick()
                if all(s.done for s in seqs) or following is None:
                    break
                out, after, _ = following
    else:
        # One token per live sequence per step (or the whole sequence, recomputed).
        while True:
            live = [s for s in seqs if not s.done and (s.out or recompute)]
            if not live:
                break
            if recompute:
                rows_ = [Row(s.slot, s.tokens, 0, s.pages, owner=s.slot) for s in live]
            else:
                rows_ = [Row(s.slot, s.out[-1:], len(s.tokens) - 1, s.pages, owner=s.slot)
                         for s in live]
            run(rows_, {s.slot: s for s in live})
    stats.decode_seconds = time.perf_counter() - t1
    stats.generated_tokens = sum(len(s.out) for s in seqs)
    for s in seqs:
        allocator.free(s.own)
    allocator.check()
    stats.computed_prompt_tokens = sum(len(s.prompt) - s.shared for s in seqs)
    return [s.out for s in seqs], stats


def _check_supported(sp: SamplingParams) -> None:
    """Raises ValueError naming the field `generate` does not serve (it returns ids only)."""
    if sp.stop:
        raise ValueError(f"SamplingParams.stop={sp.stop!r}: jaxkv.generate returns token "
                         "ids only; use jaxkv.LLM or jaxkv.Engine for stop strings")
    for field in ("logprobs", "prompt_logprobs"):
        if getattr(sp, field) is not None:
            raise ValueError(f"SamplingParams.{field}={getattr(sp, field)!r}: "
                             "jaxkv.generate returns token ids only; use jaxkv.LLM or "
                             "jaxkv.Engine")
    if has_processors(sp):
        field = next(f for f in ("structured_outputs", "presence_penalty", "frequency_penalty",
                                 "repetition_penalty", "logit_bias", "allowed_token_ids",
                                 "bad_words") if getattr(sp, f) != getattr(_DEFAULT, f))
        raise ValueError(f"SamplingParams.{field}={getattr(sp, field)!r}: jaxkv.generate "
                         "has no logits processors or structured outputs; use jaxkv.LLM or "
                         "jaxkv.Engine")


def generate(model: Model, prompts: Sequence, sampling=None, *, page_size: int = 16,
             prefill_chunk: int | None = None, attention_impl: str = "auto",
             kv_cache_dtype: str = "auto") -> list[list[int]]:
    """Generated token ids for each prompt (``n`` consecutive entries per prompt when n > 1).

    ``prompts``: token-id lists, or strings when the model has a tokenizer. ``sampling``: one
    SamplingParams for all prompts or one per prompt. ``prefill_chunk`` splits long prompts.
    ``kv_cache_dtype``: "auto" (the compute dtype), "int8" or "fp8_e4m3" (see `Engine`).
    """
    out, _ = generate_with_stats(model, prompts, sampling, page_size=page_size,
                                 prefill_chunk=prefill_chunk, attention_impl=attention_impl,
                                 kv_cache_dtype=kv_cache_dtype)
    return out


def generate_no_cache(model: Model, prompts: Sequence, sampling=None, *, page_size: int = 16,
                      attention_impl: str = "auto") -> list[list[int]]:
    """Same outputs as `generate`, recomputing every token's K/V at every step (no reuse)."""
    out, _ = generate_with_stats(model, prompts, sampling, page_size=page_size,
                                 attention_impl=attention_impl, recompute=True)
    return out
