"""jaxkv against Hugging Face transformers' PyTorch models on the same (random) weights.

Every supported family (Llama MHA/GQA/MQA, Llama-3 rope scaling, Qwen2 qkv bias + tied
embeddings, Qwen3 q/k norm, Mistral with and without a sliding window, Gemma 1/2/3 with their
norms, soft caps and local/global layers, Mixtral and Qwen3-MoE with their routing) is built
tiny in
`transformers`, saved as safetensors, loaded with `jaxkv.load_pretrained`, and compared on
logits at every prompt position (dense attention), last-token logits of the batched paged
prefill, and 64 greedy tokens against HF `generate`. Loading errors must name what is wrong.

Speed: compiles dominate on CPU, so the paged-prefill check builds its state and batch with the
shapes `jaxkv.generate` uses for the same prompts, and the greedy run reuses that program.
HF models run single-threaded (see hf_models.py).
"""

import copy
import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from hf_models import PHI3_ROPE, SPECS, build_hf_model, dense_logits, hf_logits, save_hf_model
from safetensors.numpy import load_file, save_file

import jaxkv
from jaxkv.cache.allocator import PageAllocator
from jaxkv.model import UnsupportedModelError
from jaxkv.model.config import ModelConfig
from jaxkv.model.loading import CheckpointError, save_params
from jaxkv.runtime.batch import PageTable, Row, build_batch, pow2
from jaxkv.runtime.sampling import SamplingArrays
from jaxkv.runtime.steps import make_steps

ATOL = 1e-4  # fp32 end to end; observed differences are ~3e-6, greedy top-2 gaps >= 1.7e-4
NEW_TOKENS = 64
PAGE_SIZE = 16


def _ids(n, seed):
    return np.random.default_rng(seed).integers(3, 256, size=n).tolist()


LONG = _ids(130, seed=1)  # past the llama3 case's original context (64) and the window (16)
# For paged prefill and greedy generation. 128 + 64 tokens keep every decode step's page-table
# width in one bucket (9..12 pages of 16), so each model compiles a single decode program.
PROMPTS = [_ids(128, seed=3), _ids(23, seed=4)]
GREEDY_CASES = ("llama3_rope", "qwen2", "qwen3", "mistral_swa", "gemma2", "gemma3", "mixtral",
                "qwen3_moe", "phi3")
GREEDY = jaxkv.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


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


def paged_prefill_logits(model, prompts, *, split=None, page_size=PAGE_SIZE,
                         reserve=NEW_TOKENS) -> list[np.ndarray]:
    """Last-token logits f32[len(prompts), V] after each batched paged prefill step.

    One step over whole prompts, or with ``split`` two steps: ``p[:s]`` then ``p[s:]``, the
    second attending to the K/V the first wrote into the pages. Pages are reserved for
    ``reserve`` more tokens per prompt, as `jaxkv.generate` does, so shapes (and the compiled
    program) match it.
    """
    cfg = model.config
    need = [-(-(len(p) + reserve) // page_size) for p in prompts]
    allocator = PageAllocator(sum(need))
    pages = [allocator.allocate(n) for n in need]
    state = jaxkv.init_state(cfg, allocator.num_pages, page_size, model.dtype)
    table = PageTable(len(prompts), max(need), allocator.num_pages, page_size)
    steps = make_steps(model.graphdef, "auto")  # the cache key `jaxkv.generate` uses
    bounds = [[(0, len(p))] for p in prompts] if split is None else [
        [(0, s), (s, len(p))] for p, s in zip(prompts, split, strict=True)]
    out = []
    for step in range(len(bounds[0])):
        rows = [Row(slot, p[b[step][0]:b[step][1]], b[step][0], pg)
                for slot, (p, b, pg) in enumerate(zip(prompts, bounds, pages, strict=True))]
        total = sum(len(r.tokens) for r in rows)
        batch = build_batch(rows, table, tokens_bucket=pow2(max(total, 16)),
                            vocab_size=cfg.vocab_size)
        _, logits, _, state = steps.step(model.params, state, batch,
                                         np.zeros((len(prompts), 2), np.uint32),
                                         SamplingArrays.greedy(len(prompts)))
        out.append(np.asarray(logits)[: len(prompts)])
    return out


def params_of(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(model.params)]


# --- numerics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPECS))
def test_config_matches_hf(checkpoints, name):
    hf, _, model = checkpoints(name)
    c, h = model.config, hf.config
    assert c.model_type == h.model_type
    assert (c.num_heads, c.num_kv_heads) == (h.num_attention_heads, h.num_key_value_heads)
    assert c.head_dim == (getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads)
    assert c.tie_word_embeddings == h.tie_word_embeddings
    assert c.attention_bias == (name == "qwen2")
    assert c.qk_norm == (name in ("qwen3", "gemma3", "qwen3_moe"))
    assert (c.num_experts, c.num_experts_per_tok, c.dense_layers) == {
        "mixtral": (4, 2, ()), "qwen3_moe": (8, 3, (1,))}.get(name, (0, 0, ()))
    assert c.sliding_window == {"mistral_swa": 16, "gemma2": 16, "gemma3": 16,
                                "phi3": 48}.get(name)
    assert (c.rope_scaling is not None) == (name in ("llama3_rope", "gemma3", "phi3"))
    gemma = name.startswith("gemma")
    assert (c.gemma_norm, c.scale_embeddings, c.hidden_act == "gelu_tanh") == (gemma,) * 3
    assert c.sandwich_norm == (name in ("gemma2", "gemma3"))
    types = getattr(h, "layer_types", None) if name in ("gemma2", "gemma3") else None
    windows = [16 if t == "sliding_attention" else None for t in types] if types else \
        [c.sliding_window] * c.num_layers
    assert list(c.windows) == windows
    assert (c.attn_softcap, c.final_softcap) == ((2.0, 3.0) if name == "gemma2" else (None,) * 2)


def test_legacy_rope_scaling_key_reads_the_same(checkpoints, tmp_path):
    # transformers < 5 wrote `rope_scaling` plus a top-level `rope_theta`; both must still load.
    _, folder, model = checkpoints("llama3_rope")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_hf(tmp_path) == model.config


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_every_position(checkpoints, name):
    hf, _, model = checkpoints(name)
    np.testing.assert_allclose(dense_logits(model, LONG), hf_logits(hf, LONG), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(SPECS))
def test_paged_prefill_last_logits(checkpoints, name):
    hf, _, model = checkpoints(name)
    (got,) = paged_prefill_logits(model, PROMPTS)
    for i, p in enumerate(PROMPTS):
        np.testing.assert_allclose(got[i], hf_logits(hf, p)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3", "gemma3", "mixtral"])
def test_scanned_layer_layout_matches_hf(checkpoints, name):
    # The stacked + lax.scan layout (the GPU/TPU default) against the same oracle; on Gemma 3
    # each scanned layer switches to its own window and RoPE by its traced index.
    hf, folder, _ = checkpoints(name)
    scanned = jaxkv.load_pretrained(folder, scan_layers=True)
    assert scanned.module().layers.scan
    (got,) = paged_prefill_logits(scanned, PROMPTS)
    for i, p in enumerate(PROMPTS):
        np.testing.assert_allclose(got[i], hf_logits(hf, p)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["mistral_swa", "gemma2"])
def test_chunked_paged_prefill_with_sliding_window(checkpoints, name):
    # Second chunks start inside a page and attend to cached keys through the 16-token window
    # (Gemma 2: on local layers only, global ones seeing the whole prompt).
    hf, _, model = checkpoints(name)
    split = [57, 9]
    first, second = paged_prefill_logits(model, PROMPTS, split=split, page_size=16)
    for i, (p, s) in enumerate(zip(PROMPTS, split, strict=True)):
        ref = hf_logits(hf, p)
        np.testing.assert_allclose(first[i], ref[s - 1], atol=ATOL, rtol=0)
        np.testing.assert_allclose(second[i], ref[-1], atol=ATOL, rtol=0)


# Each option, switched off on the same weights, must move the logits far beyond ATOL: proof
# that the perturbed weights and the prompt length really exercise that code path.
_SWITCH_OFF = {
    "llama3_rope": dict(rope_scaling=None),
    "qwen2": dict(attention_bias=False),
    "qwen3": dict(qk_norm=False),
    "mistral_swa": dict(sliding_window=None),
    "gemma": dict(gemma_norm=False),
    "gemma2": dict(attn_softcap=None),
    "gemma2-final-cap": dict(final_softcap=None),
    "gemma2-layer-types": dict(layer_types=None),  # the window on every layer
    "gemma2-query-scale": dict(query_pre_attn_scalar=None),
    "gemma3": dict(local_rope_theta=None),
    "gemma3-window": dict(sliding_window=None),
    "gemma3-sandwich": dict(sandwich_norm=False),
    "mixtral": dict(num_experts_per_tok=1),
    "qwen3_moe": dict(norm_topk_prob=True),
    "phi3": dict(sliding_window=None),
    "phi3-longrope": dict(rope_scaling=None),
}


@pytest.mark.parametrize("name", list(_SWITCH_OFF))
def test_cases_exercise_their_option(checkpoints, name):
    hf, _, model = checkpoints(name.split("-")[0])
    off = dataclasses.replace(model.config, **_SWITCH_OFF[name])
    assert np.abs(dense_logits(model, LONG, off) - hf_logits(hf, LONG)).max() > 100 * ATOL


def test_norm_and_bias_weights_are_perturbed(checkpoints):
    # HF initializes norms to 1 and biases to 0; the oracle is only meaningful if they are not.
    qwen3 = checkpoints("qwen3")[2].module()
    assert np.abs(np.asarray(qwen3.final_norm[...]) - 1).min() > 0
    assert np.abs(np.asarray(qwen3.layers.param("k_norm", 0)[...]) - 1).max() > 1e-2
    qwen2 = checkpoints("qwen2")[2].module()
    assert np.abs(np.asarray(qwen2.layers.param("bq", 0)[...])).max() > 1e-2


def _hf_greedy(hf, ids, n):
    """n greedy tokens from HF's own `generate`, with eos disabled and no logits processors."""
    # `generate` fills a None eos from the model's own generation config, so clear it there
    # (min_new_tokens would instead mask eos logits, changing the argmax jaxkv compares).
    saved = hf.generation_config
    hf.generation_config = copy.deepcopy(saved)
    gc = hf.generation_config
    gc.update(eos_token_id=None, pad_token_id=0, do_sample=False, max_new_tokens=n,
              min_new_tokens=None)
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
    got = jaxkv.generate(model, PROMPTS, GREEDY, page_size=PAGE_SIZE)
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert got == want
    assert all(len(set(w)) > 5 for w in want)  # not a degenerate one-token loop


def test_qwen3_moe_sliding_window_applies_to_every_layer(tmp_path):
    # Qwen3-MoE keeps `sliding_window` only with use_sliding_window, and then on every layer.
    hf = build_hf_model("qwen3_moe", use_sliding_window=True, sliding_window=16)
    model = jaxkv.load_pretrained(save_hf_model(hf, tmp_path))
    assert model.config.windows == (16, 16, 16)
    np.testing.assert_allclose(dense_logits(model, LONG), hf_logits(hf, LONG), atol=ATOL, rtol=0)


def test_gemma_activation_is_read_where_transformers_reads_it(tmp_path):
    # Gemma 1's MLP applies `hidden_act` (Gemma 2/3: `hidden_activation`): a config asking for
    # another activation is refused by that field's name, never served as tanh-GELU.
    with pytest.raises(UnsupportedModelError, match="hidden_act 'silu'"):
        ModelConfig.from_hf(_copy_config("gemma", tmp_path, hidden_act="silu"))


def test_bad_longrope_and_dense_layers_are_named():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                num_kv_heads=2, head_dim=16)
    rope = jaxkv.model.config.RopeScaling("longrope", short_factor=(1.0,) * 8,
                                          long_factor=(1.0,) * 7)
    with pytest.raises(ValueError, match="rope_scaling.long_factor has 7 entries"):
        ModelConfig(**base, rope_scaling=rope)
    with pytest.raises(ValueError, match="dense_layers: \\[5\\]"):
        ModelConfig(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    dense_layers=(5,))


def _copy_config(name, tmp_path, **edits):
    """A folder with spec ``name``'s config.json (no weights), ``edits`` applied."""
    config = json.loads(build_hf_model(name).config.to_json_string())
    config.update(edits)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_longrope_past_the_original_context_matches_transformers_cache(tmp_path):
    # Phi-3's LongRoPE switches to the long factors at original_max_position_embeddings (64
    # here). jaxkv rotates each token by the factors of its own position and keeps its KV;
    # transformers' model does the same when stepped with its cache (its `generate` instead
    # drops the cache once, at the crossing, and recomputes the sequence with the long
    # factors). 40 prompt tokens, then 60 greedy ones: every step's logits equal transformers'
    # fed the same tokens one at a time with its cache.
    rope = {**PHI3_ROPE, "original_max_position_embeddings": 64, "partial_rotary_factor": 1.0}
    hf = build_hf_model("phi3", rope_parameters=rope, original_max_position_embeddings=64)
    model = jaxkv.load_pretrained(save_hf_model(hf, tmp_path))
    assert model.config.rope_scaling.original_max_position_embeddings == 64
    prompt = _ids(40, seed=9)
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=0)
    (out,) = jaxkv.LLM(model, max_model_len=256, warmup=False).generate(
        prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        step = hf(torch.tensor([prompt]), use_cache=True)
        for j, token in enumerate(tokens):
            logp = torch.log_softmax(step.logits[0, -1].double(), -1)
            assert int(logp.argmax()) == token, j
            np.testing.assert_allclose(out.outputs[0].logprobs[j][token].logprob,
                                       float(logp[token]), atol=ATOL, rtol=0)
            step = hf(torch.tensor([[token]]), cache=step.past_key_values,
                      use_cache=True)
    assert len(set(tokens[30:])) > 5


@pytest.mark.parametrize("name", ["phi3", "llama3_rope"])
def test_saved_checkpoint_reads_back_in_transformers(checkpoints, tmp_path, name):
    # save_params writes HF's layout (Phi-3's fused projections joined again, its LongRoPE
    # parameters): transformers reads it back to the same model.
    hf, _, model = checkpoints(name)
    save_params(model.module(), tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                              dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(again, LONG), hf_logits(hf, LONG), atol=1e-5, rtol=0)


def test_min_tokens_masks_stop_tokens_as_hf_min_new_tokens(checkpoints):
    """vLLM's min_tokens (and HF's min_new_tokens): a stop token cannot be sampled before
    min_tokens tokens are out, so the reply continues past where greedy would have stopped,
    and it may stop right after them."""
    hf, _, model = checkpoints("qwen2")
    prompt, n, k = PROMPTS[1], 24, 8
    free = _hf_greedy(hf, prompt, n)
    stop = free[2]  # greedy would stop at token 3 (or earlier, at its first occurrence)
    saved = hf.generation_config
    hf.generation_config = copy.deepcopy(saved)
    hf.generation_config.update(eos_token_id=stop, pad_token_id=0, do_sample=False,
                                max_new_tokens=n, min_new_tokens=k)
    try:
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]))[0, len(prompt):].tolist()
    finally:
        hf.generation_config = saved
    if stop in want:
        want = want[:want.index(stop) + 1]  # HF pads after its eos
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=n, min_tokens=k, ignore_eos=True,
                              stop_token_ids=(stop,))
    got = jaxkv.generate(model, [prompt], sp, page_size=PAGE_SIZE)[0]
    assert got == want
    assert stop not in got[:k] and got[:free.index(stop)] == free[:free.index(stop)]
    out = jaxkv.LLM(model, page_size=PAGE_SIZE, warmup=False).generate(prompt_token_ids=[prompt],
                                                         sampling_params=sp, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_torch_log_softmax(checkpoints, temperature):
    """logprobs=k: every generated token's fp32 logprob and rank, and the top k, against
    torch.log_softmax of transformers' logits on the same tokens (vLLM's raw logprobs: before
    temperature), within 1e-4."""
    hf, _, model = checkpoints("qwen2")
    prompt, k = PROMPTS[1], 5
    sp = jaxkv.SamplingParams(temperature=temperature, seed=3, max_tokens=12, ignore_eos=True,
                              logprobs=k)
    engine = jaxkv.Engine(model, page_size=PAGE_SIZE, num_pages=16, max_num_seqs=2,
                          max_model_len=128, max_num_batched_tokens=64)
    engine.add_request("a", prompt_token_ids=prompt, sampling_params=sp)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    c = outs[-1].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 12
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + c.token_ids])).logits[0].double()
    want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].numpy()  # predicts each token
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        row = want[i]
        np.testing.assert_allclose(entry[tok].logprob, row[tok], atol=ATOL, rtol=0)
        assert entry[tok].rank == 1 + int((row > row[tok] + ATOL).sum())
        assert len(entry) in (k, k + 1)  # the top k, and the sampled token if not among them
        top = sorted(entry, key=lambda t: -entry[t].logprob)[:k]
        np.testing.assert_allclose([entry[t].logprob for t in top], np.sort(row)[::-1][:k],
                                   atol=ATOL, rtol=0)
        np.testing.assert_allclose([row[t] for t in top], [entry[t].logprob for t in top],
                                   atol=ATOL, rtol=0)  # each id with its own logprob
        if temperature == 0:
            assert entry[tok].rank == 1
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids, strict=True)), abs=1e-9)
    if temperature:
        assert any(e[t].rank > 1 for e, t in zip(c.logprobs, c.token_ids, strict=True))


def test_prompt_logprobs_match_torch_log_softmax(checkpoints):
    """prompt_logprobs=k over a prompt prefilled in chunks (64 tokens a step): entry 0 None,
    then each prompt token's fp32 logprob and rank and the top k given the tokens before it,
    against torch.log_softmax within 1e-4. As in vLLM, such a prompt takes no prefix-cache hit;
    a request without prompt_logprobs then hits the pages it left."""
    hf, _, model = checkpoints("qwen2")
    prompt, k = PROMPTS[0], 3
    engine = jaxkv.Engine(model, page_size=PAGE_SIZE, num_pages=64, max_num_seqs=2,
                          max_model_len=256, max_num_batched_tokens=64)
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k,
                              output_kind=jaxkv.RequestOutputKind.DELTA)
    outs = {}
    for rid in ("a", "b", "c"):  # one after another: b and c find a's prompt cached
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=sp if rid != "c"
                           else jaxkv.SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():
            outs.setdefault(rid, []).extend(o for o in engine.step() if o.request_id == rid)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    given = [o.prompt_logprobs for o in outs["a"] if o.prompt_logprobs is not None]
    assert len(given) == 1  # DELTA: once
    lps = given[0]
    assert len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        entry, row, tok = lps[p], want[p - 1], prompt[p]
        np.testing.assert_allclose(entry[tok].logprob, row[tok], atol=ATOL, rtol=0)
        # The rank, up to tokens within rounding of this one (vocab 256: many near-ties).
        sure, maybe = (1 + int((row > row[tok] + d).sum()) for d in (ATOL, -ATOL))
        assert sure <= entry[tok].rank <= maybe
        top = sorted(entry, key=lambda t: -entry[t].logprob)[:k]
        np.testing.assert_allclose([row[t] for t in top], np.sort(row)[::-1][:k], atol=ATOL,
                                   rtol=0)
    assert outs["a"][-1].num_cached_tokens == 0 and outs["b"][-1].num_cached_tokens == 0
    assert outs["c"][-1].num_cached_tokens > 0 and outs["c"][-1].prompt_logprobs is None
    b = [o.prompt_logprobs for o in outs["b"] if o.prompt_logprobs is not None][0]
    for p in range(1, len(prompt)):
        assert b[p][prompt[p]].logprob == pytest.approx(lps[p][prompt[p]].logprob, abs=1e-5)
    engine.check()


# --- loading ----------------------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        jaxkv.load_pretrained(tmp_path)


def test_missing_folder_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        jaxkv.load_pretrained(tmp_path / "no-such-checkpoint")
    transformers.LlamaConfig(**{"hidden_size": 64, "num_attention_heads": 4}).save_pretrained(
        str(tmp_path))  # a config, but no tensors
    with pytest.raises(FileNotFoundError, match="safetensors"):
        jaxkv.load_pretrained(tmp_path)


_TARGET = "model.layers.1.self_attn.k_proj.weight"


def _remove(t):
    del t[_TARGET]


def _rename(t):
    t[_TARGET.replace("k_proj", "key_proj")] = t.pop(_TARGET)


def _reshape(t):
    t[_TARGET] = np.ascontiguousarray(t[_TARGET][:-1])


@pytest.mark.parametrize("edit, messages", [
    (_remove, [f"missing tensors (1): {_TARGET}"]),
    (_rename, [f"missing tensors (1): {_TARGET}",
               f"unexpected tensors (1): {_TARGET.replace('k_proj', 'key_proj')}"]),
    (_reshape, [f"{_TARGET}: expected ({{kv}}, 64), got ({{kv_1}}, 64)"]),
])
def test_bad_checkpoint_names_the_tensor(checkpoints, tmp_path, edit, messages):
    _, folder, model = checkpoints("llama_gqa")
    kv = model.config.num_kv_heads * model.config.head_dim
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(folder / "config.json", bad / "config.json")
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        jaxkv.load_pretrained(bad)
    for message in messages:
        message = message.replace("{kv}", str(kv)).replace("{kv_1}", str(kv - 1))
        assert re.search(re.escape(message), str(info.value)), str(info.value)


def test_sharded_checkpoint_loads_the_same(checkpoints, tmp_path):
    hf, _, single = checkpoints("llama_gqa")
    folder = save_hf_model(hf, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (folder / "model.safetensors").exists()
    sharded = jaxkv.load_pretrained(folder)
    for a, b in zip(params_of(single), params_of(sharded), strict=True):
        np.testing.assert_array_equal(a, b)
    (got,) = paged_prefill_logits(sharded, PROMPTS)  # same shapes: reuses the compiled prefill
    np.testing.assert_allclose(got[0], hf_logits(hf, PROMPTS[0])[-1], atol=ATOL, rtol=0)
