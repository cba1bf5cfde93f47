"""vLLM's /tokenize, /detokenize and /tokenizer_info: a prompt (or chat messages, through the
chat template) as the served model's token ids, ids as text, and the tokenizer's special tokens
and chat template (what lm-eval-harness's remote tokenizer reads)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from jaxkv.errors import FieldError
from jaxkv.server.protocol import ChatMessage, message_dict


class TokenizeRequest(BaseModel):
    """A ``prompt``, or ``messages`` rendered by the chat template (vLLM's two forms)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def add_routes(app, tokenizer, max_model_len: int, check_model) -> None:
    """Registers the two routes on ``app``; ``check_model(name)`` refuses another model."""

    def need_tokenizer():
        if tokenizer is None:
            raise FieldError("model", "this model has no tokenizer")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise FieldError("prompt", "send a prompt or messages (one of them)")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens
                                   is not False)
        else:
            conv = [message_dict(m, i) for i, m in enumerate(body.messages)]
            try:
                text = tokenizer.apply_chat_template(
                    conv, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    **({"tools": body.tools} if body.tools else {}),
                    **(body.chat_template_kwargs or {}))
            except Exception as e:  # noqa: BLE001 - jinja's TemplateError and the template's
                raise FieldError("messages", f"the chat template refused them: {e}") from e
            ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        out = {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids)}
        if body.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(list(ids))
        return out

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        need_tokenizer()
        return {"tokenizer_class": type(tokenizer).__name__,
                "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token,
                "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
                "chat_template": getattr(tokenizer, "chat_template", None),
                "model_max_length": max_model_len, "vocab_size": len(tokenizer)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        need_tokenizer()
        vocab = len(tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise FieldError("tokens", f"{bad[0]} is not a token id of the vocabulary "
                             f"[0, {vocab})")
        return {"prompt": tokenizer.decode(body.tokens)}
