"""lm-eval-harness against `jaxkv serve` (issue 30): its ``local-completions`` model, with the
server's own tokenizer endpoints, scores a small multiple-choice task read from a local file;
every loglikelihood it gets equals transformers' for the same tokens (within 1e-3)."""

import json

import numpy as np
import pytest
import torch
from serving import MODEL, Server

import jaxkv

ITEMS = [
    {"question": "def add(a, b):\n    return", "choices": ["a + b", "a - b", "print(a)"],
     "answer": 0},
    {"question": "import os\nprint(os.", "choices": ["getcwd())", "lower())", "append(1))"],
     "answer": 0},
    {"question": "for i in range(10):\n   ", "choices": ["print(i)", "return", "class X:"],
     "answer": 0},
    {"question": "class Stack:\n    def __init__(self):\n        self.items =",
     "choices": ["[]", "None", "'x'"], "answer": 0},
]
TASK = """task: jaxkv_code_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_default()


def _hf_loglikelihood(hf, tok, context: str, continuation: str) -> float:
    """lm-eval's split (a context's trailing spaces go to the continuation), then the sum of
    the continuation tokens' log-probabilities under transformers."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n = len(tok.encode(context, add_special_tokens=False))
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].double(), -1)
    return float(sum(lp[i - 1, whole[i]] for i in range(n, len(whole))))


def test_lm_eval_scores_a_local_task_with_transformers_loglikelihoods(model, tmp_path,
                                                                      monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in ITEMS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    server = Server(jaxkv.LLM(model, max_model_len=256, num_pages=64, max_num_seqs=4,
                              warmup=False))
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={server.url}/v1/completions,model={MODEL},"
                       "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,"
                       "max_retries=1",
            tasks=["jaxkv_code_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True, batch_size=1)
    finally:
        server.close()
    samples = out["samples"]["jaxkv_code_mc"]
    assert len(samples) == len(ITEMS)
    hf = AutoModelForCausalLM.from_pretrained(model.path, torch_dtype=torch.float32)
    got, want = [], []
    for s in samples:
        doc = s["doc"]
        for choice, resp in zip(doc["choices"], s["resps"], strict=True):
            got.append(resp[0][0])
            want.append(_hf_loglikelihood(hf, model.tokenizer, doc["question"], " " + choice))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
    acc = out["results"]["jaxkv_code_mc"]["acc,none"]
    assert acc == np.mean([int(np.argmax([r[0][0] for r in s["resps"]]) == s["doc"]["answer"])
                           for s in samples])
