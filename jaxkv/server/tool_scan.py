"""Finding tool calls in a reply while it is still being written, for streaming them.

`CallScanner` reads the JSON of the calls in a growing text, one character once: each call
object (``{"name": ..., "arguments" | "parameters": ...}``, alone, one after another, or in a
top-level array) with its name once that string is complete, and where its arguments' text
starts and, once complete, ends. A streamed call is announced when its name is known and its
arguments follow as the model writes them: every character sent is inside the arguments'
value, so the pieces add up to exactly the text of the finished reply's arguments. (Arguments
written as a JSON string are sent once complete, decoded.)
"""

from __future__ import annotations

import dataclasses
import json

ARGUMENT_KEYS = ("arguments", "parameters")  # hermes and mistral; Llama 3 and "required"


@dataclasses.dataclass
class PartialCall:
    """A call object seen so far: its ``name`` once complete, and the arguments' text span
    (``start``: where the value begins; ``end``: None while it is still open)."""

    name: object = None
    start: int | None = None
    end: int | None = None
    quoted: bool = False  # the arguments are a JSON string (its text is the arguments)
    closed: bool = False  # the call object is complete

    def arguments(self, text: str) -> str:
        """The arguments' text written so far ("" before they start; "{}" for a complete call
        without arguments)."""
        if self.start is None:
            return "{}" if self.closed else ""
        if self.quoted:
            return json.loads(text[self.start:self.end])
        return text[self.start:len(text) if self.end is None else self.end]


class CallScanner:
    """The call objects of a growing text from ``start`` on (objects at the top level or in a
    top-level array; other text between them is skipped: markers, separators). `feed` takes
    the whole text so far and reads only what is new."""

    def __init__(self, start: int = 0):
        self.calls: list[PartialCall] = []
        self.i = start  # the next character to read
        self._stack: list[str] = []  # open containers
        self._level = 0  # the depth inside the current call object (0: none open)
        self._key, self._want_key, self._value = None, False, None  # at the call's depth
        self._string: int | None = None  # where an unfinished string began
        self._escaped = False

    def feed(self, text: str) -> list[PartialCall]:
        while self.i < len(text):
            if self._string is not None:
                if not self._read_string(text):
                    break
                continue
            self._read(text, text[self.i])
        return self.calls

    def _at_call(self) -> bool:
        return bool(self._level) and len(self._stack) == self._level

    def _read_string(self, text: str) -> bool:
        """Reads on in the current string; False if the text ends first."""
        i = self.i
        while i < len(text):
            c = text[i]
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                start, self._string, self.i = self._string, None, i + 1
                self._took_string(text, start, i + 1)
                return True
            i += 1
        self.i = i
        return False

    def _took_string(self, text: str, start: int, end: int) -> None:
        if not self._at_call():
            return
        call = self.calls[-1]
        if self._want_key:
            self._key, self._want_key = json.loads(text[start:end]), False
        elif self._value == "name" and call.name is None:
            call.name, self._value = json.loads(text[start:end]), None
        elif self._value in ARGUMENT_KEYS and call.start is None:
            call.start, call.end, call.quoted, self._value = start, end, True, None

    def _read(self, text: str, c: str) -> None:
        i, self.i = self.i, self.i + 1
        call = self.calls[-1] if self._level else None
        if c == '"':
            self._string = i
        elif c in "{[":
            if c == "{" and (not self._stack or self._stack == ["["]):  # a call opens
                self.calls.append(PartialCall())
                self._level, self._want_key, self._value = len(self._stack) + 1, True, None
            elif self._at_call() and self._value in ARGUMENT_KEYS and call.start is None:
                call.start = i  # the arguments' object or array opens
            self._stack.append(c)
        elif c in "}]":
            if self._at_call():
                self._end_literal(text, i)
            if not self._stack:
                return
            self._stack.pop()
            if self._at_call() and self._value in ARGUMENT_KEYS and call.end is None:
                call.end, self._value = i + 1, None  # the arguments close
            elif self._level and len(self._stack) == self._level - 1:
                call.closed, self._level = True, 0  # the call object closes
        elif self._at_call():
            if c == ":":
                self._value = self._key
            elif c == ",":
                self._end_literal(text, i)
                self._want_key, self._value = True, None
            elif self._value in ARGUMENT_KEYS and not c.isspace() and call.start is None:
                call.start = i  # a number, true, false or null: up to the next , or }

    def _end_literal(self, text: str, i: int) -> None:
        """Ends arguments written as a bare literal at the delimiter ``text[i]``."""
        call = self.calls[-1]
        if self._value in ARGUMENT_KEYS and call.start is not None and call.end is None:
            call.end = len(text[:i].rstrip())


def scan_calls(text: str, start: int = 0) -> list[PartialCall]:
    """The call objects in ``text[start:]`` (see `CallScanner`)."""
    return CallScanner(start).feed(text)
