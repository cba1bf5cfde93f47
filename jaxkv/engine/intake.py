"""Request intake: a new request's prompt and sampling settings checked against the model and
the engine's limits (every error a ValueError naming the field), and its sample streams built.
"""

from __future__ import annotations

import dataclasses
import numbers

from jaxkv.config import cdiv
from jaxkv.engine.detokenizer import IncrementalDetokenizer
from jaxkv.engine.request import Request
from jaxkv.model.pretrained import Model
from jaxkv.runtime.sampling import check_bannable, sample_keys
from jaxkv.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may use of an engine."""

    max_model_len: int
    num_pages: int
    page_size: int
    max_num_seqs: int
    prompt_only: bool = False  # a prefill engine: holds a request only until its first token


def prompt_ids(model: Model, prompt, prompt_token_ids) -> list[int]:
    """The prompt's token ids (text ``prompt`` encoded, or ``prompt_token_ids`` checked)."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("pass exactly one of prompt (text) and prompt_token_ids")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__} "
                             "(token ids go in prompt_token_ids)")
        if not prompt:
            raise ValueError("prompt is empty")
        ids = model.encode(prompt)
        if not ids:
            raise ValueError(f"prompt {prompt!r} encodes to no tokens")
        return ids
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
        raise ValueError("prompt_token_ids must be a sequence of ints, got "
                         f"{type(prompt_token_ids).__name__}")
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids is empty")
    vocab = model.config.vocab_size
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ValueError(f"prompt_token_ids[{i}]={t!r} is not a token id in the "
                             f"vocabulary [0, {vocab})")
    return [int(t) for t in prompt_token_ids]


def check_fits(request_id: str, prompt_len: int, sp: SamplingParams, model: Model,
               limits: RequestLimits) -> None:
    """Raises ValueError when the request cannot run even alone on an engine of ``limits``,
    or when its sampling settings do not fit the model."""
    max_len, num_pages, page_size = limits.max_model_len, limits.num_pages, limits.page_size
    if limits.prompt_only:
        total = prompt_len + 1
        need = cdiv(prompt_len, page_size)
        if prompt_len >= max_len or need > num_pages:
            raise ValueError(f"request {request_id!r}: the prompt ({prompt_len} tokens, "
                             f"{need} pages) does not fit the prefill engine "
                             f"(max_model_len={max_len}, {num_pages} pages)")
    else:
        total = prompt_len + sp.max_tokens
    if prompt_len >= max_len:
        raise ValueError(f"request {request_id!r}: the prompt has {prompt_len} tokens; "
                         f"max_model_len={max_len} leaves no room to generate")
    if total > max_len:
        raise ValueError(f"request {request_id!r}: prompt ({prompt_len} tokens) + "
                         f"max_tokens ({sp.max_tokens}) = {total} tokens exceeds "
                         f"max_model_len={max_len}")
    need = cdiv(total - 1, page_size)  # the last sampled token's KV is never stored
    if need > num_pages:
        raise ValueError(f"request {request_id!r} needs {need} KV pages ({prompt_len} prompt "
                         f"+ {sp.max_tokens} max_tokens tokens at page_size "
                         f"{page_size}) but the cache has only {num_pages} pages")
    vocab, tok = model.config.vocab_size, model.tokenizer
    sp.check_vocab(vocab)
    if sp.n > limits.max_num_seqs:
        raise ValueError(f"SamplingParams.n={sp.n} exceeds max_num_seqs={limits.max_num_seqs}")
    for name, what in (("stop", "stop strings"), ("bad_words", "bad words")):
        if getattr(sp, name) and tok is None:
            raise ValueError(f"SamplingParams.{name}={getattr(sp, name)!r}: {what} need a "
                             "model with a tokenizer (stop_token_ids, logit_bias and "
                             "allowed_token_ids take token ids)")
    check_bannable(sp, model.config.eos_token_ids)
    words = sp.bad_words_ids(tok, vocab) if sp.bad_words else []
    if sp.allowed_token_ids is not None:
        # A row whose every allowed token is masked has nothing to sample: refuse it here.
        masked = {w[0] for w in words if len(w) == 1}  # banned at every step
        early = set(sp.stop_ids(model.config.eos_token_ids)) if sp.min_tokens else set()
        if set(sp.allowed_token_ids) <= masked | early:
            why = "banned by bad_words" if set(sp.allowed_token_ids) <= masked else \
                f"a stop token, which cannot be sampled until min_tokens={sp.min_tokens} are out"
            raise ValueError(f"SamplingParams.allowed_token_ids={sp.allowed_token_ids!r}: "
                             f"every allowed token is {why}, so no token could be sampled")


def new_samples(request_id: str, ids: list[int], sp: SamplingParams, *, index: int,
                now: float, cache_salt: str | None, model: Model, engine_seed: int,
                grammars=None) -> list[Request]:
    """The request's ``sp.n`` sample streams (sample 0 prefills the prompt; the others fork
    from it), each with its own key, detokenizer and, with structured outputs, grammar state
    (compiled by ``grammars``, a `GrammarCompiler`: ValueError naming the field)."""
    tok = model.tokenizer
    grammar = None if sp.structured_outputs is None else grammars.compile(sp.structured_outputs)
    samples = [Request(request_id, ids, sp, index, now, sample_index=j, cache_salt=cache_salt,
                       key=key, detok=None if tok is None else IncrementalDetokenizer(
                           tok, ids, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
                           include_stop_str_in_output=sp.include_stop_str_in_output))
               for j, key in enumerate(sample_keys(engine_seed, sp, index))]
    if sp.bad_words:
        words = sp.bad_words_ids(tok, model.config.vocab_size)
        for s in samples:
            s.bad_words_ids = words
    for s in samples if grammar is not None else ():
        s.grammar = grammar.matcher()
    samples[0].forks = samples[1:]
    return samples
