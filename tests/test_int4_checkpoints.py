"""AWQ and GPTQ int4 checkpoints load and stay quantized. The checkpoints are written here by
the test's own packers, from the formats as AutoAWQ (``WQLinear_GEMM.from_linear``) and
GPTQModel (``pack_block``, v2 -> v1 zeros) write them, never by jaxkv's code: random integers
q (0..15), zeros z and fp16 scales s give the float weight ``(q - z) * s``, which is also put
into a transformers model, the oracle for logits and greedy tokens."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from hf_models import build_hf_model, dense_logits, hf_logits
from quant_oracle import numpy_dequantize, weight_only
from safetensors.numpy import save_file

import jaxkv
from jaxkv import LLM, SamplingParams
from jaxkv.errors import CheckpointError
from jaxkv.model.quant import QuantizedWeight, QuantScheme

IDS = list(range(3, 60))
LOGIT_ATOL = 1e-4  # fp32 on both sides from the same float weights: only summation order differs
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: nibble k holds column 8c + order[k]
LINEAR = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
          "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
          "w_down": "mlp.down_proj"}


def pack_words(values: np.ndarray, order=range(8)) -> np.ndarray:
    """i32[..., n/8] words of 4-bit ``values[..., n]``, packed along the last axis: bits 4k..4k+3
    of word c hold ``values[..., 8c + order[k]]`` (as AutoAWQ's and GPTQModel's loops do)."""
    v = values.astype(np.uint64).reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], np.uint64)
    for k in range(8):
        words |= v[..., order[k]] << np.uint64(4 * k)
    return words.astype(np.uint32).view(np.int32)


def random_layer(rng, inputs, outputs, group, sym):
    """q i64[I, O], z i64[G, O], s f16[G, O] and the float weight f32[I, O] = (q - z) * s."""
    q = rng.integers(0, 16, (inputs, outputs))
    groups = inputs // group
    z = np.full((groups, outputs), 8) if sym else rng.integers(0, 16, (groups, outputs))
    s = rng.uniform(0.005, 0.03, (groups, outputs)).astype(np.float16)
    w = (q - np.repeat(z, group, axis=0)) * np.repeat(s.astype(np.float32), group, axis=0)
    return q, z, s, w.astype(np.float32)


def quantized_tensors(method, q, z, s, group, *, v1=True, act_order=False):
    """The stored tensors of one layer (names after the layer's prefix)."""
    if method == "awq":  # qweight [I, O/8] and qzeros [G, O/8], columns interleaved
        return {"qweight": pack_words(q, AWQ_ORDER), "qzeros": pack_words(z, AWQ_ORDER),
                "scales": s}
    words = pack_words(z).view(np.uint32).astype(np.int64)
    if v1:  # GPTQModel subtracts 0x11111111 from each int32 word: a zero of 0 borrows
        words = (words - 0x11111111) % 2**32
    g_idx = np.arange(q.shape[0]) // group
    if act_order:
        g_idx = np.random.default_rng(1).permutation(g_idx)
    return {"qweight": np.ascontiguousarray(pack_words(q.T).T),  # [I/8, O], packed along I
            "qzeros": words.astype(np.uint32).view(np.int32), "scales": s,
            "g_idx": g_idx.astype(np.int32)}


def write_checkpoint(hf, folder, method, group, *, sym=False, seed=0, quant=None, **pack):
    """Writes ``hf`` as an AWQ/GPTQ folder of random int4 layers, puts each layer's float
    weight into ``hf`` (the oracle) and returns {HF prefix: f32[in, out] weight}."""
    rng = np.random.default_rng(seed)
    tensors, weights = {}, {}
    tied = hf.config.tie_word_embeddings
    for key, value in hf.state_dict().items():
        prefix = key.removesuffix(".weight")
        param = hf.get_parameter(key) if not (tied and key == "lm_head.weight") else None
        if key.endswith("_proj.weight"):
            out, inputs = value.shape
            g = inputs if group == -1 else group
            q, z, s, w = random_layer(rng, inputs, out, g, sym)
            assert sym or (z == 0).any()  # a zero of 0 (the v1 borrow) is in every layer
            weights[prefix] = w
            tensors.update({f"{prefix}.{k}": v for k, v in
                            quantized_tensors(method, q, z, s, g, **pack).items()})
            stored = torch.from_numpy(w.T.copy())
        elif param is None:
            continue
        else:  # floats (norms, embedding, biases) stored as fp16, as quantizers save them
            tensors[key] = value.numpy().astype(np.float16)
            stored = torch.from_numpy(tensors[key].astype(np.float32))
        with torch.no_grad():
            hf.get_parameter(key).copy_(stored)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["torch_dtype"] = config["dtype"] = "float16"
    if method == "awq":
        qc = dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm",
                  modules_to_not_convert=None)
    else:
        qc = dict(quant_method="gptq", bits=4, group_size=group, desc_act=False, sym=sym,
                  checkpoint_format="gptq" if pack.get("v1", True) else "gptq_v2",
                  pack_dtype="int32", lm_head=False)
    config["quantization_config"] = {**qc, **(quant or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return weights


CASES = {  # name -> (HF spec, method, group, writer options, scan_layers)
    "awq-g32": ("llama_gqa", "awq", 32, {}, False),
    "gptq-v1-asym-g32-bias-tied": ("qwen2", "gptq", 32, {}, True),
    "gptq-v2-sym-per-channel": ("llama_gqa", "gptq", -1, dict(sym=True, v1=False), False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers oracle, folder, float weights), written once."""
    made = {}

    def get(name):
        if name not in made:
            spec, method, group, options, _ = CASES[name]
            hf = build_hf_model(spec)
            folder = tmp_path_factory.mktemp(name)
            made[name] = hf, folder, write_checkpoint(hf, folder, method, group, **options)
        return made[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_weights_and_logits_equal_the_dequantized_float_model(checkpoints, name):
    hf, folder, weights = checkpoints(name)
    group = CASES[name][2]
    model = weight_only(jaxkv.load_pretrained(folder, scan_layers=CASES[name][4]))
    assert model.quantization == QuantScheme(4, None if group == -1 else group, embedding=False)
    module = model.module()
    for layer in range(model.config.num_layers):
        for name_, hf_name in LINEAR.items():
            w = module.layers.param(name_, layer).get_value()
            if module.layers.scan:  # stacked [L, ...] leaves
                w = jax.tree.map(lambda x, i=layer: x[i], w)
            want = weights[f"model.layers.{layer}.{hf_name}"]
            assert isinstance(w, QuantizedWeight) and w.bits == 4 and w.q.dtype == np.uint8
            assert w.q.shape == (want.shape[0] // 2, want.shape[1])
            # (q - z) * s with an fp16 s is exact in float32, and so is q * s + (-z * s)
            np.testing.assert_allclose(numpy_dequantize(w), want, atol=0, rtol=0,
                                       err_msg=f"{name_} layer {layer}")
    np.testing.assert_allclose(dense_logits(model, IDS), hf_logits(hf, IDS), atol=LOGIT_ATOL,
                               rtol=0)


def _hf_greedy(hf, ids, n):
    """n greedy tokens of transformers' float model (eos off)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["awq-g32", "gptq-v1-asym-g32-bias-tied"])
def test_llm_greedy_tokens_equal_transformers_on_the_float_weights(checkpoints, name):
    hf, folder, _ = checkpoints(name)
    llm = LLM(weight_only(jaxkv.load_pretrained(folder)), page_size=8, num_pages=64,
              max_num_seqs=4, max_model_len=128, warmup=False)
    assert llm.model.quantization == QuantScheme(4, 32, embedding=False)
    prompts = [IDS[:9], IDS[5:22]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    want = [_hf_greedy(hf, p, 16) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert len(set(want[0] + want[1])) > 4  # not one token repeated (random models loop)


def test_quantization_argument_keeps_or_refuses_the_checkpoint_scheme(checkpoints):
    _, folder, _ = checkpoints("awq-g32")
    for spec in ("int4", "int4-g32"):  # explicit int4: the checkpoint's blocks, embedding int8
        model = jaxkv.load_pretrained(folder, quantization=spec, scan_layers=False)
        assert model.quantization == QuantScheme(4, 32)
        assert isinstance(model.module().embed.get_value(), QuantizedWeight)
    for spec in ("int8", "int4-g64", "int4-g128"):
        with pytest.raises(ValueError, match=r"quantization='int[48]"):
            jaxkv.load_pretrained(folder, quantization=spec)


def _variant(folder, tmp_path, name, quant=None, tensors=None):
    """A copy of ``folder`` with quantization_config fields and tensors replaced."""
    out = tmp_path / name
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].update(quant or {})
    (out / "config.json").write_text(json.dumps(config))
    if tensors:
        from safetensors.numpy import load_file

        stored = load_file(str(out / "model.safetensors"))
        save_file({**stored, **tensors}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("method,quant,field", [
    ("awq", dict(bits=3), "bits"),
    ("gptq", dict(bits=8), "bits"),
    ("awq", dict(quant_method="bitsandbytes"), "quant_method"),
    ("awq", dict(version="gemv"), "version"),
    ("awq", dict(zero_point=False), "zero_point"),
    ("gptq", dict(checkpoint_format="marlin"), "checkpoint_format"),
    ("gptq", dict(group_size=48), "group_size"),
    ("gptq", dict(lm_head=True), "lm_head"),
    ("gptq", dict(pack_dtype="int16"), "pack_dtype"),
])
def test_unsupported_configs_are_refused_by_field(checkpoints, tmp_path, method, quant, field):
    name = "awq-g32" if method == "awq" else "gptq-v1-asym-g32-bias-tied"
    bad = _variant(checkpoints(name)[1], tmp_path, "bad", quant)
    with pytest.raises(CheckpointError, match=rf"quantization_config\.{field}="):
        jaxkv.load_pretrained(bad)


def test_act_order_and_wrong_shapes_are_refused_by_name(checkpoints, tmp_path):
    hf = build_hf_model("llama_gqa")
    act = write_checkpoint(hf, tmp_path / "act", "gptq", 32, quant=dict(desc_act=True),
                           act_order=True)
    assert act
    with pytest.raises(CheckpointError, match=r"g_idx is not i // group_size: desc_act"):
        jaxkv.load_pretrained(tmp_path / "act")
    folder = checkpoints("gptq-v1-asym-g32-bias-tied")[1]
    wider = _variant(folder, tmp_path, "g64", dict(group_size=64))  # scales hold 32-groups
    with pytest.raises(CheckpointError, match=r"_proj\.scales: expected .* group_size 64"):
        jaxkv.load_pretrained(wider)
    prefix = "model.layers.1.mlp.up_proj"
    zeros = np.zeros((2, 128 // 8 + 1), np.int32)
    with pytest.raises(CheckpointError, match=rf"{prefix}\.qzeros: expected \(2, 16\)"):
        jaxkv.load_pretrained(_variant(folder, tmp_path, "z", tensors={f"{prefix}.qzeros":
                                                                      zeros}))
    # a qweight of the wrong size is a wrong-shaped weight, named by load_tensors
    prefix = "model.layers.0.self_attn.o_proj"
    short = dict(qweight=np.zeros((4, 64), np.int32), g_idx=np.zeros(32, np.int32),  # 32 inputs
                 scales=np.ones((1, 64), np.float16), qzeros=np.zeros((1, 8), np.int32))
    with pytest.raises(CheckpointError, match=rf"wrong shape: {prefix}\.weight"):
        jaxkv.load_pretrained(_variant(folder, tmp_path, "w", tensors={
            f"{prefix}.{k}": v for k, v in short.items()}))
