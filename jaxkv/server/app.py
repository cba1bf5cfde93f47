"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (streaming or not),
/v1/models, /health and /metrics.

Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for
bad input (naming the field; malformed JSON names none), 401 for a missing or wrong API key
(when keys are configured: /v1/* only), 429 when ``max_pending`` requests are unfinished, 500
when the engine failed a request (the server keeps serving the others). A client that
disconnects aborts its request, which frees its pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from jaxkv.server.async_engine import AsyncEngine, QueueFullError
from jaxkv.server.auth import TENANT, TOKENIZER_ROUTES, RequireKey, Tenants, cache_salt
from jaxkv.server.logprob_format import LogprobFormat
from jaxkv.server.metrics import ServerMetrics
from jaxkv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    message_dict,
    validation_message,
)
from jaxkv.server.tokenize import add_routes as tokenize_routes
from jaxkv.server.tools import PARSERS, ToolReplies, detect_parser
from jaxkv.structured.grammar import grammars_for

_DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The client of a request disconnected; its request was aborted."""


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError"}.get(
        status, "InternalServerError")
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": kind, "param": param, "code": status}})


def _bad_field(message: str) -> str | None:
    """The field a ValueError names (``SamplingParams.temperature ...`` -> temperature)."""
    for word in message.replace("=", " ").replace(":", " ").split():
        if word.startswith("SamplingParams."):
            return word.split(".", 1)[1]
    return None


def _constraint_error(field: str, message: str) -> tuple[str, str]:
    """(field, why) of a grammar that does not compile, in the words of the field that asked
    for it: "structured_outputs.json: x" is "structured_outputs: json: x" for
    structured_outputs, "response_format: x" for response_format."""
    kind, sep, why = message.removeprefix("structured_outputs.").partition(": ")
    if not sep:
        return field, message
    return field, f"{kind}: {why}" if field == "structured_outputs" else why


def build_app(llm, *, model_name: str, max_pending: int = 256,
              api_keys: tuple[str, ...] | list[str] = (),
              tool_call_parser: str | None = None,
              tokenizer_routes_need_key: bool = False) -> FastAPI:
    """The app serving ``llm`` (a `jaxkv.LLM`, whose engine is any `EngineClient`): one engine
    loop thread for all connections. With ``api_keys``, /v1/* needs one of them, and each key
    is a tenant with its own prefix-cache namespace (`jaxkv.server.auth`); /tokenize,
    /detokenize and /tokenizer_info answer without one, as vLLM's do, unless
    ``tokenizer_routes_need_key``.
    ``tool_call_parser`` (`jaxkv.server.tools.PARSERS`) reads tool calls in the model's text
    for ``tool_choice="auto"``; default: the format the chat template names, if any."""
    tenants = Tenants(api_keys)
    engine, tokenizer = llm.engine, llm.model.tokenizer
    fmt = LogprobFormat(tokenizer)
    if tool_call_parser not in (None, *PARSERS):
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got "
                         f"{tool_call_parser!r}")
    parser = tool_call_parser or detect_parser(getattr(tokenizer, "chat_template", None))
    metrics = ServerMetrics(model_name)
    counter = itertools.count()

    def on_step(outputs, _seconds):  # (requests in a prefill-to-decode transfer: running)
        metrics.update(engine.stats(), engine.num_running(), engine.num_waiting())
        for out in outputs:
            if out.finished:
                metrics.finished(out)

    metrics.update(engine.stats(), 0, 0)
    core = AsyncEngine(engine, max_pending=max_pending, on_step=on_step)
    max_len = engine.max_model_len
    app = FastAPI(title="jaxkv", version="0.1.0")
    app.state.engine = core
    if tenants.enabled:
        app.add_middleware(RequireKey, tenants=tenants,
                           more=TOKENIZER_ROUTES if tokenizer_routes_need_key else ())

    @app.on_event("shutdown")
    def _shutdown():
        core.close()

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(ClientGone)
    async def _client_gone(_request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        return _error(400, *validation_message(exc.errors()[0]))

    @app.exception_handler(FieldError)
    async def _field_error(_request, exc: FieldError):
        return _error(400, str(exc), exc.field)

    def encode_prompt(prompt) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "prompt: this model has no tokenizer; send token ids",
                               "prompt")
            return list(tokenizer.encode(prompt))
        return list(prompt)

    grammars = grammars_for(tokenizer, llm.model.config.vocab_size,
                            llm.model.config.eos_token_ids)

    async def submit(ids: list[int], sp, request_id: str, salt: str | None,
                     body) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if sp.structured_outputs is not None:  # compiled here, off the engine thread (cached)
            try:
                await asyncio.to_thread(grammars.compile, sp.structured_outputs)
            except ValueError as e:
                raise FieldError(*_constraint_error(body.structured()[1], str(e))) from None
        try:
            return await asyncio.to_thread(core.add, request_id, ids, sp, loop, salt)
        except QueueFullError as e:
            raise APIError(429, str(e)) from e
        except ValueError as e:
            raise APIError(400, str(e), _bad_field(str(e))) from e

    async def next_output(queue: asyncio.Queue, http: Request, request_id: str):
        """The request's next output; aborts it (and raises) if the client went away."""
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    core.abort(request_id)
                    raise ClientGone(request_id) from None
                continue
            if isinstance(item, Exception):
                raise APIError(500, str(item))
            if item.error is not None:
                raise APIError(500, f"the engine failed request {request_id}: {item.error}")
            return item

    def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def sampling(body, max_tokens, logprobs, prompt_len):
        if max_tokens is None:
            max_tokens = max(1, max_len - prompt_len)
        try:
            return body.sampling_params(max_tokens, logprobs)
        except FieldError:
            raise
        except ValueError as e:
            raise APIError(400, str(e), _bad_field(str(e))) from e

    def running_usage(body, payload: dict, prompt_tokens: int, state: dict) -> dict:
        """A streamed chunk, with the usage so far when the client asked for it in every
        chunk (vLLM's ``stream_options.continuous_usage_stats``)."""
        options = body.stream_options
        if options is not None and options.continuous_usage_stats:
            payload["usage"] = usage(prompt_tokens, state["completion"], state["cached"])
        return payload

    def fresh(out, state):
        """The samples of a DELTA output with something new: a DELTA output lists every
        sample, so a finished one would repeat its end, and one not yet started is empty."""
        for c in out.outputs:
            if c.index in state["ended"] or not (c.token_ids or c.finish_reason):
                continue
            if c.finish_reason is not None:
                state["ended"].add(c.index)
            yield c

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def stream(http, queue, request_id, chunk, final_usage):
        """Server-sent events: ``chunk(output)`` per output, then usage and [DONE]."""
        finished = False
        try:
            while not finished:
                out = await next_output(queue, http, request_id)
                finished = out.finished
                for payload in chunk(out):
                    yield sse(payload)
            usage_payload = final_usage()
            if usage_payload is not None:
                yield sse(usage_payload)
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield sse({"error": {"message": e.message, "type": "InternalServerError",
                                 "param": e.param, "code": e.status}})
        finally:
            if not finished:
                core.abort(request_id)  # the client went away mid-stream

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                           f"{model_name!r}", "model")

    tokenize_routes(app, tokenizer, max_len, check_model)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "jaxkv",
                                            "max_model_len": max_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def check(body, http: Request) -> str | None:
        """Refuses a request for another model (404) or with a field jaxkv does not serve
        (400); the engine's cache salt: the tenant's namespace and the request's salt."""
        check_model(body.model)
        body.check_supported()
        return cache_salt(http.scope.get(TENANT), body.cache_salt)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        salt = check(body, http)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts or any(not p for p in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        if body.stream and len(prompts) > 1:
            raise APIError(400, "prompt: streaming takes one prompt", "prompt")
        ids_list = [body.truncate(encode_prompt(p)) for p in prompts]
        created, base = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        sps = [sampling(body, body.max_tokens, body.logprobs, len(ids)) for ids in ids_list]
        request_ids = [f"{base}-{i}-{next(counter)}" for i in range(len(prompts))]
        queues = []
        try:
            for ids, sp, rid in zip(ids_list, sps, request_ids, strict=True):
                queues.append(await submit(ids, sp, rid, salt, body))
        except BaseException:
            for rid in request_ids[:len(queues)]:
                core.abort(rid)  # the prompts already queued go with the one refused
            raise
        head = {"id": base, "object": "text_completion", "created": created,
                "model": model_name}
        if body.stream:
            state = {"completion": 0, "cached": 0, "ended": set()}

            def chunk(out):
                state["cached"] = out.num_cached_tokens
                for c in fresh(out, state):
                    state["completion"] += len(c.token_ids)
                    yield running_usage(body, {**head, "choices": [{
                        "index": c.index, "text": c.text, "logprobs": fmt.completion(c),
                        "finish_reason": c.finish_reason}]}, len(ids_list[0]), state)

            def final_usage():
                if not (body.stream_options and body.stream_options.include_usage):
                    return None
                return {**head, "choices": [],
                        "usage": usage(len(ids_list[0]), state["completion"], state["cached"])}

            return StreamingResponse(stream(http, queues[0], request_ids[0], chunk, final_usage),
                                     media_type="text/event-stream")
        try:
            outs = [await next_output(q, http, rid) for q, rid in zip(queues, request_ids,
                                                                       strict=True)]
        except BaseException:
            for rid in request_ids:
                core.abort(rid)  # a no-op for those already finished
            raise
        choices, completion, generate = [], 0, body.max_tokens != 0
        for p, out in enumerate(outs):
            for c in out.outputs:
                text, lps = c.text if generate else "", fmt.completion(c)
                if body.echo:  # the prompt first (max_tokens=0: only the prompt)
                    given = isinstance(prompts[p], str) and body.truncate_prompt_tokens is None
                    prompt = prompts[p] if given else tokenizer.decode(ids_list[p]) \
                        if tokenizer is not None else ""
                    text = prompt + text
                    lps = None if body.logprobs is None else fmt.completion(
                        c, (ids_list[p], out.prompt_logprobs, generate))
                completion += len(c.token_ids) if generate else 0
                choices.append({"index": p * body.n + c.index, "text": text, "logprobs": lps,
                                "finish_reason": c.finish_reason if generate else "length"})
                if body.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = fmt.prompt(out)
        return {**head, "choices": choices,
                "usage": usage(sum(len(i) for i in ids_list), completion,
                               sum(o.num_cached_tokens for o in outs))}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        salt = check(body, http)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template", "messages")
        conv = [message_dict(m, i) for i, m in enumerate(body.messages)]
        try:
            ids = list(tokenizer.apply_chat_template(conv, tokenize=True, return_dict=False,
                                                     **body.template_options()))
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError and the template's own
            raise APIError(400, f"messages: the chat template refused them: {e}",
                           "messages") from e
        ids = body.truncate(ids)
        top = body.top_logprobs or 0
        logprobs = top if body.logprobs else None
        replies = ToolReplies(body.tool_mode()[1], parser, body.parallel_tool_calls)
        if replies.mode == "auto" and parser is None:
            raise FieldError("tool_choice", "'auto' reads tool calls from the model's text, "
                             "and this model's chat template names no format: start the "
                             "server with --tool-call-parser, or send 'required' or a name")
        sp = sampling(body, body.max_output_tokens, logprobs, len(ids))
        if replies.mode == "auto":  # the calls' markers may be special tokens: kept
            sp = dataclasses.replace(sp, skip_special_tokens=False)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        queue = await submit(ids, sp, request_id, salt, body)
        head = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": model_name}
        if body.stream:
            state = {"completion": 0, "cached": 0, "started": set(), "ended": set(),
                     "text": {}}
            chunk_head = {**head, "object": "chat.completion.chunk"}

            def chunk(out):
                state["cached"] = out.num_cached_tokens
                for c in fresh(out, state):
                    state["completion"] += len(c.token_ids)
                    text = state["text"][c.index] = state["text"].get(c.index, "") + c.text
                    delta, reason = replies.delta(c.index, text, c.finish_reason)
                    if c.index not in state["started"]:
                        state["started"].add(c.index)
                        delta["role"] = "assistant"
                    yield running_usage(body, {**chunk_head, "choices": [{
                        "index": c.index, "delta": delta, "logprobs": fmt.chat(c, top),
                        "finish_reason": reason}]}, len(ids), state)

            def final_usage():
                if not (body.stream_options and body.stream_options.include_usage):
                    return None
                return {**chunk_head, "choices": [],
                        "usage": usage(len(ids), state["completion"], state["cached"])}

            return StreamingResponse(stream(http, queue, request_id, chunk, final_usage),
                                     media_type="text/event-stream")
        out = await next_output(queue, http, request_id)
        choices = [{"index": c.index, **dict(zip(("message", "finish_reason"),
                                                 replies.message(c.text, c.finish_reason),
                                                 strict=True)),
                    "logprobs": fmt.chat(c, top)} for c in out.outputs]
        extra = {} if body.prompt_logprobs is None else {"prompt_logprobs": fmt.prompt(out)}
        return {**head, "choices": choices, **extra,  # prompt logprobs: vLLM's place for chat
                "usage": usage(len(ids), sum(len(c.token_ids) for c in out.outputs),
                               out.num_cached_tokens)}

    return app


def serve(llm, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_pending: int = 256, api_keys: tuple[str, ...] | list[str] = (),
          tool_call_parser: str | None = None, tokenizer_routes_need_key: bool = False) -> None:
    """Runs the server until interrupted."""
    import uvicorn

    uvicorn.run(build_app(llm, model_name=model_name, max_pending=max_pending,
                          api_keys=api_keys, tool_call_parser=tool_call_parser,
                          tokenizer_routes_need_key=tokenizer_routes_need_key),
                host=host, port=port, log_level="info")
