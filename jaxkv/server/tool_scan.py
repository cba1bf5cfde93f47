"""Finding tool calls in a reply while it is still being written, for streaming them.

`scan_calls` reads the JSON of the calls in a (possibly unfinished) text: each call object
(``{"name": ..., "arguments" | "parameters": ...}``, alone, one after another, or in a
top-level array) with its name once that string is complete, and where its arguments' text
starts and, once complete, ends. A streamed call is announced when its name is known and its
arguments follow as the model writes them: every character sent is inside the arguments'
value, so the pieces add up to exactly the text of the finished reply's arguments.
"""

from __future__ import annotations

import dataclasses
import json

ARGUMENT_KEYS = ("arguments", "parameters")  # hermes and mistral; Llama 3 and "required"


@dataclasses.dataclass
class PartialCall:
    """A call object seen so far: its ``name`` once complete, and the arguments' text span
    (``start``: where the value begins; ``end``: None while it is still open)."""

    name: str | None = None
    start: int | None = None
    end: int | None = None
    closed: bool = False  # the call object is complete

    def arguments(self, text: str) -> str:
        """The arguments' text written so far ("" before they start)."""
        if self.start is None:
            return ""
        return text[self.start:len(text) if self.end is None else self.end]


def _string_end(text: str, i: int) -> int | None:
    """The index after the string starting at ``text[i]`` (a quote), or None if unfinished."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def scan_calls(text: str, start: int = 0) -> list[PartialCall]:
    """The call objects in ``text[start:]``: objects at the top level or in a top-level array
    (other text between them is skipped: markers, separators)."""
    calls: list[PartialCall] = []
    stack: list[str] = []  # open containers
    level = 0  # the depth inside the current call object (0: none open)
    key, want_key, value = None, False, None  # at the call's own depth
    i = start
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                return calls  # an unfinished string: nothing after it is known
            if level and len(stack) == level:
                if want_key:
                    key, want_key = json.loads(text[i:end]), False
                elif value is not None and value == "name" and calls[-1].name is None:
                    calls[-1].name = json.loads(text[i:end])
                    value = None
                elif value in ARGUMENT_KEYS:  # a string as the arguments
                    calls[-1].start, calls[-1].end, value = i, end, None
            i = end
            continue
        if c in "{[":
            if c == "{" and (not stack or stack == ["["]):  # a call object opens
                calls.append(PartialCall())
                level, want_key, value = len(stack) + 1, True, None
            elif level and len(stack) == level and value in ARGUMENT_KEYS:
                calls[-1].start = i  # the arguments' object or array opens
            stack.append(c)
        elif c in "}]":
            if not stack:
                i += 1
                continue
            stack.pop()
            if level and len(stack) == level and value in ARGUMENT_KEYS \
                    and calls[-1].end is None:
                calls[-1].end, value = i + 1, None  # the arguments close
            elif level and len(stack) == level - 1:
                calls[-1].closed, level = True, 0  # the call object closes
        elif level and len(stack) == level:
            if c == ":":
                value = key
            elif c == ",":
                want_key, value = True, None
            elif value in ARGUMENT_KEYS and not c.isspace() and calls[-1].start is None:
                calls[-1].start = i  # a number, true, false or null: up to the next , or }
                j = i
                while j < len(text) and text[j] not in ",}":
                    j += 1
                if j < len(text):
                    calls[-1].end = len(text[:j].rstrip())
                i = j
                continue
        i += 1
    return calls
