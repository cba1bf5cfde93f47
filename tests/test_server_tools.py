"""Tool calling through `jaxkv serve` and the official `openai` client (issue 30): "required" and
a named function constrained to the tools' schemas (the calls parse and their arguments
validate), "auto" read from the model's text by the hermes parser, streamed deltas that
assemble into the whole reply, and a tool result sent back; the parsers on their formats."""

import json

import jsonschema
import pytest
from serving import MODEL, Server

import jaxkv
from jaxkv.server.tool_scan import CallScanner, scan_calls
from jaxkv.server.tools import ToolReplies, detect_parser, parse

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Za-z]{2,12}$"},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# "auto" with a model that was never taught tools: its text is made a hermes call by a regex
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "[a-z]{3,8}", "unit": "c"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server():
    llm = jaxkv.LLM(jaxkv.load_default(), max_model_len=512, num_pages=128, max_num_seqs=4,
                    warmup=False)
    s = Server(llm, tool_call_parser="hermes")
    yield s
    s.close()


def _valid(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _create(server, **kw):
    return server.client.chat.completions.create(**{
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, **kw})


def test_required_calls_parse_and_validate(server):
    reply = _create(server, tool_choice="required", temperature=1.0, seed=0, n=3)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _valid(choice.message.tool_calls)
    one = _create(server, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                  seed=1, n=3)
    assert all(len(c.message.tool_calls) == 1 for c in one.choices)


def test_a_named_function_is_called_with_valid_arguments(server):
    reply = _create(server, tool_choice={"type": "function", "function": {"name": "add"}},
                    temperature=1.0, seed=2, n=2)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"  # as OpenAI answers a named tool_choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "add"
        _valid([call])


def test_auto_reads_the_calls_in_the_models_text(server):
    reply = _create(server, temperature=1.0, seed=3, extra_body={"guided_regex": HERMES_CALL})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _valid(choice.message.tool_calls)
    plain = _create(server, temperature=0, max_tokens=8)  # no call in the text: plain content
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def _assembled(stream):
    """(content, [(name, arguments)], finish_reason) from streamed chunks, as clients do."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            fn = tc.function
            calls[tc.index] = (name + (fn.name or ""), args + (fn.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_streamed_deltas_assemble_into_the_whole_reply(server, mode):
    kw = {"required": dict(tool_choice="required", parallel_tool_calls=False),
          "named": dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
          "auto": dict(extra_body={"guided_regex": HERMES_CALL})}[mode]
    whole = _create(server, temperature=0, **kw).choices[0]
    content, calls, finish = _assembled(_create(server, temperature=0, stream=True, **kw))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert (content or None) == whole.message.content and finish == whole.finish_reason


def test_a_tool_result_goes_back_to_the_model(server):
    call = _create(server, tool_choice="required", parallel_tool_calls=False,
                   temperature=0).choices[0].message.tool_calls[0]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
    reply = server.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                  tool_choice="none", max_tokens=8)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_parsers_read_their_formats():
    content, calls = parse("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}'
                                     '\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
                                     "</tool_call>")
    assert content == "Sure.\n" and [(c["function"]["name"], json.loads(
        c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}), ("g", {})]
    _, calls = parse("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; '
                                    '{"name": "g", "parameters": {}}')
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": "y"}
    content, calls = parse("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": [1]}}]')
    assert content == "ok " and json.loads(calls[0]["function"]["arguments"]) == {"a": [1]}
    for parser, text in (("hermes", "<tool_call>{not json</tool_call>"),
                         ("llama3_json", "The answer is {x}."), ("mistral", "no calls")):
        assert parse(parser, text) == (text, [])  # not a call: the text stays content
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_parser("[TOOL_CALLS] {{ x }}") == "mistral"
    assert detect_parser("<|python_tag|>") == "llama3_json"
    assert detect_parser("{{ messages }}") is None


STREAMED = [  # (tool_choice, parser, reply text)
    ("auto", "hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                       '{"city": "Pa}ris", "unit": "c"}}\n</tool_call>\n<tool_call>{"name": '
                       '"add", "arguments": {"a": 1, "b": [2, {"c": "d"}]}}</tool_call>'),
    ("auto", "llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 7}}; '
                            '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("auto", "mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                        '{"name": "get_weather", "arguments": {"city": "R\\"x"}}]'),
    ("required", None, '[{"name": "get_weather", "parameters": {"city": "Lima", "unit": "f"}}]'),
    ("auto", "hermes", "No call here, only {braces} and <tool_ words."),
    ("auto", "hermes", "<tool_call>not a call after all"),
    # what follows the calls is ignored, here an object that is no call
    ("auto", "hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                       ' and then {"x": 1}'),
    ("auto", "hermes", '<tool_call>{"name": "f"}</tool_call>'),  # no arguments: "{}"
    ("auto", "mistral", '[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": [1]}"}]'),  # text
    ("auto", "llama3_json", '\n {"name": "add", "parameters": {"a": 1, "b": 2}}'),
]


@pytest.mark.parametrize("choice, parser, text", STREAMED)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_calls_stream_as_they_are_written_and_add_up_to_the_whole_reply(choice, parser, text,
                                                                         step):
    """The text fed a few characters at a time: the deltas assemble into the whole reply's
    content and calls, and each call's arguments arrive in pieces before the reply ends."""
    whole, reason = ToolReplies(choice, parser).message(text, "stop")
    replies = ToolReplies(choice, parser)
    content, calls, pieces, finish = "", {}, {}, None
    ends = list(range(step, len(text), step)) + [len(text)]
    for end in ends:
        delta, finish = replies.delta(0, text[:end], "stop" if end == len(text) else None)
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            name, args = calls.get(tc["index"], ("", ""))
            fn = tc["function"]
            calls[tc["index"]] = (name + fn.get("name", ""), args + fn.get("arguments", ""))
            if end < len(text) and fn.get("arguments"):
                pieces[tc["index"]] = pieces.get(tc["index"], 0) + 1
    assert finish == reason
    assert (content or None) == whole["content"]
    want = [(c["function"]["name"], c["function"]["arguments"])
            for c in whole.get("tool_calls") or []]
    assert [calls[i] for i in sorted(calls)] == want
    for _, args in want:
        json.loads(args)  # the arguments as written, valid JSON
    if step == 1:  # arguments that are an object stream as written
        assert all(pieces.get(i, 0) > 3 for i, (_, args) in enumerate(want)
                   if len(args) > 4 and text.count(args))


def test_the_scanner_reads_a_growing_text_as_it_would_the_whole():
    """`CallScanner` fed a few characters at a time (strings cut anywhere, escapes split)
    finds the same calls, spans and names as a scan of the whole text."""
    for _, _, text in STREAMED:
        whole = scan_calls(text)
        for step in (1, 2, 5):
            scanner = CallScanner()
            for end in range(step, len(text) + step, step):
                got = scanner.feed(text[:end])
            assert got == whole, (text, step)
    text = '<tool_call>{"name": "f", "arguments": {"s": "a\\"}b", "n": [1, {"m": null}]}}'
    (call,) = scan_calls(text, text.index("{"))
    assert call.name == "f" and call.closed
    assert json.loads(call.arguments(text)) == {"s": 'a"}b', "n": [1, {"m": None}]}
