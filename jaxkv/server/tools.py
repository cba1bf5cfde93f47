"""Tool calling in chat completions (OpenAI's ``tools`` and ``tool_choice``).

- ``tool_choice="none"``: the model answers in text (the tools still reach the chat template);
- ``"required"``: the output is constrained (structured outputs) to a JSON array of one or more
  calls ``[{"name": <a tool's name>, "parameters": <its parameters schema>}]`` (one call with
  ``parallel_tool_calls=false``): the calls always parse and their arguments validate;
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is that
  function's arguments, constrained to its parameters schema;
- ``"auto"`` (the default with tools): the model answers freely and a parser finds the calls in
  its text, in the format the model was trained on: ``hermes`` (Hermes, Qwen 2.5/3:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), ``llama3_json`` (Llama 3.1+:
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several joined by
  ``;``) or ``mistral`` (``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``). `jaxkv serve
  --tool-call-parser` chooses it; otherwise it is detected from the chat template.

A reply with calls has ``message.tool_calls`` (each ``{"id", "type": "function", "function":
{"name", "arguments": <JSON text>}}``) and ``finish_reason="tool_calls"`` (``"stop"`` for a
named function, as OpenAI answers). Streamed, text before a call streams as content; a call's
first ``delta.tool_calls`` entry comes once its name is complete, and its arguments follow as
they are generated (`jaxkv.server.tool_scan`), in every mode. A call's ``arguments`` are the
text the model wrote for them (so the streamed pieces add up to the whole reply's).
"""

from __future__ import annotations

import json
import uuid

from jaxkv.errors import FieldError
from jaxkv.server.tool_scan import CallScanner, PartialCall, scan_calls
from jaxkv.structured.params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json", "mistral")
CALL_SPACE = "[ ]?"  # whitespace between a call's JSON tokens: one space at most, as calls go
# Where a call starts in the text, per parser (llama3_json: a reply that is a JSON object).
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}


def detect_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template renders, if it names one."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return None


def check_tools(tools, tool_choice, parallel) -> tuple[list[dict], str | dict]:
    """(tools, tool_choice) checked, tool_choice defaulted ("auto" with tools, else "none");
    FieldError naming the field."""
    tools = tools or []
    if not isinstance(tools, list):
        raise FieldError("tools", "must be a list of {\"type\": \"function\", \"function\": ...}")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(fn, dict):
            raise FieldError(f"tools.{i}", "must be {\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"parameters\": {...}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"tools.{i}.function.name", "must be a non-empty string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise FieldError(f"tools.{i}.function.parameters", "must be a JSON schema object")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise FieldError("tools", "two tools have the same name")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "must be a bool")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise FieldError("tool_choice", f"names no tool of tools ({', '.join(names) or 'none'}"
                             f" given): {choice!r}")
    elif choice not in ("none", "auto", "required"):
        raise FieldError("tool_choice", f"must be 'none', 'auto', 'required' or "
                         f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                         f"{choice!r}")
    elif choice != "none" and not tools:
        raise FieldError("tool_choice", f"{choice!r} needs tools")
    return tools, choice


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def constraint(tools: list[dict], choice, parallel: bool | None) -> StructuredOutputsParams | None:
    """The structured output that ``required`` or a named function imposes (None otherwise)."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=_parameters(tool), whitespace_pattern=CALL_SPACE)
    if choice != "required":
        return None
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t["function"]["name"]]},
        "parameters": _parameters(t)}, "required": ["name", "parameters"],
        "additionalProperties": False} for t in tools]}
    schema = {"type": "array", "items": call, "minItems": 1}
    if parallel is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, whitespace_pattern=CALL_SPACE)


def _call(name: str, arguments: str, parser: str | None = None) -> dict:
    # Mistral's templates refuse ids that are not 9 letters or digits
    call_id = uuid.uuid4().hex[:9] if parser == "mistral" else \
        f"chatcmpl-tool-{uuid.uuid4().hex}"
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _region(parser: str, text: str) -> tuple[int, int] | None:
    """(end of the content, start of the calls) in ``text`` for ``parser``, or None before a
    call begins: after hermes' or mistral's marker; a Llama 3 reply that is a JSON object
    (after ``<|python_tag|>``, if any) is all calls."""
    if parser == "llama3_json":
        body = text.lstrip()
        lead = len(text) - len(body)
        if body.startswith(_MARKERS[parser]):
            return 0, lead + len(_MARKERS[parser])
        return (0, lead) if body.startswith("{") else None
    at = text.find(_MARKERS[parser])
    return None if at < 0 else (at, at + len(_MARKERS[parser]))


def _complete(call: PartialCall, text: str) -> bool:
    if not call.closed or not isinstance(call.name, str):
        return False
    if call.quoted:
        return True
    try:
        json.loads(call.arguments(text))
    except ValueError:
        return False
    return True


def _found(text: str, start: int, parser: str | None) -> list[dict]:
    """The complete calls that ``text[start:]`` begins with (what follows them is ignored),
    each with its arguments' text as written."""
    calls = []
    for call in scan_calls(text, start):
        if not _complete(call, text):
            break
        calls.append(_call(call.name, call.arguments(text), parser))
    return calls


def parse(parser: str, text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a model's free text: the calls the parser finds (none if their text
    does not parse: the reply stays text), and the text before them."""
    region = _region(parser, text)
    calls = [] if region is None else _found(text, region[1], parser)
    if not calls:
        return text, []
    return text[:region[0]] or None, calls


class ToolReplies:
    """Turns one chat request's outputs into messages and streamed deltas for its tool mode:
    ``"none"`` (text), ``"auto"`` (``parser``), ``"required"`` or a named function."""

    def __init__(self, choice, parser: str | None, parallel: bool | None = None):
        self.mode = "named" if isinstance(choice, dict) else choice
        self.name = choice["function"]["name"] if isinstance(choice, dict) else None
        self.parser, self.parallel = parser, parallel
        self._sent: dict[int, int] = {}  # choice index -> characters of content streamed
        self._streams: dict[int, dict[int, int]] = {}  # its calls' arguments streamed
        self._scanners: dict[int, CallScanner] = {}

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The reply message and its finish_reason, for a whole output."""
        content, calls = self._calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        if finish != "stop":
            return message, finish  # cut off ("length") or failed: said as it is
        return message, "stop" if self.mode == "named" else "tool_calls"

    def _calls(self, text: str) -> tuple[str | None, list[dict]]:
        if self.mode == "named":
            return None, [_call(self.name, text, self.parser)]
        if self.mode == "required":
            calls = _found(text, 0, self.parser)
            return (None, calls) if calls else (text, [])
        if self.mode == "auto" and self.parser is not None:
            content, calls = parse(self.parser, text)
            return content, calls[:1] if self.parallel is False else calls
        return text, []

    def delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The delta of choice ``index`` whose text so far is ``text`` (cumulative), and its
        finish_reason once it ends."""
        sent = self._sent.get(index, 0)
        if self.mode == "none" or self.mode == "auto" and self.parser is None:
            self._sent[index] = len(text)
            return {"content": text[sent:]}, finish
        if self.mode == "named":  # the text is the arguments: stream them
            head = index not in self._sent  # its first delta names the call
            self._sent[index] = len(text)
            call = _call(self.name, text[sent:], self.parser) if head else \
                {"function": {"arguments": text[sent:]}}
            return {"tool_calls": [{"index": 0, **call}]}, \
                None if finish is None else self.message(text, finish)[1]
        region = (0, 0) if self.mode == "required" else _region(self.parser, text)
        reason = None
        if finish is not None:
            message, reason = self.message(text, finish)
            if not message.get("tool_calls") and not self._streams.get(index):
                self._sent[index] = len(text)  # no call after all: the rest is content
                return {"content": text[sent:]}, reason
        elif region is None:  # hold back what may be (the start of) a call
            safe = max(sent, _safe_prefix(self.parser, text))
            self._sent[index] = safe
            return {"content": text[sent:safe]}, None
        delta = {}
        if region is not None and region[0] > sent:  # the content before the calls
            delta["content"] = text[sent:region[0]]
            self._sent[index] = region[0]
        calls = [] if region is None else self._call_deltas(index, text, region[1])
        if calls:
            delta["tool_calls"] = calls
        return delta, reason

    def _call_deltas(self, index: int, text: str, start: int) -> list[dict]:
        """The calls' new pieces: a call's first entry once its name is complete (its id,
        name and the arguments so far), then what its arguments grew by."""
        sent = self._streams.setdefault(index, {})  # call -> characters of arguments sent
        scanner = self._scanners.setdefault(index, CallScanner(start))
        calls = scanner.feed(text)  # (reads only what is new: a long reply costs O(length))
        out = []
        for i, call in enumerate(calls[:1] if self.parallel is False else calls):
            if not isinstance(call.name, str):
                break  # (calls come in order)
            args = call.arguments(text)
            if call.end is None and args and args[0] not in '{["':
                args = ""  # a bare number or literal: sent once it is complete
            if i not in sent:
                out.append({"index": i, **_call(call.name, args, self.parser)})
            elif len(args) > sent[i]:
                out.append({"index": i, "function": {"arguments": args[sent[i]:]}})
            sent[i] = len(args)
        return out


def _safe_prefix(parser: str, text: str) -> int:
    """How much of ``text`` is surely content: everything before a call's marker, or before a
    tail that may still become one (all of it, for a reply that opens a JSON object)."""
    head = text.lstrip()
    if parser == "llama3_json" and (head.startswith("{") or _MARKERS[parser].startswith(
            head[:len(_MARKERS[parser])])):  # (whitespace alone may still open a call)
        return 0
    marker = _MARKERS[parser]
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)
