"""Every field of the OpenAI completions and chat completions requests, and vLLM's extras, is
mapped (it reaches the engine with the engine's meaning), ignored (metadata), or refused (a 400
naming it): FIELDS is the one list, and a test proves it covers every field of both request
models, so a field cannot be added without being classified here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import httpx
import pytest
from serving import MODEL, Server

import jaxkv
from jaxkv.sampling_params import RequestOutputKind
from jaxkv.server.protocol import ChatCompletionRequest, CompletionRequest
from jaxkv.structured import StructuredOutputsParams

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"
ABSENT = object()  # not a field of that endpoint
PROMPT = "def add(a, b):"
USER = [{"role": "user", "content": "Write a function."}]
PARTIAL = [*USER, {"role": "assistant", "content": "def f("}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BASE = {"completions": {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
        "chat": {"model": MODEL, "messages": USER, "max_tokens": 2, "temperature": 0}}


@dataclasses.dataclass
class Seen:
    """What one request gave the engine, and the HTTP answer."""

    sp: jaxkv.SamplingParams
    ids: list[int]
    salt: str | None
    response: httpx.Response
    tokenizer: object
    baseline: jaxkv.SamplingParams | None  # (ignored fields) the same without the field

    @property
    def json(self) -> dict:
        return self.response.json()


def sp_has(**want) -> Callable[[Seen], bool]:
    return lambda s: all(getattr(s.sp, k) == v for k, v in want.items())


def template(messages, **kw) -> Callable[[Seen], bool]:
    return lambda s: s.ids == list(s.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, **kw))


def unchanged(s: Seen) -> bool:
    return s.sp == s.baseline


def prompt_logprobs_returned(s: Seen) -> bool:
    body = s.json
    lps = body.get("prompt_logprobs") or body["choices"][0]["prompt_logprobs"]
    return s.sp.prompt_logprobs == 1 and len(lps) == len(s.ids) and lps[0] is None and all(
        len(e) >= 1 and all(v["logprob"] <= 0 for v in e.values()) for e in lps[1:])


@dataclasses.dataclass(frozen=True)
class Row:
    kind: str
    completions: object = ABSENT  # the value sent to /v1/completions
    chat: object = ABSENT  # the value sent to /v1/chat/completions
    check: Callable[[Seen], bool] | None = None  # mapped: the engine got the field's meaning
    also: dict = dataclasses.field(default_factory=dict)  # fields it needs beside it


def both(kind, value, check=None, **also) -> Row:
    return Row(kind, value, value, check, also)


FIELDS: dict[str, Row] = {
    # OpenAI's, both endpoints
    "model": both(MAPPED, MODEL, lambda s: s.json["model"] == MODEL),
    "n": both(MAPPED, 2, lambda s: s.sp.n == 2 and len(s.json["choices"]) == 2),
    "temperature": both(MAPPED, 0.5, sp_has(temperature=0.5)),
    "top_p": both(MAPPED, 0.5, sp_has(top_p=0.5)),
    "stop": both(MAPPED, ["\n", "x"], sp_has(stop=("\n", "x"))),
    "seed": both(MAPPED, 7, sp_has(seed=7)),
    "presence_penalty": both(MAPPED, 0.5, sp_has(presence_penalty=0.5)),
    "frequency_penalty": both(MAPPED, -0.5, sp_has(frequency_penalty=-0.5)),
    "logit_bias": both(MAPPED, {"42": 5, "50": -5}, sp_has(logit_bias={42: 5.0, 50: -5.0})),
    "max_tokens": both(MAPPED, 3, sp_has(max_tokens=3)),
    "stream": both(MAPPED, True, lambda s: s.sp.output_kind is RequestOutputKind.DELTA
                   and s.response.text.endswith("data: [DONE]\n\n")),
    "stream_options": both(MAPPED, {"include_usage": True},
                           lambda s: '"usage": {"prompt_tokens"' in s.response.text,
                           stream=True),
    "user": both(IGNORED, "alice", unchanged),
    # OpenAI's, completions only
    "prompt": Row(MAPPED, completions=[5, 6, 7], check=lambda s: s.ids == [5, 6, 7]),
    "logprobs": Row(MAPPED, completions=2, chat=True,
                    check=lambda s: s.sp.logprobs == (2 if "text" in s.json["choices"][0]
                                                      else 0)),
    "best_of": Row(REFUSED, completions=2),  # best_of == n (or none) is accepted: NOTHING
    "suffix": Row(REFUSED, completions="\n"),
    # OpenAI's, chat only
    "messages": Row(MAPPED, chat=[{"role": "system", "content": "Be brief."}, *USER],
                    check=template([{"role": "system", "content": "Be brief."}, *USER],
                                   add_generation_prompt=True)),
    "max_completion_tokens": Row(MAPPED, chat=3, check=sp_has(max_tokens=3)),
    "top_logprobs": Row(MAPPED, chat=3, check=sp_has(logprobs=3), also={"logprobs": True}),
    "metadata": Row(IGNORED, chat={"team": "a"}, check=unchanged),
    "store": Row(IGNORED, chat=True, check=unchanged),
    # (the tiny model's chat template names no tool-call format: "required" is what it serves)
    "tools": Row(MAPPED, chat=[TOOL], also={"tool_choice": "required"},
                 check=lambda s: s.sp.structured_outputs.json["items"]["anyOf"][0][
                     "properties"]["name"]["enum"] == ["f"]),
    "tool_choice": Row(MAPPED, chat={"type": "function", "function": {"name": "f"}},
                       also={"tools": [TOOL]}, check=sp_has(
                           structured_outputs=StructuredOutputsParams(
                               json={"type": "object"}, whitespace_pattern="[ ]?"))),
    "functions": Row(REFUSED, chat=[TOOL["function"]]),
    "function_call": Row(REFUSED, chat="auto"),
    "parallel_tool_calls": Row(MAPPED, chat=False, also={"tools": [TOOL],
                                                         "tool_choice": "required"},
                               check=lambda s: s.sp.structured_outputs.json["maxItems"] == 1),
    "audio": Row(REFUSED, chat={"voice": "alloy", "format": "wav"}),
    "modalities": Row(REFUSED, chat=["text", "audio"]),
    "prediction": Row(REFUSED, chat={"type": "content", "content": "x"}),
    "reasoning_effort": Row(REFUSED, chat="low"),
    "web_search_options": Row(REFUSED, chat={}),
    "service_tier": Row(REFUSED, chat="flex"),  # "auto" and "default" are ignored: NOTHING
    # vLLM's extras
    "top_k": both(MAPPED, 5, sp_has(top_k=5)),
    "min_p": both(MAPPED, 0.05, sp_has(min_p=0.05)),
    "min_tokens": both(MAPPED, 2, sp_has(min_tokens=2)),
    "repetition_penalty": both(MAPPED, 1.3, sp_has(repetition_penalty=1.3)),
    "stop_token_ids": both(MAPPED, [50], sp_has(stop_token_ids=(50,))),
    "ignore_eos": both(MAPPED, True, sp_has(ignore_eos=True)),
    "allowed_token_ids": both(MAPPED, [42, 50], sp_has(allowed_token_ids=(42, 50))),
    "bad_words": both(MAPPED, ["def"], sp_has(bad_words=("def",))),
    "skip_special_tokens": both(MAPPED, False, sp_has(skip_special_tokens=False)),
    "include_stop_str_in_output": both(MAPPED, True, sp_has(include_stop_str_in_output=True)),
    "prompt_logprobs": both(MAPPED, 1, prompt_logprobs_returned),
    "cache_salt": both(MAPPED, "team-a", lambda s: s.salt == "team-a"),
    "truncate_prompt_tokens": both(MAPPED, 3, lambda s: len(s.ids) == 3),
    "speculate": both(MAPPED, False, sp_has(speculate=False)),
    "add_generation_prompt": Row(MAPPED, chat=False,
                                 check=template(USER, add_generation_prompt=False)),
    "continue_final_message": Row(MAPPED, chat=True, also={"messages": PARTIAL},
                                  check=template(PARTIAL, continue_final_message=True,
                                                 add_generation_prompt=False)),
    "chat_template_kwargs": Row(MAPPED, chat={"unused": 1},
                                check=template(USER, add_generation_prompt=True)),
    "echo": Row(MAPPED, completions=True,
                check=lambda s: s.json["choices"][0]["text"].startswith(PROMPT)),
    "spaces_between_special_tokens": both(REFUSED, False),
    "response_format": both(MAPPED, {"type": "json_object"},
                            sp_has(structured_outputs=StructuredOutputsParams(json_object=True))),
    "guided_json": both(MAPPED, {"type": "object"}, sp_has(
        structured_outputs=StructuredOutputsParams(json={"type": "object"}))),
    "guided_regex": both(MAPPED, "a+", sp_has(structured_outputs=StructuredOutputsParams(
        regex="a+"))),
    "guided_choice": both(MAPPED, ["yes", "no"], sp_has(
        structured_outputs=StructuredOutputsParams(choice=("yes", "no")))),
    "guided_grammar": both(MAPPED, 'root ::= "a"', sp_has(
        structured_outputs=StructuredOutputsParams(grammar='root ::= "a"'))),
    "structured_outputs": both(MAPPED, {"regex": "a+"}, sp_has(
        structured_outputs=StructuredOutputsParams(regex="a+"))),
    "use_beam_search": both(REFUSED, True),
    "priority": both(REFUSED, 1),
    "chat_template": Row(REFUSED, chat="{{ messages }}"),
}

# Values of refused fields that mean "nothing", accepted: (endpoint, field, value).
NOTHING = [
    ("completions", "best_of", 1), ("completions", "echo", False),
    ("chat", "response_format", {"type": "text"}), ("chat", "tools", []),
    ("chat", "tool_choice", "none"), ("chat", "functions", []),
    ("chat", "function_call", "none"), ("chat", "modalities", ["text"]),
    ("chat", "service_tier", "auto"), ("chat", "service_tier", "default"),
    ("chat", "spaces_between_special_tokens", True),
    ("completions", "use_beam_search", False), ("chat", "priority", 0),
]
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
CASES = [(endpoint, name) for name, row in FIELDS.items() for endpoint in MODELS
         if getattr(row, endpoint) is not ABSENT]


@pytest.fixture(scope="module")
def server():
    llm = jaxkv.LLM(jaxkv.load_default(), max_model_len=256, num_pages=64, max_num_seqs=4,
                    warmup=False)
    s = Server(llm)
    yield s
    s.close()


@pytest.fixture
def spy(server, monkeypatch):
    """The arguments of every `add_request` the server makes (delegated to the engine)."""
    engine, calls = server.llm.engine, []
    real = engine.add_request

    def add_request(request_id, prompt=None, prompt_token_ids=None, sampling_params=None,
                    cache_salt=None):
        calls.append((list(prompt_token_ids), sampling_params, cache_salt))
        return real(request_id, prompt, prompt_token_ids, sampling_params, cache_salt)

    monkeypatch.setattr(engine, "add_request", add_request)
    return calls


def post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{endpoint.replace('chat', 'chat/completions')}",
                      json=body, timeout=120)


def test_the_table_classifies_every_field_of_both_request_models():
    for endpoint, model in MODELS.items():
        listed = {name for name, row in FIELDS.items() if getattr(row, endpoint) is not ABSENT}
        assert listed == set(model.model_fields), endpoint
        for name in listed:  # and the code agrees with the table's kind
            kind = FIELDS[name].kind
            refused = name in model.REFUSED or name == "best_of"
            assert (kind == REFUSED) == refused and (kind == IGNORED) == (
                name in model.IGNORED and not refused), (endpoint, name)


@pytest.mark.parametrize("endpoint, field", CASES)
def test_each_field_is_mapped_ignored_or_refused_by_name(server, spy, endpoint, field):
    row = FIELDS[field]
    baseline = None
    if row.kind == IGNORED:  # what the engine gets without the field
        assert post(server, endpoint, BASE[endpoint]).status_code == 200
        baseline = spy[-1][1]
    body = {**BASE[endpoint], **row.also, field: getattr(row, endpoint)}
    before = len(spy)
    r = post(server, endpoint, body)
    if row.kind == REFUSED:
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == field and field in error["message"], error
        assert len(spy) == before  # nothing reached the engine
        return
    assert r.status_code == 200, r.text[:300]
    ids, sp, salt = spy[-1]
    seen = Seen(sp, ids, salt, r, server.llm.model.tokenizer, baseline)
    assert row.check(seen), (field, sp, ids, salt, r.text[:300])


@pytest.mark.parametrize("endpoint, field, value", NOTHING)
def test_values_that_mean_nothing_are_accepted(server, endpoint, field, value):
    r = post(server, endpoint, {**BASE[endpoint], field: value})
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("endpoint, extra, param", [
    ("completions", {"frobnicate": 1}, "frobnicate"),
    ("chat", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "mood": "ok"}]},
     "messages.0.mood"),
    ("completions", {"stream": True, "stream_options": {"usage_every_n": 2}},
     "stream_options.usage_every_n"),
])
def test_an_unknown_field_is_refused_by_name(server, endpoint, extra, param):
    r = post(server, endpoint, {**BASE[endpoint], **extra})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and "unknown field" in error["message"], error


@pytest.mark.parametrize("endpoint, extra, param", [
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # isdigit, not int()
    ("chat", {"logit_bias": {" 4_2": 1}}, "logit_bias"),  # int() reads it, OpenAI does not
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),  # past the vocabulary
    ("chat", {"logit_bias": {"42": 500}}, "logit_bias"),  # past OpenAI's [-100, 100]
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ("chat", {"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("chat", {"messages": [{"role": "user", "content": "", "tool_calls": [CALL]}]},
     "messages.0.tool_calls"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]},
     "messages.0.tool_calls.0"),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice"),
    ("chat", {"guided_choice": 5}, "guided_choice"),
    ("chat", {"guided_json": "false"}, "guided_json"),
    ("completions", {"max_tokens": -5}, "max_tokens"),
    ("chat", {"tools": [TOOL]}, "tool_choice"),  # 'auto' needs a parser: the template has none
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    ("chat", {"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ("chat", {"cache_salt": ""}, "cache_salt"),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_values_and_combinations_are_400s_naming_the_field(server, endpoint, extra, param):
    r = post(server, endpoint, {**BASE[endpoint], **extra})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.json()


def _completion(server, **fields) -> dict:
    r = post(server, "completions", {**BASE["completions"], "max_tokens": 4, **fields})
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_logit_bias_and_allowed_token_ids_force_the_tokens(server):
    decode = server.llm.model.tokenizer.decode
    forced = _completion(server, logit_bias={"42": 100})["choices"][0]
    assert forced["text"] == decode([42] * 4)
    only = _completion(server, allowed_token_ids=[50], temperature=1.0, seed=3)["choices"][0]
    assert only["text"] == decode([50] * 4)
    banned = _completion(server, logit_bias={"42": 100, "50": 100}, bad_words=["E"])
    assert "E" not in banned["choices"][0]["text"]  # the ban beats the bias


def test_stop_token_ids_end_the_sequence(server):
    out = _completion(server, logit_bias={"50": 100}, stop_token_ids=[50])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 1  # the stop token, included in the ids


def test_prompt_logprobs_are_returned_as_vllm_does(server):
    prompt = [5, 6, 7, 8, 9]
    body = _completion(server, prompt=prompt, prompt_logprobs=2)
    lps = body["choices"][0]["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(prompt)
    for token, entry in zip(prompt[1:], lps[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3  # the token and the top 2
        assert all(v["rank"] <= 2 for k, v in entry.items() if k != str(token))
    oracle = jaxkv.LLM(server.llm.model, max_model_len=256, num_pages=16, warmup=False)
    offline = oracle.generate(prompt_token_ids=[prompt], sampling_params=jaxkv.SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    for ours, theirs, token in zip(lps[1:], offline[1:], prompt[1:], strict=True):
        assert ours[str(token)]["logprob"] == pytest.approx(theirs[token].logprob, abs=1e-4)


def test_chat_template_kwargs_reach_the_template(server, monkeypatch):
    tok = server.llm.model.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{% if shout %}!!{% endif %}")
    ids = {}
    for shout in (False, True):
        r = post(server, "chat", {**BASE["chat"], "chat_template_kwargs": {"shout": shout}})
        assert r.status_code == 200, r.text[:300]
        ids[shout] = r.json()["usage"]["prompt_tokens"]
    assert ids[True] > ids[False]
