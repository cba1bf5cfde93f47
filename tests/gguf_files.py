"""GGUF files written from tiny random HF models, laid out as llama.cpp's converter writes them.

`write_gguf` stores every 2-D weight whose rows divide into blocks as ``tensor_type`` (norms,
biases and odd shapes stay F32, as llama.cpp keeps them), permutes the q/k projections of
Llama/Mistral models the way llama.cpp does, and can embed a byte-level BPE tokenizer with a
chat template. The `gguf` package quantizes F16 ... Q5_1 itself; it has no quantizer for the
K-quants, so their blocks are random bytes whose f16 scales are set for weights of std ~0.05
(a dequantizer is tested by any bytes: jaxkv and transformers must read the same numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# K-quant block layouts: the byte offsets of the f16 scale(s) inside one 256-value block.
_K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# Gemma 2/3 (llama.cpp's names for the norms around each block; every norm stored as 1 + w)
_SANDWICH = {"post_attention_layernorm.weight": "post_attention_norm.weight",
             "pre_feedforward_layernorm.weight": "ffn_norm.weight",
             "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_ARCH = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen3_moe": "qwen3moe"}  # -> llama.cpp
# Phi-3's fused projections, under llama.cpp's names
_PHI3 = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}


def _moe_metadata(w, c, arch: str) -> None:
    """llama.cpp's mixture-of-experts keys (Mixtral's expert width is feed_forward_length)."""
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)


def _phi3_metadata(w, c) -> dict:
    """llama.cpp's Phi-3 keys; returns LongRoPE's factor tensors (llama.cpp derives the
    attention factor from the context extension, as HF does when a config names none)."""
    import math

    rope = c.rope_parameters
    original = rope["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(c.sliding_window or 0)
    scale = c.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original))
                                    if scale > 1 else 1.0)
    return {"rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
            "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32)}


def _moe_tensors(rest: str, array: np.ndarray):
    """llama.cpp's names and arrays for one of transformers' MoE tensors: the router, and the
    experts stacked [X, out, in] (transformers keeps gate and up as one [X, 2F, E])."""
    if rest == "mlp.gate.weight":
        return [("ffn_gate_inp.weight", array)]
    if rest == "mlp.experts.gate_up_proj":
        gate, up = np.split(array, 2, axis=1)
        return [("ffn_gate_exps.weight", gate), ("ffn_up_exps.weight", up)]
    if rest == "mlp.experts.down_proj":
        return [("ffn_down_exps.weight", array)]
    return None


def _gemma_metadata(w, c, arch: str) -> None:
    """What llama.cpp's converter writes for Gemma 2/3 beyond the Llama keys."""
    if arch == "gemma":
        return
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if getattr(c, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3":
        rope = c.rope_parameters
        w.add_float32(f"{arch}.rope.freq_base_swa", float(rope["sliding_attention"]["rope_theta"]))
        full = rope["full_attention"]
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(full["factor"]))


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (convert_hf_to_gguf.py's `permute`), written independently
    of jaxkv's inverse."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _random_k_blocks(rows: int, cols: int, kind, seed: int) -> np.ndarray:
    size, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    for off in _K_SCALES[kind]:
        raw[..., off:off + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    unit = gguf.quants.dequantize(raw.reshape(rows, -1), kind)
    scale = np.float16(0.05 / max(float(unit.std()), 1e-6))
    for off in _K_SCALES[kind]:
        raw[..., off:off + 2] = np.frombuffer(scale.tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def _encode(array: np.ndarray, kind, seed: int):
    """(data, raw_dtype) for GGUFWriter.add_tensor, or None to keep the tensor F32."""
    if kind == Q.F32 or array.ndim not in (2, 3):  # 3-D: a mixture's stacked experts
        return None
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if array.shape[-1] % block:
        return None
    if kind in _K_SCALES:
        if array.ndim == 3:
            return None
        return _random_k_blocks(*array.shape, kind, seed), kind
    return gguf.quants.quantize(array.astype(np.float32), kind), kind


def write_gguf(hf_model, path: str | Path, *, tensor_type="F32", tokenizer=None,
               chat_template: str | None = None, architecture: str | None = None,
               extra_tensors: dict | None = None) -> Path:
    """Writes ``hf_model`` (a transformers causal LM) as one GGUF file at ``path``.

    ``tensor_type``: one type name for every weight, or a list of names given in turn to the
    weights that can take them. ``extra_tensors`` ({gguf name: (data, type)}) adds tensors or
    replaces the model's own, written as given."""
    path = Path(path)
    c = hf_model.config
    arch = architecture or _ARCH.get(c.model_type, c.model_type)
    gemma = arch in ("gemma", "gemma2", "gemma3")
    kinds = [Q[t] for t in ([tensor_type] if isinstance(tensor_type, str) else tensor_type)]
    kind = kinds[0]
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    if gemma:
        _gemma_metadata(w, c, arch)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(1 if kind == Q.F16 else 0)
    if getattr(c, "sliding_window", None) and arch == "mistral":
        w.add_sliding_window(c.sliding_window)
    if "moe" in c.model_type or c.model_type == "mixtral":
        _moe_metadata(w, c, arch)
    extra = dict(extra_tensors or {})
    if arch == "phi3":
        extra.update({k: (v, Q.F32) for k, v in _phi3_metadata(w, c).items()})
    extra_tensors = extra
    if tokenizer is not None:
        _add_tokenizer(w, tokenizer, chat_template)
    permute = arch in ("llama", "mistral")
    seed = 0
    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            moe = _moe_tensors(rest, array)
            if moe is not None:  # the router and the stacked experts
                for part, data in moe:
                    encoded = _encode(data, kinds[seed % len(kinds)], seed)
                    seed += encoded is not None
                    _add(w, f"blk.{layer}.{part}", data, encoded)
                continue
            sandwich = arch in ("gemma2", "gemma3") and rest in _SANDWICH
            names = {**_LAYER, **_PHI3} if arch == "phi3" else _LAYER
            gname = f"blk.{layer}.{(_SANDWICH if sandwich else names)[rest]}"
            if permute and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                array = llama_cpp_permute(array, heads if "q_proj" in rest else kv_heads)
        if gemma and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp stores Gemma's (1 + w) norms shifted
        if gname in (extra_tensors or {}):
            continue
        encoded = _encode(array, kinds[seed % len(kinds)], seed)
        seed += encoded is not None
        _add(w, gname, array, encoded)
    for gname, (data, raw) in (extra_tensors or {}).items():
        w.add_tensor(gname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w, gname: str, array: np.ndarray, encoded) -> None:
    if encoded is None:
        w.add_tensor(gname, np.ascontiguousarray(array, np.float32))
    else:
        data, raw = encoded
        w.add_tensor(gname, data) if raw == Q.F16 else w.add_tensor(gname, data, raw_dtype=raw)


def _add_tokenizer(w, tokenizer_dir: Path, chat_template: str | None) -> None:
    """A byte-level BPE tokenizer (an HF tokenizer.json folder) as llama.cpp's "gpt2" model."""
    spec = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    ids = {token: i for i, token in enumerate(tokens)}
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("unk_token", w.add_unk_token_id), ("pad_token", w.add_pad_token_id)):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token in ids:
            add(ids[token])
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
