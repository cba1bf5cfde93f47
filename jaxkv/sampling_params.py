"""SamplingParams: how one request samples, with vLLM's field names and meanings."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping
from types import MappingProxyType

from jaxkv.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (vLLM's default cap)


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a streaming request holds (vLLM's names)."""

    CUMULATIVE = 0  # every output so far, on every step
    DELTA = 1  # only the tokens and text new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options; invalid values raise ValueError naming the field.

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 disables top-k; ``top_p=1`` disables
    nucleus sampling; ``min_p`` drops the tokens less likely than ``min_p`` times the most
    likely one (after the temperature, before top-k and top-p; 0 disables it). ``seed=None``
    lets the caller derive a reproducible seed from the request's index. Stop tokens (EOS unless
    ``ignore_eos``, and ``stop_token_ids``) end a sequence and are included in its token ids. As
    in vLLM, they cannot be sampled (their logits are masked) until ``min_tokens`` other tokens
    have been generated.

    ``logprobs=k`` returns, for every generated token, its log-probability and rank under the
    model's distribution (fp32 log-softmax of the raw logits, before temperature and top-k/p,
    as vLLM's default) and the k most likely tokens' (at most MAX_LOGPROBS).
    ``prompt_logprobs=k`` does the same for every prompt token after the first (None), given
    the tokens before it. As in vLLM, such a request's prompt is computed whole: it takes no
    prefix-cache hit (its pages are cached afterwards for others).

    ``stop`` strings (needs a tokenizer) end a sequence once its text contains one, even across
    token boundaries, and only after ``min_tokens``; the text is cut before the stop string
    (``include_stop_str_in_output`` keeps it) while token ids keep the token that completed it.
    Until a request finishes, its text holds back the last ``len(longest stop) - 1``
    characters, which a stop string could still claim (nothing with
    ``include_stop_str_in_output``: a cut then never reaches text already shown).
    ``output_kind`` chooses cumulative, delta or final-only outputs for streaming;
    ``skip_special_tokens`` applies to the text.

    Logits processors, in vLLM's order and meaning (`jaxkv.runtime.processors`):
    ``allowed_token_ids`` restricts sampling to those ids; ``bad_words`` (needs a tokenizer)
    bans a word's last token whenever the output ends with its other tokens; ``logit_bias``
    ({token id: bias}) is added to the logits; ``repetition_penalty`` divides a positive
    logit (multiplies a negative one) of every token in the prompt or the output;
    ``frequency_penalty`` x count and ``presence_penalty`` (once) are subtracted for every
    token in the output. A request using any of them decodes one step per host round trip
    (and does not speculate).

    ``structured_outputs`` (`jaxkv.StructuredOutputsParams`, or a dict of its fields: ``json``,
    ``regex``, ``choice``, ``grammar``, ``json_object``) constrains the output: at every step
    the tokens its grammar does not allow next are masked on device, after the processors
    above. It decodes one step per host round trip; without processors it speculates
    (``speculative_config``), its drafts cut before the first token the grammar refuses and
    each verified position masked by the grammar's state after the drafts before it. A
    grammar that is complete allows only EOS, so the output ends there (at ``max_tokens`` first: cut
    off, "length").

    ``speculate=False`` opts a request out of the engine's speculative decoding
    (``speculative_config``); speculation never changes what a request samples from.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # a str, or a list or tuple of them
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logprobs: int | None = None  # top-k logprobs per token (0: only the sampled token's)
    prompt_logprobs: int | None = None  # per prompt token (its first has none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # kept as a read-only mapping
    allowed_token_ids: tuple[int, ...] | None = None  # a list or tuple of ids
    bad_words: tuple[str, ...] = ()  # a list or tuple of strings
    speculate: bool = True  # with the engine's speculative_config: False opts this one out
    structured_outputs: StructuredOutputsParams | None = None  # or a dict of its fields
    min_p: float = 0.0  # (last: the fields before it keep their positions)

    def __post_init__(self):
        def fail(field, value, why):
            raise ValueError(f"SamplingParams.{field}={value!r}: {why}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_id(v):  # numpy integers too
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        try:
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams.of(self.structured_outputs))
        except ValueError as e:
            raise ValueError(f"SamplingParams.{e}") from None
        if not isinstance(self.speculate, bool):
            fail("speculate", self.speculate, "must be a bool")
        if not is_int(self.n) or self.n < 1:
            fail("n", self.n, "must be an int >= 1")
        t = self.temperature
        if not is_real(t) or t < 0:
            fail("temperature", t, "must be a finite number >= 0 (0 means greedy)")
        p = self.top_p
        if not is_real(p) or not 0 < p <= 1:
            fail("top_p", p, "must be in (0, 1]")
        m = self.min_p
        if not is_real(m) or not 0 <= m <= 1:
            fail("min_p", m, "must be in [0, 1] (0 disables it)")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", self.top_k, "must be an int >= -1 (0 or -1 disables top-k)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", self.max_tokens, "must be an int >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", self.min_tokens, "must be an int in [0, max_tokens]")
        if self.structured_outputs is not None and self.min_tokens:
            fail("min_tokens", self.min_tokens, "not with structured_outputs: the grammar "
                 "decides where the output ends (EOS may be all it allows)")
        if self.seed is not None and (not is_int(self.seed)
                                      or not -(2**63) <= self.seed < 2**64):
            fail("seed", self.seed, "must be None or an int in [-2**63, 2**64) (vLLM's range)")
        if isinstance(self.stop_token_ids, (str, bytes, int)):
            fail("stop_token_ids", self.stop_token_ids, "must be a sequence of token ids")
        stop = tuple(self.stop_token_ids or ())
        if any(not is_int(i) or i < 0 for i in stop):
            fail("stop_token_ids", self.stop_token_ids, "must be non-negative ints")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", self.ignore_eos, "must be a bool")
        object.__setattr__(self, "stop_token_ids", stop)
        if self.stop is None:
            words = ()
        elif isinstance(self.stop, str):
            words = (self.stop,)
        elif isinstance(self.stop, (list, tuple)):
            words = tuple(self.stop)
        else:
            words = (None,)  # neither a string nor a list of them
        if any(not isinstance(w, str) or not w for w in words):
            fail("stop", self.stop, "must be a non-empty string or a sequence of them")
        object.__setattr__(self, "stop", words)
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, getattr(self, name), "must be a bool")
        if self.logprobs is not None and (not is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", self.logprobs, f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
                not is_int(self.prompt_logprobs)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            fail("prompt_logprobs", self.prompt_logprobs,
                 f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", self.output_kind, "must be a RequestOutputKind")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_real(v) or not -2 <= v <= 2:
                fail(name, v, "must be a number in [-2, 2]")
        r = self.repetition_penalty
        if not is_real(r) or r <= 0:
            fail("repetition_penalty", r, "must be a finite number > 0 (1 disables it)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                fail("logit_bias", self.logit_bias, "must be a dict {token id: bias}")
            bias = {}
            for k, v in self.logit_bias.items():
                # JSON keys: ASCII digits only (str.isdigit also takes "²", which int() refuses)
                tid = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k
                if not is_id(tid) or tid < 0:
                    fail("logit_bias", self.logit_bias, f"key {k!r} is not a token id")
                if not isinstance(v, numbers.Real) or isinstance(v, bool) or \
                        not -100 <= v <= 100:
                    fail("logit_bias", self.logit_bias, f"bias {v!r} of token {k!r} must be a "
                         "number in [-100, 100] (OpenAI's range)")
                bias[int(tid)] = float(v)
            object.__setattr__(self, "logit_bias", MappingProxyType(bias) if bias else None)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes, int)) or not hasattr(ids, "__iter__"):
                fail("allowed_token_ids", ids, "must be a sequence of token ids")
            ids = tuple(ids)
            if not ids or any(not is_id(i) or i < 0 for i in ids):
                fail("allowed_token_ids", self.allowed_token_ids,
                     "must be a non-empty sequence of non-negative ints")
            object.__setattr__(self, "allowed_token_ids", tuple(int(i) for i in ids))
        words = self.bad_words
        words = () if words is None else (words,) if isinstance(words, str) else words
        if not isinstance(words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in words):
            fail("bad_words", self.bad_words, "must be a sequence of non-empty strings")
        object.__setattr__(self, "bad_words", tuple(words))

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming the field if a token id it holds is not in [0, vocab)."""
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            value = getattr(self, name)
            bad = [t for t in (value or ()) if t >= vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name}={value!r}: {bad[0]} is not a token id "
                                 f"in the vocabulary [0, {vocab_size})")

    def bad_words_ids(self, tokenizer, vocab_size: int) -> list[tuple[int, ...]]:
        """Token sequences of ``bad_words`` (vLLM's rule): each word as encoded alone and, when
        that is a different first token of the same length, after a space (mid-text). Raises
        ValueError naming the field for a word that encodes to nothing or past the vocabulary."""
        out: list[tuple[int, ...]] = []
        for word in self.bad_words:
            alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not alone or any(not 0 <= t < vocab_size for t in alone + spaced):
                raise ValueError(f"SamplingParams.bad_words={self.bad_words!r}: {word!r} "
                                 f"encodes to {list(alone)}, not tokens of the vocabulary "
                                 f"[0, {vocab_size})")
            out.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out

    def stop_ids(self, eos_token_ids) -> tuple[int, ...]:
        """Every token id that ends this sequence: ``stop_token_ids``, then EOS unless
        ``ignore_eos``."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys((*self.stop_token_ids, *eos)))

    def banned_ids(self, num_generated: int, eos_token_ids) -> tuple[int, ...]:
        """Ids the next token may not be (it is output token ``num_generated``, from 0): the
        stop ids while fewer than ``min_tokens`` tokens have been generated."""
        return self.stop_ids(eos_token_ids) if num_generated < self.min_tokens else ()

    def finish_reason(self, token: int, num_generated: int, eos_token_ids) -> str | None:
        """Why a sequence ends after sampling `token` as its `num_generated`-th output token:
        "stop" (a stop token; masked until min_tokens are out, so it comes after them),
        "length" (max_tokens), or None."""
        stop = token in self.stop_token_ids or (token in eos_token_ids and not self.ignore_eos)
        if stop and num_generated > self.min_tokens:
            return "stop"
        return "length" if num_generated >= self.max_tokens else None

    @property
    def edits_logits(self) -> bool:
        """It uses a logits processor (`uses_processors`) or a structured output's mask."""
        return self.structured_outputs is not None or self.uses_processors

    @property
    def uses_processors(self) -> bool:
        """It uses a logits processor: penalties, logit_bias, allowed ids, bad words."""
        return bool(self.repetition_penalty != 1 or self.frequency_penalty
                    or self.presence_penalty or self.logit_bias
                    or self.allowed_token_ids is not None or self.bad_words)

    @property
    def stop_buffer(self) -> int:
        """Characters an unfinished text holds back: a stop string may still end there."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(w) for w in self.stop) - 1
