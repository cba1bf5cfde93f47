"""Grammars of structured outputs, compiled by llguidance: one `GrammarCompiler` per tokenizer
(cached by what a grammar depends on, thread-safe, so a server compiles off the engine
thread), and one `Matcher` per sample stream, which says which tokens may come next (a packed
row of the step's bitmask) and takes the tokens sampled.

Why llguidance: it installs as one wheel with no dependencies and fills masks into numpy
arrays from Rust threads; xgrammar, the other backend vLLM and SGLang use, requires torch and
triton, too much for a JAX engine on a TPU VM. Both are measured by `jaxkv bench structured`
(docs/BENCHMARKS.md#structured-outputs-issue-30).

The bitmask: int32[B, ceil(V / 32)], bit j of word w allowing token 32 w + j (llguidance's
and xgrammar's layout); `jaxkv.runtime.processors.apply_token_bitmask` unpacks it on device.

What compiles is also checked to be servable (issue 43), so that a request that cannot be is
refused when it is added rather than failing, or ending empty, mid-generation: a grammar or
schema that can never be complete (`jaxkv.structured.finite`), or whose first step already
allows nothing, is a ValueError naming the field. A choice is one lexeme (an alternation in
llguidance's lexer, not one Earley item per option, which overflowed its 2000 items per row).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

from jaxkv.structured.finite import json_schema_endless, lark_endless, lark_too_wide
from jaxkv.structured.params import JSON_WHITESPACE, StructuredOutputsParams

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as e:  # a core dependency: only a broken install lacks it
        raise RuntimeError("structured outputs need the llguidance package "
                           "(pip install llguidance)") from e
    return llguidance


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _brief(error: str) -> str:
    """llguidance's error without the parser state it appends."""
    return error.split("\n", 1)[0]


class Matcher:
    """One sample stream's grammar state; ``field`` names the request field it enforces
    (``structured_outputs.json``...)."""

    def __init__(self, matcher, field: str = "structured_outputs"):
        self.ll = matcher  # llguidance's LLMatcher
        self.field = field

    def consume(self, token: int) -> bool:
        """Takes a sampled token; False if the grammar did not allow it (the matcher is then
        in an error state)."""
        return bool(self.ll.consume_token(int(token)))

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask[row]``."""
        _llguidance().numpy.fill_next_token_bitmask(self.ll, bitmask, row)

    def valid_prefix(self, tokens) -> int:
        """How many of ``tokens`` the grammar accepts in a row from here (its state kept)."""
        return int(self.ll.validate_tokens([int(t) for t in tokens]))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (not even whitespace)."""
        return bool(self.ll.is_stopped())

    @property
    def error(self) -> str | None:
        return _brief(self.ll.get_error()) if self.ll.is_error() else None

    def refusal(self, token: int, restrictions: Sequence[str] = ()) -> str:
        """Why the stream ends after `consume` refused ``token``: llguidance's error, and the
        ``restrictions`` (logit_bias...) the request used, which may have banned every token
        the grammar allows (it never blames fields the request did not use)."""
        why = f"{self.field}: the grammar cannot go on with token {token} " \
              f"({self.error or 'not allowed here'})"
        if restrictions:
            why += f"; did {' or '.join(restrictions)} ban every token the grammar allows?"
        return why


class Grammar:
    """A compiled grammar: `matcher` starts a sample stream on it."""

    def __init__(self, prototype, params: StructuredOutputsParams):
        self._proto, self.params = prototype, params

    def matcher(self) -> Matcher:
        return Matcher(self._proto.deep_copy(), f"structured_outputs.{self.params.kind}")


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer and model vocabulary, keeping the
    last ``cache_size`` grammars. ``compile`` may run on any thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256):
        self.vocab_size, self.cache_size = vocab_size, cache_size
        self._tokenizer, self._eos = tokenizer, list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict = OrderedDict()
        self._executor = None
        self.hits = self.misses = 0

    def fresh(self) -> GrammarCompiler:
        """A compiler with an empty cache and this one's tokenizer (for timing compiles)."""
        other = GrammarCompiler(self._tokenizer, self.vocab_size, self._eos, self.cache_size)
        other._ll_tokenizer = self.tokenizer()
        return other

    def tokenizer(self):
        """llguidance's view of the tokenizer (built once: about a second for 50k tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise ValueError("structured_outputs: the model has no tokenizer")
                ll = _llguidance()
                self._ll_tokenizer = ll.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The grammar of ``params`` (cached); ValueError naming the field it cannot compile."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        tokenizer, ll = self.tokenizer(), _llguidance()
        text = grammar_text(params)
        # errors without the grammar and parser state (a whole schema in a 400 or a log line)
        matcher = ll.LLMatcher(tokenizer, text, log_level=0,
                               limits=ll.LLParserLimits(verbose_errors=False))
        field = f"structured_outputs.{params.kind}"
        if matcher.is_error():
            raise ValueError(f"{field}: {_brief(matcher.get_error())}")
        why = endless(params) or self._first_step(matcher, params)
        if why:
            raise ValueError(f"{field}: {why}")
        grammar = Grammar(matcher, params)
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _first_step(self, matcher, params: StructuredOutputsParams) -> str | None:
        """Why the first step of ``matcher`` (a copy of it) cannot be served: it allows no
        token (llguidance stops at once, an empty "stop"), or, for JSON, it may end there."""
        import numpy as np  # host bookkeeping imports no numpy at module level

        probe = matcher.deep_copy()
        _llguidance().numpy.fill_next_token_bitmask(
            probe, np.zeros((1, bitmask_words(self.vocab_size)), np.int32), 0)
        if probe.is_error() or (probe.is_stopped() and not probe.is_accepting()):
            error = _brief(probe.get_error()) if probe.is_error() else probe.stop_reason()
            return f"matches no output at all (no token may come first; llguidance: {error})"
        if params.kind in ("json", "json_object") and probe.is_accepting():
            return "accepts an empty output, which is not JSON"
        return None

    def fill(self, rows: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Fills ``bitmask[row]`` for every (matcher, row), in parallel on llguidance's
        threads."""
        if len(rows) == 1:
            rows[0][0].fill(bitmask, rows[0][1])
            return
        _llguidance().numpy.fill_next_token_bitmask_par(
            self._threads(), [(m.ll, r) for m, r in rows], bitmask)

    def _threads(self):
        """llguidance's thread pool for filling masks (made on first use)."""
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        return self._executor

    def fill_with_drafts(self, rows: list[tuple[Matcher, int, list[int]]],
                         bitmask: np.ndarray) -> None:
        """For every (matcher, row, drafts): fills ``bitmask[row + j]``, j = 0..len(drafts),
        with the tokens allowed after ``drafts[:j]`` (the masks of a speculating row's
        positions; each matcher's state is kept), in parallel on llguidance's threads."""
        drafting = [(m.ll, r, [int(t) for t in d]) for m, r, d in rows if len(d)]
        if drafting:
            _llguidance().numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self._threads(), drafting, bitmask)
        plain = [(m, r) for m, r, d in rows if not len(d)]
        if plain:
            self.fill(plain, bitmask)


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def grammars_for(tokenizer, vocab_size: int, eos_token_ids) -> GrammarCompiler:
    """The `GrammarCompiler` of a tokenizer, shared by every engine serving it (replicas, the
    two sides of disaggregation, a server compiling ahead of `Engine.add_request`)."""
    if tokenizer is None:
        return GrammarCompiler(None, vocab_size, eos_token_ids)
    key = (vocab_size, tuple(eos_token_ids))
    with _SHARED_LOCK:
        compilers = _SHARED.setdefault(tokenizer, {})
        if key not in compilers:
            compilers[key] = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        return compilers[key]


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``params``; ValueError naming the field."""
    from llguidance import LLMatcher

    kind = params.kind
    options = {"whitespace_flexible": False} if params.disable_any_whitespace else \
        {"whitespace_pattern": params.whitespace_pattern or JSON_WHITESPACE}
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(json.dumps(params.json), overrides=options)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":  # one lexeme: llguidance's lexer takes 10,000s of options
            return LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice))
        from llguidance.gbnf_to_lark import any_to_lark

        return LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    except Exception as e:  # noqa: BLE001 - the backend's own parse errors
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


def endless(params: StructuredOutputsParams) -> str | None:
    """Why no output of ``params``' grammar or schema can ever be complete, or why its parser
    cannot take a step (None if it can): `jaxkv.structured.finite`."""
    if params.kind == "json":
        return json_schema_endless(params.json)
    if params.kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        lark = any_to_lark(params.grammar)
        return lark_endless(lark) or lark_too_wide(lark)
    return None
