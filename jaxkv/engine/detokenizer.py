"""Incremental detokenization and stop strings (plain Python, no jax).

Decoding a whole sequence after every token costs time quadratic in its length, and decoding
one token at a time breaks characters that span tokens (a byte-level BPE splits UTF-8 bytes)
and words whose leading space depends on the token before. `IncrementalDetokenizer` decodes
only a short window: the tokens since the last emitted text plus the few before them, and emits
new text only once it does not end in a partial character (U+FFFD), as vLLM does.

Stop strings are searched only in the text that can contain a new match: the new text and the
``len(stop) - 1`` characters before it, so a stop string split across tokens is found.
"""

from __future__ import annotations

from collections.abc import Sequence

_CONTEXT = 5  # prompt tokens decoded before the first output token, for spacing


class IncrementalDetokenizer:
    """Text of one sample's output tokens, appended token by token."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix, self._read = 0, len(self._ids)  # window start; end of decoded text
        self._stop = tuple(stop)
        self._keep_stop = include_stop_str_in_output
        self.text = ""  # the output so far (cut at a stop string once one is found)
        self._fresh = 0  # where the last push's new text starts
        self._cleanup_kw = True
        self._before: str | None = None  # the decode of the window's emitted part (cached)
        self.stop_reason: str | None = None  # the stop string that ended it

    def _decode(self, ids) -> str:
        # No clean-up of spaces around punctuation (Llama-3's tokenizer config turns it on):
        # it can shorten a window's text, which would make the windows disagree.
        if self._cleanup_kw:
            try:
                return self._tok.decode(ids, skip_special_tokens=self._skip,
                                        clean_up_tokenization_spaces=False)
            except TypeError:  # a tokenizer without the option
                self._cleanup_kw = False
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token: int) -> None:
        """Appends one token (its text appears once its characters are complete)."""
        if self.stop_reason is not None:
            raise ValueError("push after a stop string ended the sequence")
        self._ids.append(int(token))
        self._fresh = len(self.text)
        if self._before is None:  # the window moved: one decode of its emitted part
            self._before = self._decode(self._ids[self._prefix:self._read])
        before = self._before
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(before) or full.endswith("\ufffd"):
            return  # nothing new, or a character still incomplete: wait for more
        self.text += full[len(before):]
        self._prefix, self._read, self._before = self._read, len(self._ids), None

    def find_stop(self) -> bool:
        """Whether the last push's text completed a stop string (searched in that text and
        the ``len(stop) - 1`` characters before it); if so the text is cut before it (after it
        with include_stop_str_in_output) and ``stop_reason`` names it."""
        best = None
        for s in self._stop:
            at = self.text.find(s, max(0, self._fresh - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        self.text = self.text[:at + len(s)] if self._keep_stop else self.text[:at]
        self.stop_reason = s
        return True
