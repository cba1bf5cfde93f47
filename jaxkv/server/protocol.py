"""OpenAI request bodies (pydantic) and their translation into `SamplingParams`.

Every field of OpenAI's completions and chat completions requests, and vLLM's sampling extras,
is declared here and is one of three kinds (docs/serving.md lists them):

- mapped: it means what OpenAI / vLLM mean, through `SamplingParams` or the prompt;
- ignored: metadata with no effect on the output (``user``, ``metadata``, ``store``);
- refused: a 400 naming it (`FieldError`), unless its value means "nothing" (``tools: []``).

A field that is none of these (a typo, an extension jaxkv does not know) is refused by name
too (``extra="forbid"``): never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxkv.errors import FieldError
from jaxkv.sampling_params import RequestOutputKind, SamplingParams
from jaxkv.structured.params import StructuredOutputsParams

TOOLS = "OpenAI's legacy function calling; send tools and tool_choice"
# vLLM's older names of structured_outputs' fields
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _is(*nothing) -> Callable[[object], bool]:
    """A test for the values of a refused field that mean "nothing" (None always does)."""
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in nothing)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk too


class _Request(BaseModel):
    """The fields both endpoints share: sampling (OpenAI's and vLLM's), the prompt cache's
    namespace, and the refusals."""

    model_config = ConfigDict(extra="forbid")
    # Refused fields: name -> (accepts the values that mean "nothing", why others are refused).
    REFUSED: ClassVar[dict[str, tuple[Callable[[object], bool], str]]] = {
        "spaces_between_special_tokens": (
            _is(True), "only true (vLLM's default) is supported: the detokenizer has no other "
            "mode"),
        "use_beam_search": (_is(False), "beam search is not supported"),
        "priority": (_is(0), "priority scheduling is not supported (the scheduler is FCFS)"),
    }
    IGNORED: ClassVar[frozenset[str]] = frozenset({"user"})  # accepted, no effect

    # mapped: OpenAI's
    model: str | None = None  # checked against the served model's name (else a 404)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's keys: token ids as strings
    stream: bool = False
    stream_options: StreamOptions | None = None
    # mapped: vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    cache_salt: str | None = None  # the prefix cache's namespace (within the caller's)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    speculate: bool = True  # False: no speculative decoding for this request
    # mapped: structured outputs (OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields); typed loosely, so `structured` names what is wrong
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # ignored
    user: str | None = None
    # refused (typed loosely: a client sees the refusal, not a type error)
    min_p: Any = None
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    priority: Any = None

    def check_supported(self) -> None:
        """Raises FieldError naming a refused field, or a combination jaxkv cannot serve."""
        for name, (nothing, why) in self.REFUSED.items():
            if not nothing(getattr(self, name)):
                raise FieldError(name, why)
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "not returned when streaming; send stream=false")
        if self.cache_salt is not None and not self.cache_salt:
            raise FieldError("cache_salt", "must be a non-empty string")
        k = self.truncate_prompt_tokens
        if k is not None and k < 1:
            raise FieldError("truncate_prompt_tokens", f"must be an int >= 1, got {k}")

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's structured output and the field that asked for it; FieldError naming
        the field for a malformed one, or for two fields asking at once."""
        asked = []
        rf = self.response_format
        if rf is not None and rf != {"type": "text"}:
            asked.append(("response_format", _response_format(rf)))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs))
        for name, field in GUIDED.items():
            if getattr(self, name) is not None:
                asked.append((name, {field: getattr(self, name)}))
        if len(asked) > 1:
            raise FieldError(asked[1][0], f"{asked[0][0]} already constrains the output; "
                             "send one of response_format, structured_outputs, guided_*")
        if not asked:
            return None, None
        name, value = asked[0]
        try:
            return StructuredOutputsParams.of(value), name
        except ValueError as e:
            raise FieldError(name, str(e).removeprefix("structured_outputs").lstrip(".: ")
                             or str(e)) from None

    def truncate(self, ids: list[int]) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (vLLM's left truncation)."""
        k = self.truncate_prompt_tokens
        return ids if k is None else ids[-k:]

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys as token ids (OpenAI sends them as strings)."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            digits = key.strip()
            if not (digits.isascii() and digits.isdigit()):  # isdigit alone takes "²"
                raise FieldError("logit_bias", f"key {key!r} is not a token id")
            bias[int(digits)] = value
        return bias

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; SamplingParams validates and names bad fields."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

        def given(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n, temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=given(self.min_p, 0.0), max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed,
            presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0), ignore_eos=self.ignore_eos,
            logit_bias=self.logit_bias_ids(),
            allowed_token_ids=None if self.allowed_token_ids is None
            else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()), skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs, speculate=self.speculate,
            structured_outputs=self.structured()[0],
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)


class CompletionRequest(_Request):
    REFUSED = {**_Request.REFUSED,
               "suffix": (_is(), "inserting text after the completion is not supported")}

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # 0: with echo, only the prompt (and its logprobs)
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion (and its logprobs, the first None)
    best_of: int | None = None  # only None or n: the best of more samples is not supported
    suffix: Any = None  # refused

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """With ``echo``, the prompt's logprobs are computed too; ``max_tokens=0`` samples
        one token, which the reply leaves out."""
        sp = super().sampling_params(1 if max_tokens == 0 and self.echo else max_tokens,
                                     logprobs)
        if self.echo and logprobs is not None:
            k = max(logprobs, self.prompt_logprobs or 0)
            sp = dataclasses.replace(sp, prompt_logprobs=k)
        return sp

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "0 is only for echo=true (the prompt's logprobs, "
                             "as evaluation harnesses ask)")
        if self.echo and self.stream:
            raise FieldError("echo", "not with stream=true; send stream=false")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", f"best_of={self.best_of} with n={self.n}: returning "
                             "the best of more samples than n is not supported; omit best_of "
                             "or send best_of=n")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None  # given to the chat template (which may or may not use it)
    tool_call_id: str | None = None  # given to the chat template
    tool_calls: list[dict] | None = None  # an assistant's calls, given to the chat template


_TEMPLATE_ARGS = frozenset({  # apply_chat_template's own arguments: not template variables
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatCompletionRequest(_Request):
    REFUSED = {
        **_Request.REFUSED,
        "functions": (_is([]), TOOLS),
        "function_call": (_is("none"), TOOLS),
        "audio": (_is(), "audio output is not supported"),
        "modalities": (_is(["text"]), "only text output is supported"),
        "prediction": (_is(), "predicted outputs are not supported"),
        "reasoning_effort": (_is(), "reasoning models' effort is not supported"),
        "web_search_options": (_is(), "web search is not supported"),
        "service_tier": (_is("auto", "default"), "only 'auto' and 'default' are served (one "
                         "tier)"),
        "chat_template": (_is(), "a request cannot replace the server's chat template"),
    }
    IGNORED = _Request.IGNORED | {"metadata", "store", "service_tier"}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None  # default: not continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat template variables
    # mapped: tool calling (jaxkv.server.tools); typed loosely, checked by check_tools
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # refused
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    chat_template: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise FieldError(f"messages.{i}.tool_calls", "only assistant messages make "
                                 "tool calls")
        self.tool_mode()  # FieldError naming a malformed tool or tool_choice
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "cannot be combined with "
                             "add_generation_prompt=true")
        reserved = sorted(_TEMPLATE_ARGS & set(self.chat_template_kwargs or ()))
        if reserved:
            raise FieldError("chat_template_kwargs", f"{reserved[0]!r} is an argument of "
                             "the template call, not a template variable; send it as a field")

    def tool_mode(self) -> tuple[list[dict], str | dict]:
        """(tools, tool_choice), checked and defaulted (`jaxkv.server.tools.check_tools`)."""
        from jaxkv.server.tools import check_tools

        return check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """With ``tool_choice`` "required" or a named function, the constraint of the calls
        (and no other constraint may be asked for)."""
        from jaxkv.server.tools import constraint

        asked, field = super().structured()
        tools, choice = self.tool_mode()
        forced = constraint(tools, choice, self.parallel_tool_calls)
        if forced is None:
            return asked, field
        if asked is not None:
            raise FieldError(field, f"tool_choice={choice!r} already constrains the output")
        return forced, "tools"

    def template_options(self) -> dict:
        """apply_chat_template's keyword arguments for this request (beyond the messages)."""
        add = self.add_generation_prompt
        tools = self.tool_mode()[0]
        return {**(self.chat_template_kwargs or {}), **({"tools": tools} if tools else {}),
                "add_generation_prompt": not self.continue_final_message if add is None else add,
                "continue_final_message": self.continue_final_message}

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name), else ``max_tokens``."""
        return self.max_tokens if self.max_completion_tokens is None \
            else self.max_completion_tokens


def _response_format(rf) -> dict:
    """OpenAI's ``response_format`` as structured_outputs' fields (FieldError naming what
    is malformed)."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise FieldError("response_format.json_schema", "needs {\"name\": ..., "
                             "\"schema\": {...}} (the JSON schema of the output)")
        if not isinstance(spec["schema"], dict):
            raise FieldError("response_format.json_schema.schema", "must be a JSON schema "
                             f"object, got {type(spec['schema']).__name__}")
        return {"json": spec["schema"]}
    raise FieldError("response_format.type", f"must be 'text', 'json_object' or "
                     f"'json_schema', got {kind!r}")


def message_dict(message: ChatMessage, index: int) -> dict:
    """A message as the chat template takes it: content as text (OpenAI's list-of-parts form:
    its text parts joined), and its name and tool call id when given."""
    content = message.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = []
        for part in content:
            if part.get("type") != "text":
                raise FieldError(f"messages.{index}.content", "only text parts are supported, "
                                 f"got type {part.get('type')!r}")
            parts.append(str(part.get("text", "")))
        text = "".join(parts)
    out = {"role": message.role, "content": text}
    for key in ("name", "tool_call_id"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    if message.tool_calls:  # templates read arguments as a dict (OpenAI sends JSON text)
        out["tool_calls"] = [_template_call(c, f"messages.{index}.tool_calls.{j}")
                             for j, c in enumerate(message.tool_calls)]
    return out


def _template_call(call: dict, field: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise FieldError(field, "must be {\"id\": ..., \"type\": \"function\", \"function\": "
                         "{\"name\": ..., \"arguments\": ...}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise FieldError(f"{field}.function.arguments", "is not JSON") from None
    return {**call, "function": {**fn, "arguments": args}}


FIELD_NAMES = frozenset(CompletionRequest.model_fields) | frozenset(
    ChatCompletionRequest.model_fields) | frozenset(ChatMessage.model_fields) | frozenset(
    StreamOptions.model_fields)


def validation_message(error: dict) -> tuple[str, str | None]:
    """A 400's message and param for pydantic's complaint about a body: the field's path
    (``messages.0.role``) without pydantic's union-member tags (``prompt.str``); for
    malformed JSON (whose loc is a byte offset, not a field) no param."""
    loc = [p for p in error.get("loc", ()) if p != "body"]
    if error.get("type") == "json_invalid":
        why = (error.get("ctx") or {}).get("error", error.get("msg"))
        at = f" (at byte {loc[0]})" if loc else ""
        return f"the request body is not valid JSON: {why}{at}", None
    if error.get("type") == "extra_forbidden":
        param = ".".join(str(p) for p in loc)
        return (f"{param}: unknown field; jaxkv refuses the fields it does not implement "
                "rather than ignore them (docs/serving.md lists the fields)"), param
    param = ".".join(str(p) for p in loc if isinstance(p, int) or p in FIELD_NAMES)
    return f"{param or 'the request body'}: {error.get('msg')}", param or None
