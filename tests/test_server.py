"""`jaxkv serve`: the real server (uvicorn on 127.0.0.1) talked to with the official `openai`
client and raw HTTP. The oracle for every text is the offline `LLM` on the same model and
sampling parameters."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import MODEL, Server, free_port

import jaxkv

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:", "for i in range("]
SYSTEM = ("You are a careful assistant who writes short Python functions with docstrings, "
          "type hints and no external dependencies. ") * 3


@pytest.fixture(scope="module")
def server():
    model = jaxkv.load_default()
    s = Server(jaxkv.LLM(model, max_model_len=256, num_pages=128, max_num_seqs=8, warmup=False))
    s.oracle = jaxkv.LLM(model, max_model_len=256, num_pages=128, warmup=False)  # its own engine
    yield s
    s.close()


def offline(llm, prompt=None, ids=None, **sp):
    params = jaxkv.SamplingParams(**sp)
    if ids is not None:
        return llm.generate(prompt_token_ids=[ids], sampling_params=params,
                            use_tqdm=False)[0].outputs[0].text
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def chat_ids(llm, messages):
    return list(llm.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False))


def test_models_and_health(server):
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    assert [m.id for m in server.client.models.list().data] == [MODEL]


def test_completion_equals_offline_generation(server):
    r = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                         temperature=0)
    assert r.choices[0].text == offline(server.oracle, PROMPTS[0], max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    n_prompt = len(server.llm.model.encode(PROMPTS[0]))
    assert r.usage.prompt_tokens == n_prompt
    assert 0 < r.usage.completion_tokens <= 24


def test_streamed_completion_equals_the_whole_one(server):
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0.8, seed=7)
    whole = server.client.completions.create(**kwargs)
    chunks = list(server.client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text == offline(server.oracle, PROMPTS[1], max_tokens=20,
                                                    temperature=0.8, seed=7)
    assert len([c for c in chunks if c.choices]) > 1  # really streamed
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries
    the usage so far, growing to the final usage chunk's."""
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert len(chunks) >= 2 and all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[0] > 0
    assert counts[-2] == counts[-1] == chunks[-1].usage.completion_tokens > 0
    assert not chunks[-1].choices  # the final usage chunk


def test_chat_streaming_and_not(server):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Write a function that adds two numbers."}]
    expected = offline(server.oracle, ids=chat_ids(server.oracle, messages), max_tokens=24,
                       temperature=0)
    r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                              temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages,
                                                        max_tokens=24, temperature=0,
                                                        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_n_and_logprobs(server):
    r = server.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, n=2,
                                         temperature=1.0, seed=3, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) > 0
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3)
    first = chat.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 3
    assert first.logprob == pytest.approx(max(t.logprob for t in first.top_logprobs), abs=1e-5)


def test_concurrent_requests_from_threads(server):
    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                             temperature=0)
        return prompt, r.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(12)))
    for prompt, text in results:
        assert text == offline(server.oracle, prompt, max_tokens=16, temperature=0)


def test_metrics_count_tokens_and_prefix_cache_hits(server):
    before = server.metrics()
    completion = 0
    for question in ("Write a sort.", "Write a search."):
        r = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": question}],
            max_tokens=8, temperature=0)
        completion += r.usage.completion_tokens
        cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32  # the second request found the long system prompt cached
    time.sleep(0.2)
    after = server.metrics()
    assert after["jaxkv:generation_tokens_total"] - before["jaxkv:generation_tokens_total"] \
        == completion
    assert after["jaxkv:prefix_cache_hits_total"] - before["jaxkv:prefix_cache_hits_total"] \
        >= cached
    assert after["jaxkv:time_to_first_token_seconds_count"] > \
        before.get("jaxkv:time_to_first_token_seconds_count", 0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n="two"), "n"),
])
def test_bad_input_is_a_400_naming_the_field(server, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="x", **kwargs)
    assert field in str(e.value) and e.value.param == field
    # and the server keeps serving
    assert server.client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                            temperature=0).choices[0].text is not None


@pytest.mark.parametrize("content", ['{"model": "tiny-llama", "prompt": ', "not json",
                                     '{"prompt": "x",}'])
def test_malformed_json_is_a_400_without_a_byte_offset_for_param(server, content):
    r = httpx.post(f"{server.url}/v1/completions", content=content, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["message"].startswith("the request body is not valid JSON: "), error
    assert error["param"] is None and error["type"] == "BadRequestError"


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": 5}, "prompt"),  # no union-member tag ("prompt.str")
    ("completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]},
     "messages.0.role"),
    ("chat/completions", {"messages": []}, "messages"),
    ("completions", [1, 2], None),  # JSON, but not an object: no field to name
])
def test_a_field_error_names_the_field(server, endpoint, body, param):
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param or 'the request body'}: "), error


def test_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError, match="nope"):
        server.client.completions.create(model="nope", prompt="x", max_tokens=2)


def _wait_idle(server, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if m["jaxkv:num_requests_running"] == 0 and m["jaxkv:kv_pages_used"] == 0 \
                and server.app.state.engine.num_pending == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"server not idle: {server.metrics()}")


def test_a_client_that_disconnects_frees_its_pages(server, monkeypatch):
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "stream": True}
    before = server.llm.engine.stats().generated_tokens

    def slowed(fn):  # 240 tokens take longer than noticing the disconnect, however fast the
        def run(*args):  # engine (it once finished them all before the next chunk was sent)
            time.sleep(0.05)
            return fn(*args)
        return run

    monkeypatch.setattr(server.llm.engine, "steps", _wrapped_steps(server.llm.engine, slowed))
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metrics()["jaxkv:kv_pages_used"] > 0
    # the client closed the connection after its first chunk
    _wait_idle(server)
    assert server.llm.engine.stats().kv_pages_used == 0
    assert server.llm.engine.stats().generated_tokens - before < 240  # aborted, not finished


def _wrapped_steps(engine, wrap):
    """The engine's step programs with ``wrap`` around both (Steps is a NamedTuple)."""
    return engine.steps._replace(step=wrap(engine.steps.step),
                                 decode_loop=wrap(engine.steps.decode_loop))


def test_an_engine_error_fails_that_request_and_the_server_keeps_serving(server, monkeypatch):
    engine = server.llm.engine
    calls = {"n": 0}

    def failing_once(fn):
        def run(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected device failure")
            return fn(*args)
        return run

    real = engine.steps
    monkeypatch.setattr(engine, "steps", _wrapped_steps(engine, failing_once))
    with pytest.raises(openai.InternalServerError, match="injected device failure"):
        server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                         temperature=0)
    monkeypatch.setattr(engine, "steps", real)
    r = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                         temperature=0)
    assert r.choices[0].text == offline(server.oracle, PROMPTS[0], max_tokens=8,
                                        temperature=0)
    _wait_idle(server)


def test_a_full_queue_answers_429():
    llm = jaxkv.LLM(None, max_model_len=256, num_pages=64, max_num_seqs=2, warmup=False)

    def slow(fn):  # a slow device: the first request is surely unfinished when the next comes
        def run(*args):
            time.sleep(0.2)
            return fn(*args)
        return run

    llm.engine.steps = _wrapped_steps(llm.engine, slow)
    s = Server(llm, max_pending=1)
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # held: a dropped iterator closes the stream
            first = next(lines)
            assert "error" not in first, first
            second = httpx.post(f"{s.url}/v1/completions", json={**body, "stream": False},
                                timeout=60)
            assert second.status_code == 429, second.text[:300]
            assert "max_pending=1" in second.json()["error"]["message"]
        _wait_idle(s)  # the first one's client left: aborted, its pages back
    finally:
        s.close()


@pytest.mark.slow  # a whole process and its compiles; the app itself is tested in-process above
def test_jaxkv_serve_command_serves(tmp_path):
    """The installed command: `jaxkv serve` in its own process answers over HTTP."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "serve", "--port", str(port),
                             "--max-model-len", "128", "--num-pages", "32", "--no-warmup"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "jaxkv serve did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4,
                                      temperature=0)
        assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_streamed_n2_ends_each_choice_once_and_equals_the_whole_one(server):
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, n=2, temperature=1.0, seed=5)
    whole = {c.index: c.text for c in server.client.completions.create(**kwargs).choices}
    texts, ends = {0: "", 1: ""}, {0: 0, 1: 0}
    for chunk in server.client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            ends[c.index] += c.finish_reason is not None
    assert texts == whole and ends == {0: 1, 1: 1}


def test_a_batch_of_prompts_with_a_bad_one_leaves_nothing_running(server):
    too_long = list(range(3, 300))  # past max_model_len 256: refused after the first queued
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt=[[5, 6, 7], too_long],
                                         max_tokens=50, temperature=0)
    _wait_idle(server)


def test_a_disaggregated_engine_serves_and_counts_its_transfers(server):
    from jaxkv import Engine
    from jaxkv.disagg import DisaggregatedEngine

    llm = jaxkv.LLM(server.llm.model, max_model_len=256, num_pages=128, max_num_seqs=8,
                    warmup=False)
    shape = dict(page_size=16, num_pages=64, max_num_seqs=8, max_model_len=256)
    llm.engine = DisaggregatedEngine(Engine(llm.model, **shape), Engine(llm.model, **shape))
    s = Server(llm)
    try:
        kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0)
        whole = s.client.completions.create(**kwargs)
        streamed = "".join(c.choices[0].text for c in s.client.completions.create(
            **kwargs, stream=True) if c.choices)
        assert whole.choices[0].text == streamed == offline(server.oracle, PROMPTS[2],
                                                            max_tokens=16, temperature=0)
        r = s.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, n=2,
                                        temperature=0)
        assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
        time.sleep(0.2)
        m = s.metrics()
        assert m["jaxkv:kv_transfers_total"] == 3  # every request's KV moved once
        assert m["jaxkv:kv_transfer_pages_total"] >= 3
        assert m["jaxkv:num_requests_running"] == 0
        llm.engine.check()
    finally:
        s.close()


@settings(max_examples=6, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sse_deltas_join_to_the_whole_text(server, data):
    """Over SSE, random stop strings (cut from the greedy reply, so they are hit), logprobs (one
    token a step), n > 1: each choice's stream is at every chunk a prefix of the whole reply,
    and adds up to it; nothing of a stop string that ends the text is ever sent."""
    prompt = data.draw(st.sampled_from(PROMPTS))
    reply = offline(server.oracle, prompt, max_tokens=24, temperature=0)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, max(0, len(reply) - 2)))
        stops.append(reply[at:at + data.draw(st.integers(1, 10))] or "x")
    n = data.draw(st.sampled_from([1, 2]))
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, stop=stops, n=n, seed=3,
                  temperature=0 if n == 1 else 0.8, logprobs=data.draw(st.sampled_from([None, 2])))
    whole = {c.index: c.text for c in server.client.completions.create(**kwargs).choices}
    sent = {i: "" for i in range(n)}
    for chunk in server.client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            sent[c.index] += c.text
            assert whole[c.index].startswith(sent[c.index]), (stops, sent, whole)
    assert sent == whole
