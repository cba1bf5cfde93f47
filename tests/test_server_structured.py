"""Structured outputs through `jaxkv serve` and the official `openai` client (issue 30):
``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` and ``guided_*``
extras; replies that parse and validate; a streamed reply equal to the same request answered
whole; a bad schema or two constraints at once is a 400 naming the field, and the server keeps
serving."""

import json
import re

import jsonschema
import openai
import pytest
from serving import MODEL, Server

import jaxkv

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1,
                 "maxItems": 3}},
     "required": ["id", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"$ref": "#/$defs/user"},
        "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1},
                            {"type": "null"}]}},
     "required": ["user", "score"], "additionalProperties": False,
     "$defs": {"user": {"type": "object", "properties": {
         "name": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
         "required": ["name"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "Describe the record as JSON."}]


@pytest.fixture(scope="module")
def server():
    llm = jaxkv.LLM(jaxkv.load_default(), max_model_len=512, num_pages=128, max_num_seqs=4,
                    warmup=False)
    s = Server(llm)
    yield s
    s.close()


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_replies_parse_and_validate(server, index):
    schema = SCHEMAS[index]
    reply = server.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=index, n=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "record", "schema": schema, "strict": True}},
        extra_body={"structured_outputs": None})
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_vllm_extras_regex_choice_and_grammar(server):
    def completion(**extra):
        return server.client.completions.create(model=MODEL, prompt="def f(", max_tokens=40,
                                                temperature=1.0, seed=3, extra_body=extra)
    text = completion(structured_outputs={"regex": r"[a-z]{3}_[0-9]{1,2}"}).choices[0].text
    assert re.fullmatch(r"[a-z]{3}_[0-9]{1,2}", text), text
    assert completion(guided_choice=["up", "down"]).choices[0].text in ("up", "down")
    text = completion(guided_grammar='root ::= "v" [0-9] "." [0-9]').choices[0].text
    assert re.fullmatch(r"v[0-9]\.[0-9]", text), text


def test_a_streamed_reply_assembles_into_the_whole_one(server):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=400, temperature=0,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "r", "schema": SCHEMAS[1]}})
    whole = server.client.chat.completions.create(**kw).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in
              server.client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), SCHEMAS[1])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "objekt"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    # compile but can never end (issue 43): were 200s with "" or cut-off non-JSON
    ({"structured_outputs": {"grammar": "start: start"}}, "structured_outputs"),
    ({"guided_grammar": 'root ::= "a" root'}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "$ref": "#"}}}}, "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}},
                      "required": ["a"]}}, "guided_json"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                              extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"].startswith(f"{param}: "), e.value.body
    ok = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")  # still serving


def test_a_choice_of_thousands_is_served(server):
    """2,000 options (llguidance's Earley row limit) and more: one of them, never a 500."""
    options = [f"option-{i}" for i in range(5000)]
    reply = server.client.completions.create(
        model=MODEL, prompt="def f(", max_tokens=12, temperature=1.0, seed=1, n=2,
        extra_body={"structured_outputs": {"choice": options}})
    for choice in reply.choices:
        assert choice.text in options and choice.finish_reason == "stop", choice
