"""GGUF checkpoints (the files llama.cpp and Ollama hold models in), read without torch.

A GGUF file carries everything a checkpoint folder does: hyperparameters in its metadata
(``{arch}.block_count``, ``{arch}.attention.head_count``, ...), the tokenizer and chat template
(``tokenizer.ggml.*``, ``tokenizer.chat_template``) and the tensors, often block-quantized.
Here the metadata becomes a `ModelConfig`, each tensor is dequantized to float32 with the
``gguf`` package and renamed to its Hugging Face name, so `loading.load_tensors` checks and
places it exactly as it does a safetensors checkpoint.

llama.cpp's converter permutes the q and k projections of Llama, Mistral and Mixtral models (its
RoPE rotates interleaved pairs, HF's rotates halves); `_unpermute` undoes that, as transformers'
own GGUF loader does. Qwen2/3, Qwen3-MoE, Gemma and Phi-3 tensors are stored unpermuted.
Mixtral is a "llama" file with ``expert_count``; a mixture's experts come stacked in one
[X, out, in] tensor per matrix (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``) and load
expert by expert. Phi-3 keeps its fused qkv and gate_up projections (``attn_qkv``, ``ffn_up``)
and LongRoPE's factors as tensors.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from jaxkv.errors import CheckpointError, UnsupportedModelError
from jaxkv.model.config import ModelConfig, RopeScaling
from jaxkv.model.gguf_file import GGUFFile, NotPlainGGUF

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
                 "qwen3moe")  # (Mixtral is "llama" with experts)
_GEMMA = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}  # -> model_type
# Gemma 2/3: llama.cpp's names of the four norms of a block (HF's names differ from Llama's)
_SANDWICH_TENSORS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                     "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Tensor types dequantized here (gguf.quants implements each of them in numpy).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                   "Q3_K", "Q4_K", "Q5_K", "Q6_K")
MAGIC = b"GGUF"
ROWS_AT_ONCE = 1 << 22  # elements of a tensor dequantized at once (16 MB of float32)

_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Phi-3's fused projections, split on load like its HF checkpoint's (`loading.unfused`)
_PHI3_TENSORS = {"attn_qkv.weight": "self_attn.qkv_proj.weight",
                 "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Mixtures of experts: the router, and each expert's matrix in one [X, out, in] tensor
_MOE_ROUTER = {"mixtral": "block_sparse_moe.gate.weight", "qwen3_moe": "mlp.gate.weight"}
_MOE_EXPERTS = {"mixtral": {"ffn_gate_exps.weight": "block_sparse_moe.experts.{j}.w1.weight",
                            "ffn_up_exps.weight": "block_sparse_moe.experts.{j}.w3.weight",
                            "ffn_down_exps.weight": "block_sparse_moe.experts.{j}.w2.weight"},
                "qwen3_moe": {"ffn_gate_exps.weight": "mlp.experts.{j}.gate_proj.weight",
                              "ffn_up_exps.weight": "mlp.experts.{j}.up_proj.weight",
                              "ffn_down_exps.weight": "mlp.experts.{j}.down_proj.weight"}}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# Llama 3.x files store their RoPE scaling only as per-frequency divisors (`rope_freqs.weight`).
# They are matched against Llama 3's rule with its published frequency factors (low 1, high 4)
# over a grid of factors and original contexts (Llama 3.1: factor 8, 3.2: factor 32, both at
# an original context of 8192).
_LLAMA3_SCALINGS = tuple(RopeScaling("llama3", float(f), 1.0, 4.0, 2 ** n)
                         for n in range(16, 5, -1) for f in (8, 32, 16, 4, 2, 64))


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def find_gguf(folder: Path) -> Path | None:
    """The one .gguf file in ``folder``, None if there is none; several are ambiguous."""
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(
            f"folder {str(folder)!r} holds {len(files)} GGUF files "
            f"({', '.join(f.name for f in files)}); pass the path of one")
    return files[0] if files else None


class GGUFCheckpoint:
    """One open GGUF file: its config, its tensors under HF names, its tokenizer."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            try:
                read = GGUFFile(self.path)
                self.fields, self.tensors = read.fields, read.tensors
            except NotPlainGGUF:  # (big-endian, another version): gguf's own reader
                from gguf import GGUFReader

                reader = GGUFReader(str(self.path))
                self.fields = {k: f.contents() for k, f in reader.fields.items()}
                self.tensors = {t.name: t for t in reader.tensors}
        except (ValueError, OSError, struct.error, UnicodeDecodeError) as e:
            raise CheckpointError(f"{str(self.path)!r} is not a readable GGUF file: {e}") from e
        self.config = self._config()

    def field(self, key: str, default=None):
        value = self.fields.get(key)
        return default if value is None else value

    def _config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF {str(self.path)!r}: general.architecture {arch!r} is not supported; "
                f"jaxkv implements {ARCHITECTURES}")

        def need(key):
            value = self.field(f"{arch}.{key}")
            if value is None:
                raise CheckpointError(f"GGUF {str(self.path)!r}: metadata {arch}.{key} missing")
            return value

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        head_dim = int(self.field(f"{arch}.attention.key_length", hidden // heads))
        rotary = int(self.field(f"{arch}.rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise UnsupportedModelError(
                f"GGUF {str(self.path)!r}: {arch}.rope.dimension_count {rotary} != head_dim "
                f"{head_dim} (partial rotary embeddings are not supported)")
        tokens = self.field("tokenizer.ggml.tokens")
        vocab = int(self.field(f"{arch}.vocab_size", len(tokens) if tokens else 0))
        theta = float(self.field(f"{arch}.rope.freq_base", 10000.0))
        eos = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        window = self.field(f"{arch}.attention.sliding_window")
        experts = int(self.field(f"{arch}.expert_count", 0) or 0)
        model_type = {"qwen3moe": "qwen3_moe"}.get(arch, "mixtral" if experts else arch)
        config = ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=theta,
            max_position_embeddings=int(self.field(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            **{"sliding_window": int(window) if window and arch in ("mistral", "phi3")
               else None,
               "model_type": model_type,
               **(self._gemma(arch, heads, hidden, head_dim) if arch in _GEMMA else {}),
               **(self._experts(arch, experts) if experts else {})},
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        )
        return dataclasses.replace(config, rope_scaling=self._rope_scaling(arch, config))

    def _gemma(self, arch: str, heads: int, hidden: int, head_dim: int) -> dict:
        """Gemma's options, as llama.cpp reads them: softcaps and the window from metadata;
        the local/global pattern from ``attention.sliding_window_pattern`` (a period, or a
        flag per layer) or else llama.cpp's default (Gemma 2: every other layer, Gemma 3: 5
        local : 1 global); the local RoPE base from ``rope.freq_base_swa`` or 10,000; the query
        scale 1/sqrt(head_dim), except for the 27B models (46 and 62 layers), where llama.cpp
        uses hidden / heads as their configs' query_pre_attn_scalar does."""
        out = dict(model_type=_GEMMA[arch], hidden_act="gelu_tanh", gemma_norm=True,
                   scale_embeddings=True)
        if arch == "gemma":
            return out
        layers = int(self.field(f"{arch}.block_count"))
        pattern = self.field(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, (list, tuple)):
            sliding = [bool(p) for p in pattern]
        else:
            period = int(pattern or (2 if arch == "gemma2" else 6))
            sliding = [bool((i + 1) % period) for i in range(layers)]
        big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
        window = self.field(f"{arch}.attention.sliding_window")
        out.update(sandwich_norm=True,
                   layer_types=tuple("sliding_attention" if s else "full_attention"
                                     for s in sliding),
                   sliding_window=int(window) if window else None,
                   query_pre_attn_scalar=float(hidden // heads if big else head_dim),
                   attn_softcap=self.field(f"{arch}.attn_logit_softcapping"),
                   final_softcap=self.field(f"{arch}.final_logit_softcapping"))
        if arch == "gemma3":
            out["local_rope_theta"] = float(self.field(f"{arch}.rope.freq_base_swa", 10000.0))
        return out

    def _experts(self, arch: str, experts: int) -> dict:
        """A mixture of experts as llama.cpp's converter writes it: ``expert_count``,
        ``expert_used_count``, the experts' width (``expert_feed_forward_length``, Mixtral's
        ``feed_forward_length``), the top-k weights renormalized (llama.cpp does for both
        Mixtral and Qwen3-MoE, and records it in ``expert_weights_norm`` when it writes it),
        and the blocks without expert tensors as dense layers."""
        layers = int(self.field(f"{arch}.block_count"))
        width = self.field(f"{arch}.expert_feed_forward_length") or \
            self.field(f"{arch}.feed_forward_length")
        norm = self.field(f"{arch}.expert_weights_norm")
        return dict(num_experts=experts,
                    num_experts_per_tok=int(self.field(f"{arch}.expert_used_count")),
                    moe_intermediate_size=int(width),
                    norm_topk_prob=True if norm is None else bool(norm),
                    dense_layers=tuple(i for i in range(layers)
                                       if f"blk.{i}.ffn_gate_exps.weight" not in self.tensors))

    def _rope_scaling(self, arch: str, config: ModelConfig) -> RopeScaling | None:
        if "rope_factors_long.weight" in self.tensors:  # Phi-3's LongRoPE
            return self._longrope(arch, config)
        kind = self.field(f"{arch}.rope.scaling.type")
        if kind == "linear":
            return RopeScaling("linear", float(self.field(f"{arch}.rope.scaling.factor")))
        if kind not in (None, "none"):
            raise UnsupportedModelError(
                f"GGUF {str(self.path)!r}: {arch}.rope.scaling.type {kind!r} is not supported")
        if "rope_freqs.weight" not in self.tensors:
            return None
        from jaxkv.model.rope import inverse_frequencies

        divisors = self._array("rope_freqs.weight")
        plain = inverse_frequencies(config)
        for scaling in _LLAMA3_SCALINGS:
            scaled = inverse_frequencies(dataclasses.replace(config, rope_scaling=scaling))
            if np.allclose(plain / scaled, divisors, rtol=1e-4, atol=0):
                return scaling
        raise UnsupportedModelError(
            f"GGUF {str(self.path)!r}: tensor rope_freqs.weight matches no Llama-3 RoPE scaling "
            "(factors 2-64, low/high frequency factors 1/4, original context 64-65536)")

    def _longrope(self, arch: str, config: ModelConfig) -> RopeScaling:
        """Phi-3's LongRoPE: the short and long factors as tensors, the original context and
        the attention factor as metadata (llama.cpp's converter derives that factor from the
        extension, as HF does when a config names none)."""
        import math

        original = int(self.field(f"{arch}.rope.scaling.original_context_length"))
        factor = config.max_position_embeddings / original
        attention = self.field(f"{arch}.rope.scaling.attn_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 \
                else 1.0
        return RopeScaling("longrope", float(factor), original_max_position_embeddings=original,
                           short_factor=tuple(map(float, self._array("rope_factors_short.weight"))),
                           long_factor=tuple(map(float, self._array("rope_factors_long.weight"))),
                           attention_factor=float(attention))

    def _expert(self, name: str, j: int) -> np.ndarray:
        """Expert ``j``'s matrix of a stacked [X, out, in] tensor, dequantized alone."""
        from gguf import quants

        t = self._supported(name)
        shape = tuple(int(n) for n in reversed(t.shape))[1:]
        return np.asarray(quants.dequantize(t.data[j], t.tensor_type), np.float32).reshape(shape)

    def _kept(self, name: str, heads: int | None):
        """A linear weight as a `QuantizedWeight` ([in, out]): its blocks repacked when jaxkv
        keeps their format, else the nearest kept layout (see `gguf_blocks`)."""
        from jaxkv.model import gguf_blocks

        t = self.tensors[name]
        kind = t.tensor_type.name
        shape = tuple(int(n) for n in reversed(t.shape))
        if kind not in gguf_blocks.KEPT:
            if heads is None:  # a block of rows at a time: never the whole tensor in float
                return gguf_blocks.nearest_weight_by_rows(self._rows(name), shape, kind)
            # attention q/k (at most hidden x hidden): their rows permuted whole
            return gguf_blocks.nearest_weight(_unpermute(self._array(name), heads), kind)
        blocks = gguf_blocks.blocks_of(t.data, kind, shape)
        if heads is not None:  # the permutation moves whole rows: blocks move with them
            blocks = _unpermute(blocks, heads)
        return gguf_blocks.kept_weight(blocks, kind, shape)

    def _array(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, in numpy's (row-major, HF) axis order."""
        from gguf import quants

        t = self._supported(name)
        shape = tuple(int(n) for n in reversed(t.shape))
        data = t.data
        if data.ndim != 2 or data.shape[0] * shape[-1] <= ROWS_AT_ONCE:
            return np.asarray(quants.dequantize(data, t.tensor_type), np.float32).reshape(shape)
        out = np.empty(shape, np.float32)  # a block of rows at a time: small temporaries
        rows = out.reshape(-1, shape[-1])
        for r, part in self._rows(name):
            rows[r:r + len(part)] = part
        return out

    def _supported(self, name: str):
        t = self.tensors[name]
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"GGUF {str(self.path)!r}: tensor {name!r} has type {t.tensor_type.name}, which "
                f"jaxkv does not dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
        return t

    def _rows(self, name: str):
        """(first row, f32 rows [n, in]) of a 2-D tensor dequantized a block of
        `ROWS_AT_ONCE` elements at a time."""
        from gguf import quants

        t = self._supported(name)
        width = int(t.shape[0])  # GGUF lists the innermost dimension first
        data = t.data
        if data.ndim != 2 or len(t.shape) != 2:
            raise ValueError(f"GGUF tensor {name!r}: rows of a 2-D tensor only, got {t.shape}")
        step = max(1, ROWS_AT_ONCE // width)
        for r in range(0, data.shape[0], step):
            part = quants.dequantize(data[r:r + step], t.tensor_type)
            yield r, np.asarray(part, np.float32).reshape(-1, width)

    def hf_tensors(self, keep_blocks: bool = False
                   ) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
        """(HF tensor name, loader) for every tensor; unknown names keep their GGUF name, so
        the checkpoint check reports them as unexpected. ``keep_blocks``: the linear weights
        (and a quantized embedding / LM head) come as `QuantizedWeight`s in jaxkv's layout
        (`gguf_blocks`), not float."""
        c = self.config
        permuted = c.model_type in ("llama", "mistral", "mixtral")
        for name in self.tensors:
            if name in ("rope_freqs.weight", "rope_factors_long.weight",
                        "rope_factors_short.weight"):
                continue  # read into the config's rope_scaling
            if name in _GLOBAL_TENSORS:
                # The embedding and LM head keep their blocks too (a table [V, E] is a linear
                # of V outputs: [E, V] in jaxkv's layout); float ones are quantized on load.
                quantized = self.tensors[name].tensor_type.name not in ("F32", "F16", "BF16")
                if keep_blocks and quantized and name != "output_norm.weight":
                    yield _GLOBAL_TENSORS[name], lambda name=name: self._kept(name, None)
                elif c.gemma_norm and name == "output_norm.weight":  # stored as 1 + w
                    yield _GLOBAL_TENSORS[name], lambda name=name: self._array(name) - np.float32(1)
                else:
                    yield _GLOBAL_TENSORS[name], lambda name=name: self._array(name)
                continue
            m = _BLOCK.fullmatch(name)
            if m is not None and c.num_experts and m.group(2) in _MOE_EXPERTS[c.model_type]:
                # per expert, each dequantized alone (MoE weights load as float)
                layer, part = m.group(1), _MOE_EXPERTS[c.model_type][m.group(2)]
                for j in range(c.num_experts):
                    yield (f"model.layers.{layer}.{part.format(j=j)}",
                           lambda name=name, j=j: self._expert(name, j))
                continue
            names = {**_LAYER_TENSORS, **_SANDWICH_TENSORS} if c.sandwich_norm else \
                _LAYER_TENSORS
            if c.model_type == "phi3":
                names = {**names, **_PHI3_TENSORS}
            if c.num_experts:
                names = {**names, "ffn_gate_inp.weight": _MOE_ROUTER[c.model_type]}
            if m is None or m.group(2) not in names:
                yield name, lambda name=name: self._array(name)
                continue
            key = f"model.layers.{m.group(1)}.{names[m.group(2)]}"
            if c.gemma_norm and name.endswith("norm.weight"):  # llama.cpp stores 1 + w
                yield key, lambda name=name: self._array(name) - np.float32(1)
                continue
            heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(
                m.group(2).split(".")[0]) if permuted else None
            fused = m.group(2) in _PHI3_TENSORS and c.model_type == "phi3"
            if keep_blocks and key.endswith("_proj.weight") and not fused:
                yield key, lambda name=name, heads=heads: self._kept(name, heads)
            elif heads is None:
                yield key, lambda name=name: self._array(name)
            else:
                yield key, lambda name=name, heads=heads: _unpermute(self._array(name), heads)

    def tokenizer(self):
        """The fast tokenizer this file's metadata describes (vocabulary, merges, special
        tokens, chat template), or None if it has none. Built by transformers' own GGUF
        tokenizer converters from metadata read here, so torch is never imported; the result
        encodes like ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``."""
        if self.field("tokenizer.ggml.tokens") is None:
            return None
        try:
            from transformers import PreTrainedTokenizerFast
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:  # another transformers layout: let it read the file itself
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(self.path.parent),
                                                 gguf_file=self.path.name)
        groups = {group: {name: self.field(f"tokenizer.{key}")
                          for key, name in renames.items()
                          if self.field(f"tokenizer.{key}") is not None}
                  for group, renames in GGUF_TOKENIZER_MAPPING.items()}
        spec, init = groups["tokenizer"], groups["tokenizer_config"]
        if spec.get("tokenizer_type") == "llama":  # llama.cpp's default for sentencepiece
            init.setdefault("add_bos_token", True)
        for name in ("bos", "eos", "unk", "pad"):
            key = "unknown" if name == "unk" else "padding" if name == "pad" else name
            token_id = self.field(f"tokenizer.ggml.{key}_token_id")
            init[f"{name}_token"] = spec["tokens"][token_id] if token_id is not None else None
        backend, extra = convert_gguf_tokenizer(self.field("general.architecture"), spec)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **init, **extra)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
