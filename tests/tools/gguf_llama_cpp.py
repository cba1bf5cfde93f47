"""Cross-check of the tests' GGUF layouts against llama.cpp itself (needs `llama-cpp-python`,
which `make test` does not install): tiny random Gemma 2, Gemma 3, Phi-3, Mixtral and Qwen3-MoE
models are written as GGUF by the tests' writer (tests/gguf_files.py), then read by llama.cpp
and by jaxkv; both sets of logits are compared with transformers' on the source model.

    .venv/bin/pip install llama-cpp-python
    PYTHONPATH=tests .venv/bin/python -m tools.gguf_llama_cpp
"""

import tempfile
from pathlib import Path

import llama_cpp
import numpy as np
from gguf_files import write_gguf
from hf_models import build_hf_model, dense_logits, hf_logits

import jaxkv
from jaxkv.model.pretrained import DEFAULT_MODEL_DIR

IDS = np.random.default_rng(1).integers(3, 4096, size=40).tolist()

print(f"{'model':<10} {'llama.cpp - transformers':>25} {'jaxkv - transformers':>21} "
      f"{'max |logit|':>12}")
# Gemma: tied head and head_dim query scale, as real Gemma files are. Qwen3-MoE: every layer
# a mixture (llama.cpp's qwen3moe has no dense layers) and its top-k renormalized (llama.cpp
# does). Every model: the embedded tokenizer's 4096-token vocabulary (llama.cpp needs one).
OPTIONS = {"gemma2": dict(query_pre_attn_scalar=16, tie_word_embeddings=True),
           "gemma3": dict(query_pre_attn_scalar=16, tie_word_embeddings=True),
           "phi3": {}, "mixtral": {},
           "qwen3_moe": dict(mlp_only_layers=[], norm_topk_prob=True)}
for name, options in OPTIONS.items():
    hf = build_hf_model(name, vocab_size=4096, **options)
    path = write_gguf(hf, Path(tempfile.mkdtemp()) / f"{name}.gguf", tokenizer=DEFAULT_MODEL_DIR)
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    llm.eval(IDS)
    theirs = np.asarray(llm.scores[:len(IDS)])
    ref = hf_logits(hf, IDS)
    ours = dense_logits(jaxkv.load_pretrained(path), IDS)
    print(f"{name:<10} {np.abs(theirs - ref).max():>25.2e} {np.abs(ours - ref).max():>21.2e} "
          f"{np.abs(ref).max():>12.2f}")
