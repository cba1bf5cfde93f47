"""jaxkv against Hugging Face transformers' PyTorch models on the same (random) weights.

Every supported family (Llama MHA/GQA/MQA, Llama-3 rope scaling, Qwen2 qkv bias + tied
embeddings, Qwen3 q/k norm, Mistral with and without a sliding window) is built tiny in
`transformers`, saved as safetensors, loaded with `jaxkv.load_pretrained`, and compared on
logits at every prompt position (dense path), last-token logits of the paged prefill (ragged,
chunked), and 64 greedy tokens. Loading errors are checked by the tensor or model type they name.
"""

import copy
import dataclasses
import json
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_models import SPECS, build_hf_model, save_hf_model
from safetensors.numpy import load_file, save_file

import jaxkv
from jaxkv.cache.allocator import PageAllocator
from jaxkv.model import UnsupportedModelError
from jaxkv.model.config import ModelConfig
from jaxkv.model.loading import CheckpointError
from jaxkv.runtime.batch import Row, build_batch
from jaxkv.runtime.steps import make_steps
from pallas_kernels.reference import dense_causal_attention

ATOL = 1e-4  # fp32 end to end; observed differences are ~5e-7
PROMPT_LEN = 130  # > 64 (the llama3 case's original context) and > 16 (the sliding window)
GREEDY_CASES = ("llama_gqa", "llama3_rope", "qwen2", "qwen3", "mistral", "mistral_swa")
NEW_TOKENS = 64


def _ids(n, seed):
    return np.random.default_rng(seed).integers(3, 256, size=n).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF model, its checkpoint folder, the jaxkv Model loaded from it), built lazily."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = build_hf_model(name)
            folder = save_hf_model(hf, tmp_path_factory.mktemp(name))
            cache[name] = (hf, folder, jaxkv.load_pretrained(folder))
        return cache[name]

    return get


def hf_logits(hf, ids) -> np.ndarray:
    """f32[T, V] logits of every position of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def dense_logits(model, ids, config=None) -> np.ndarray:
    """f32[T, V] jaxkv logits of every position, with dense causal attention (no pages)."""
    module = model.module()
    if config is not None:  # the same weights, computed with some option switched off
        module.config = config
    c = module.config

    def attention(layer, q_thd, k_tkd, v_tkd, carry):
        out = dense_causal_attention(q_thd[None], k_tkd[None], v_tkd[None], sm_scale=c.sm_scale,
                                     sliding_window=c.sliding_window)
        return out[0], carry

    tokens = jnp.asarray(ids, jnp.int32)
    hidden, _ = module(tokens, jnp.arange(len(ids), dtype=jnp.int32), attention, None)
    return np.asarray(module.logits(hidden))


def paged_prefill_last_logits(model, prompts, split, *, page_size=16):
    """Last-token logits of each prompt after each of two chunked, batched paged prefills.

    Prompt i is prefilled as ``p[:split[i]]`` then ``p[split[i]:]`` (the second chunk attends to
    the K/V the first wrote into the pages). Returns f32[2, len(prompts), V].
    """
    cfg = model.config
    need = [-(-len(p) // page_size) for p in prompts]
    allocator = PageAllocator(sum(need))
    pages = [allocator.allocate(n) for n in need]
    state = jaxkv.init_state(cfg, allocator.num_pages, page_size, len(prompts), max(need),
                             model.dtype)
    steps = make_steps(model.graphdef)
    out = []
    for chunk in range(2):
        rows = []
        for slot, (p, s, pg) in enumerate(zip(prompts, split, pages, strict=True)):
            lo, hi = (0, s) if chunk == 0 else (s, len(p))
            rows.append(Row(slot, p[lo:hi], lo, pg))
        batch = build_batch(rows, page_size=page_size, num_pages=allocator.num_pages,
                            max_seqs=len(prompts), max_pages_per_seq=max(need),
                            vocab_size=cfg.vocab_size)
        logits, state = steps.prefill(model.params, state, batch)
        out.append(np.asarray(logits)[: len(prompts)])
    return np.stack(out)


@pytest.mark.parametrize("name", list(SPECS))
def test_config_matches_hf(checkpoints, name):
    hf, _, model = checkpoints(name)
    c, h = model.config, hf.config
    assert c.model_type == h.model_type
    assert (c.num_heads, c.num_kv_heads) == (h.num_attention_heads, h.num_key_value_heads)
    assert c.head_dim == (getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads)
    assert c.tie_word_embeddings == h.tie_word_embeddings
    assert c.attention_bias == (name == "qwen2")
    assert c.qk_norm == (name == "qwen3")
    assert c.sliding_window == (16 if name == "mistral_swa" else None)
    assert (c.rope_scaling is not None) == (name == "llama3_rope")


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_every_position(checkpoints, name):
    hf, _, model = checkpoints(name)
    ids = _ids(PROMPT_LEN, seed=1)
    np.testing.assert_allclose(dense_logits(model, ids), hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(SPECS))
def test_paged_prefill_last_logits(checkpoints, name):
    hf, _, model = checkpoints(name)
    prompts, split = [_ids(PROMPT_LEN, seed=1), _ids(37, seed=2)], [70, 20]
    got = paged_prefill_last_logits(model, prompts, split)
    for i, (p, s) in enumerate(zip(prompts, split, strict=True)):
        ref = hf_logits(hf, p)
        np.testing.assert_allclose(got[0, i], ref[s - 1], atol=ATOL, rtol=0)
        np.testing.assert_allclose(got[1, i], ref[-1], atol=ATOL, rtol=0)


# Each option, switched off on the same weights, must move the logits far beyond ATOL: proof
# that the perturbed weights and the prompt length really exercise that code path.
_SWITCH_OFF = {
    "llama3_rope": dict(rope_scaling=None),
    "qwen2": dict(attention_bias=False),
    "qwen3": dict(qk_norm=False),
    "mistral_swa": dict(sliding_window=None),
}


@pytest.mark.parametrize("name", list(_SWITCH_OFF))
def test_cases_exercise_their_option(checkpoints, name):
    hf, _, model = checkpoints(name)
    ids = _ids(PROMPT_LEN, seed=1)
    off = dataclasses.replace(model.config, **_SWITCH_OFF[name])
    assert np.abs(dense_logits(model, ids, off) - hf_logits(hf, ids)).max() > 100 * ATOL


def test_final_norm_and_bias_weights_are_not_trivial(checkpoints):
    # HF initializes norms to 1 and biases to 0; the oracle is only meaningful if they are not.
    _, _, model = checkpoints("qwen3")
    module = model.module()
    assert np.abs(np.asarray(module.final_norm[...]) - 1).max() > 1e-3
    assert np.abs(np.asarray(module.layers.q_norm[...]) - 1).max() > 1e-3
    _, _, qwen2 = checkpoints("qwen2")
    assert np.abs(np.asarray(qwen2.module().layers.bk[...])).max() > 1e-3


def _hf_greedy(hf, ids, n):
    """n greedy tokens from HF's own `generate`, with eos disabled and no logits processors."""
    # `generate` fills a None eos from the model's own generation config, so clear it there
    # (min_new_tokens would instead mask eos logits, changing the argmax jaxkv compares).
    saved = hf.generation_config
    hf.generation_config = copy.deepcopy(saved)
    hf.generation_config.update(eos_token_id=None, pad_token_id=0, do_sample=False,
                                max_new_tokens=n, min_new_tokens=None)
    gc = hf.generation_config
    for knob, neutral in (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0),
                          ("temperature", 1.0), ("num_beams", 1)):
        assert getattr(gc, knob, None) in (None, neutral), (knob, getattr(gc, knob))
    try:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), generation_config=copy.deepcopy(gc))
    finally:
        hf.generation_config = saved
    tokens = out[0, len(ids):].tolist()
    assert len(tokens) == n
    return tokens


@pytest.mark.parametrize("name", GREEDY_CASES)
def test_greedy_tokens_match_hf_generate(checkpoints, name):
    hf, _, model = checkpoints(name)
    prompts = [_ids(100, seed=3), _ids(23, seed=4)]
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = jaxkv.generate(model, prompts, sp)
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert got == want
    assert len(set(want[0])) > 3  # not a degenerate single-token loop


# --- loading errors ---------------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path):
    import transformers

    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        jaxkv.load_pretrained(tmp_path)


def test_missing_folder_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError):
        jaxkv.load_pretrained(tmp_path / "no-such-checkpoint")
    build_hf_model("llama_gqa").config.save_pretrained(str(tmp_path))  # config, no tensors
    with pytest.raises(FileNotFoundError, match="safetensors"):
        jaxkv.load_pretrained(tmp_path)


def _edited_checkpoint(src, dst, edit):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


_TARGET = "model.layers.1.self_attn.k_proj.weight"


def _remove(t):
    del t[_TARGET]


def _rename(t):
    t[_TARGET.replace("k_proj", "key_proj")] = t.pop(_TARGET)


def _reshape(t):
    t[_TARGET] = np.ascontiguousarray(t[_TARGET][:-1])


@pytest.mark.parametrize("edit, names", [
    (_remove, [f"missing tensors (1): {_TARGET}"]),
    (_rename, [_TARGET, _TARGET.replace("k_proj", "key_proj")]),
    (_reshape, [f"{_TARGET}: expected (32, 64), got (31, 64)"]),
])
def test_bad_checkpoint_names_the_tensor(checkpoints, tmp_path, edit, names):
    _, folder, _ = checkpoints("llama_gqa")
    bad = _edited_checkpoint(folder, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as info:
        jaxkv.load_pretrained(bad)
    for name in names:
        assert re.search(re.escape(name), str(info.value)), str(info.value)


def test_sharded_checkpoint_loads_the_same(checkpoints, tmp_path):
    hf, _, single = checkpoints("llama_gqa")
    folder = save_hf_model(hf, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (folder / "model.safetensors").exists()
    sharded = jaxkv.load_pretrained(folder)
    for a, b in zip(jaxkv_leaves(single), jaxkv_leaves(sharded), strict=True):
        np.testing.assert_array_equal(a, b)
    ids = _ids(PROMPT_LEN, seed=1)
    got = paged_prefill_last_logits(sharded, [ids], [64])
    np.testing.assert_allclose(got[1, 0], hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def jaxkv_leaves(model):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(model.params)]
