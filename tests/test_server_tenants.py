"""Tenants: `--api-key` guards /v1/*, each key is its own prefix-cache namespace, and a request's
`cache_salt` subdivides it (or, without keys, is the namespace), so `cached_tokens` only ever
reports a hit on KV the same caller computed."""

from __future__ import annotations

import httpx
import openai
import pytest
from serving import MODEL, Server

import jaxkv
from jaxkv.cli import build_parser
from jaxkv.server.auth import Tenants, read_key_file, tenant_id

ALICE, BOB = "sk-alice-0123", "sk-bob-4567"


def long_prompt(start: int) -> list[int]:
    return list(range(start, start + 96))  # six pages of 16: a hit is easy to see


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_default()


def _llm(model):
    return jaxkv.LLM(model, max_model_len=256, num_pages=96, max_num_seqs=4, warmup=False)


@pytest.fixture(scope="module")
def keyed(model):
    s = Server(_llm(model), api_key=ALICE, api_keys=(ALICE, BOB))
    yield s
    s.close()


@pytest.fixture(scope="module")
def open_server(model):
    s = Server(_llm(model))
    yield s
    s.close()


def complete(server, key: str | None, prompt: list[int], **fields) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **fields})


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text[:300]
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def engine_hits(server) -> int:
    return server.llm.engine.stats().cached_prompt_tokens


def test_each_key_is_its_own_prefix_cache_namespace(keyed):
    prompt = long_prompt(10)
    assert cached(complete(keyed, ALICE, prompt)) == 0
    before = engine_hits(keyed)
    assert cached(complete(keyed, BOB, prompt)) == 0  # alice's KV is not bob's
    assert engine_hits(keyed) == before  # the engine found no hit either
    hit = cached(complete(keyed, ALICE, prompt))
    assert hit >= 80  # the same tenant's repeat is served from the cache
    assert engine_hits(keyed) - before == hit
    assert cached(complete(keyed, BOB, prompt)) >= 80  # and bob's own repeat


def test_cache_salt_subdivides_a_tenant_and_cannot_reach_another(keyed, monkeypatch):
    prompt = long_prompt(300)
    assert cached(complete(keyed, ALICE, prompt)) == 0
    assert cached(complete(keyed, ALICE, prompt, cache_salt="project-x")) == 0
    assert cached(complete(keyed, ALICE, prompt, cache_salt="project-x")) >= 80
    salts = []
    engine = keyed.llm.engine
    real = engine.add_request

    def add_request(*args, cache_salt=None, **kwargs):
        salts.append(cache_salt)
        return real(*args, cache_salt=cache_salt, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)
    # bob naming alice's namespace (the hash of her key) still lands in his own
    before = engine_hits(keyed)
    assert cached(complete(keyed, BOB, prompt, cache_salt=tenant_id(ALICE))) == 0
    assert engine_hits(keyed) == before
    assert cached(complete(keyed, BOB, prompt)) == 0
    assert all(BOB not in s and ALICE not in s for s in salts)  # never the key itself
    assert salts[-1] == tenant_id(BOB) != tenant_id(ALICE)


@pytest.mark.parametrize("headers, why", [
    ({}, "missing API key"),
    ({"Authorization": "Bearer sk-nobody"}, "invalid API key"),
    ({"Authorization": f"Basic {ALICE}"}, "missing API key"),
    ({"Authorization": f"Bearer {ALICE}x"}, "invalid API key"),
])
def test_a_missing_or_wrong_key_is_a_401(keyed, headers, why):
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models")):
        r = httpx.request(method, f"{keyed.url}{path}", headers=headers, timeout=60,
                          json={"model": MODEL, "prompt": "x"} if method == "POST" else None)
        assert r.status_code == 401, (path, r.text[:300])
        error = r.json()["error"]
        assert error["type"] == "AuthenticationError" and why in error["message"], error
    # malformed JSON without a key: still a 401 (checked before the body is read)
    r = httpx.post(f"{keyed.url}/v1/completions", content="{", headers=headers, timeout=60)
    assert r.status_code == 401


def test_health_and_metrics_stay_open_and_the_openai_client_authenticates(keyed):
    assert httpx.get(f"{keyed.url}/health", timeout=60).status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", timeout=60).status_code == 200
    assert [m.id for m in keyed.client.models.list().data] == [MODEL]  # sends alice's key
    stranger = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-nobody", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        stranger.completions.create(model=MODEL, prompt="x", max_tokens=2)


def test_without_keys_cache_salt_isolates(open_server):
    prompt = long_prompt(600)
    s = open_server
    assert cached(complete(s, None, prompt)) == 0
    before = engine_hits(s)
    assert cached(complete(s, None, prompt, cache_salt="a")) == 0
    assert cached(complete(s, None, prompt, cache_salt="b")) == 0
    assert engine_hits(s) == before  # no hit across namespaces, in the engine's books too
    assert cached(complete(s, None, prompt, cache_salt="a")) >= 80
    assert cached(complete(s, None, prompt)) >= 80  # no salt: the shared namespace, as before
    # and an Authorization header means nothing without keys
    assert cached(complete(s, "anything", prompt)) >= 80


def test_serve_takes_keys_from_flags_and_a_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{ALICE}\n\n  {BOB}  \n")
    args = build_parser().parse_args(["serve", "--api-key", "k1", "--api-key", "k2",
                                      "--api-key-file", str(path)])
    assert args.api_key == ["k1", "k2"] and read_key_file(args.api_key_file) == [ALICE, BOB]
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="no keys"):
        read_key_file(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="API key"):
        Tenants(("has space",))


def test_tokenizer_routes_need_a_key_only_when_asked(model, keyed):
    """As vLLM's, /tokenize, /detokenize and /tokenizer_info answer without a key by default;
    --tokenizer-routes-need-key puts them behind the keys like /v1/*."""
    calls = (("POST", "/tokenize", {"prompt": "hello"}), ("POST", "/detokenize",
                                                          {"tokens": [5, 6]}),
             ("GET", "/tokenizer_info", None))
    for method, path, body in calls:
        assert httpx.request(method, f"{keyed.url}{path}", json=body,
                             timeout=60).status_code == 200, path
    strict = Server(_llm(model), api_key=ALICE, api_keys=(ALICE,),
                    tokenizer_routes_need_key=True)
    try:
        for method, path, body in calls:
            r = httpx.request(method, f"{strict.url}{path}", json=body, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            r = httpx.request(method, f"{strict.url}{path}", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {ALICE}"})
            assert r.status_code == 200, (path, r.text[:300])
    finally:
        strict.close()
