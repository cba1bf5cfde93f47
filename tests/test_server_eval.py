"""What evaluation harnesses ask of `jaxkv serve` (issue 30): /v1/completions with echo,
logprobs and max_tokens=0 returns the prompt's token logprobs, equal to transformers' on the
same checkpoint (the embedded model's HF folder); /tokenize, /detokenize and /v1/models."""

import httpx
import numpy as np
import pytest
import torch
from serving import MODEL, Server

import jaxkv

ITEMS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
         "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"]


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_default()


@pytest.fixture(scope="module")
def server(model):
    s = Server(jaxkv.LLM(model, max_model_len=256, num_pages=64, max_num_seqs=4,
                         warmup=False))
    yield s
    s.close()


def _hf_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs(server, model):
    tok = model.tokenizer
    prompts = [tok.encode(t) for t in ITEMS]
    reply = server.client.completions.create(model=MODEL, prompt=prompts, max_tokens=0,
                                             echo=True, logprobs=1, temperature=0)
    assert reply.usage.completion_tokens == 0
    for ids, choice in zip(prompts, reply.choices, strict=True):
        lp = choice.logprobs
        assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
        assert lp.tokens == [tok.decode([t]) for t in ids] and lp.token_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], _hf_logprobs(model, ids), rtol=0,
                                   atol=1e-3)
        for token, top, got in zip(lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:],
                                   strict=True):
            assert top[token] == got and len(top) in (1, 2)  # the token, and the top one


def test_echo_puts_the_prompt_before_the_completion(server, model):
    text = ITEMS[0]
    reply = server.client.completions.create(model=MODEL, prompt=text, max_tokens=3,
                                             echo=True, logprobs=0, temperature=0)
    choice = reply.choices[0]
    n = len(model.tokenizer.encode(text))
    assert choice.text.startswith(text) and len(choice.logprobs.tokens) == n + 3
    assert choice.logprobs.token_logprobs[0] is None
    assert all(x <= 0 for x in choice.logprobs.token_logprobs[1:])
    plain = server.client.completions.create(model=MODEL, prompt=text, max_tokens=3,
                                             temperature=0)
    assert choice.text == text + plain.choices[0].text


def test_max_tokens_0_without_echo_and_echo_when_streaming_are_refused(server):
    for body, param in (({"max_tokens": 0}, "max_tokens"),
                        ({"echo": True, "stream": True}, "echo")):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tokenize_detokenize_and_models(server, model):
    tok = model.tokenizer
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": ITEMS[1]}, timeout=60).json()
    assert r["tokens"] == tok.encode(ITEMS[1]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60).json()
    assert chat["tokens"] == list(tok.apply_chat_template(messages, tokenize=True,
                                                          add_generation_prompt=True,
                                                          return_dict=False))
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, timeout=60)
    assert back.json() == {"prompt": ITEMS[1]}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**7]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    other = httpx.post(f"{server.url}/tokenize", json={"model": "x", "prompt": "a"}, timeout=60)
    assert other.status_code == 404
    card = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == 256
