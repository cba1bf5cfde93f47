"""OpenAI request bodies (pydantic) and their translation into `SamplingParams`.

Fields follow the OpenAI API and vLLM's extensions (``top_k``, ``min_tokens``, ``ignore_eos``,
``repetition_penalty``); unknown fields are ignored, as OpenAI clients send optional ones freely.
A field jaxkv cannot honour is refused by name, never silently dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxkv.sampling_params import RequestOutputKind, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; SamplingParams validates and names bad fields."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as text (OpenAI's list-of-parts form: its text parts joined)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"messages[{index}].content: only text parts are supported, got "
                             f"type {part.get('type')!r}")
        parts.append(str(part.get("text", "")))
    return "".join(parts)
