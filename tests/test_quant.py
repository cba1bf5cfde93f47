"""Weight-only quantization: the packed formats against numpy's own dequantization, models
against the same weights dequantized to float32 (the oracle), the CPU int8 path's HLO (no
float copy of a weight), loading, serving, sharding specs and update_params."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import dense_logits
from quant_oracle import float_twin, numpy_dequantize

import jaxkv
from jaxkv import LLM, SamplingParams
from jaxkv.model.loading import save_params
from jaxkv.model.quant import QuantizedWeight, QuantScheme, pack_int4, quantize

RNG = np.random.default_rng(0)
IDS = RNG.integers(4, 97, 24).tolist()


def test_int4_packs_two_rows_per_byte_low_nibble_first():
    q = np.array([[1, 15], [2, 0], [7, 9], [0, 3]], np.uint8)  # [I=4, O=2]
    assert pack_int4(q).tolist() == [[0x21, 0x0F], [0x07, 0x39]]


@pytest.mark.parametrize("spec", ["int8", "int8-g32", "int4-g32", "int4-g64", "int4"])
def test_rounding_error_is_at_most_half_a_step(spec):
    w = RNG.standard_normal((2, 256, 48)).astype(np.float32)  # a stacked [L, I, O] weight
    scheme = QuantScheme.parse(spec)
    qw = quantize(w, scheme)
    group = 256 if scheme.group_size is None else scheme.group_size
    assert qw.shape == w.shape and qw.scale.shape == (2, 256 // group, 48)
    assert qw.q.dtype == (np.int8 if scheme.bits == 8 else np.uint8)
    assert qw.q.nbytes == w.size * scheme.bits // 8
    err = np.abs(numpy_dequantize(qw) - w).reshape(2, 256 // group, group, 48)
    step = np.asarray(qw.scale)[:, :, None, :]
    assert np.all(err <= step / 2 + 1e-6)
    assert np.allclose(np.asarray(qw.dequantize()), numpy_dequantize(qw), rtol=0, atol=1e-6)


def test_bad_schemes_are_refused_by_name():
    for bad in ("int3", "int4-g48", "fp8", "int8-g7"):
        with pytest.raises(ValueError, match="quantization"):
            QuantScheme.parse(bad)
    with pytest.raises(ValueError, match="quantization"):
        jaxkv.RuntimeConfig(quantization="int2")
    with pytest.raises(ValueError, match="group size"):
        quantize(np.ones((40, 8), np.float32), QuantScheme(4, 32))


@pytest.mark.parametrize("spec", ["int8", "int8-g32", "int4-g32", "int4-g64"])
@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_logits_equal_the_dequantized_float_model(plain_model, spec, scan):
    """The weight-only path (integer_dot off) computes the dequantized weights' logits."""
    model = jaxkv.random_model(plain_model.config, seed=0, scan_layers=scan)
    quantized = jaxkv.quantize(model, spec, integer_dot=False)
    np.testing.assert_allclose(dense_logits(quantized, IDS), dense_logits(float_twin(quantized),
                                                                          IDS),
                               rtol=0, atol=2e-5)
    # and they are not the float model's: quantization changed the weights
    assert np.abs(dense_logits(quantized, IDS) - dense_logits(model, IDS)).max() > 1e-4


def test_integer_dot_is_close_to_the_dequantized_float_model(plain_model):
    """The CPU int8 path also rounds activations to int8 per token: close, not equal."""
    quantized = jaxkv.quantize(plain_model, "int8", integer_dot=True)
    got, want = dense_logits(quantized, IDS), dense_logits(float_twin(quantized), IDS)
    assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()
    assert np.abs(got - want).max() > 0  # the activation rounding is real
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_embedding_kept_row_by_row_computes_the_same_model(plain_model, tied):
    """TPU's layout of a quantized embedding (`QuantizedTable`, [V, E]: a lookup gathers rows,
    the tied LM head contracts against it) holds the same int8 values as the [E, V] one, gives
    the same logits, shards by rows and saves back to the float table."""
    from jax.sharding import PartitionSpec as P

    from jaxkv.model.loading import hf_tensors, load_tensors
    from jaxkv.model.quant import QuantizedTable
    from jaxkv.sharding import param_spec

    config = dataclasses.replace(plain_model.config, tie_word_embeddings=tied)
    module = jaxkv.random_model(config, seed=1).module()

    def load(rows):
        return load_tensors(hf_tensors(module), "test", config, scan_layers=False,
                            quantization=QuantScheme(8, None), table_rows=rows)

    rows, cols = load(True), load(False)
    table, kept = rows.embed.get_value(), cols.embed.get_value()
    assert isinstance(table, QuantizedTable) and isinstance(kept, QuantizedWeight)
    assert table.values.shape == (config.vocab_size, config.hidden_size)
    np.testing.assert_array_equal(np.asarray(table.values), np.asarray(kept.q).T)
    np.testing.assert_array_equal(np.asarray(table.scales), np.asarray(kept.scale).T)
    for m in (rows, cols):
        m.integer_dot = False
    got = dense_logits(jaxkv.Model.from_module(rows), IDS)
    want = dense_logits(jaxkv.Model.from_module(cols), IDS)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    # the float table that saving writes is the dequantized rows (numpy's own product)
    saved = dict(hf_tensors(rows))["model.embed_tokens.weight"]()
    np.testing.assert_allclose(saved, np.asarray(table.values, np.float32)
                               * np.asarray(table.scales, np.float32), rtol=0, atol=1e-6)
    leaves = jax.tree_util.tree_flatten_with_path(table)[0]
    embed = (jax.tree_util.DictKey("embed"),)
    assert [param_spec((*embed, *p), tuple(x.shape), 2) for p, x in leaves] == \
        [P("tp", None)] * 2


@pytest.mark.parametrize("spec", ["int8-g32", "int4-g32"])
def test_a_grouped_table_is_kept_as_int8_rows_a_block_at_a_time(spec, monkeypatch):
    """On TPU a table kept in groups (a GGUF file's Q8_0 or Q4 blocks) becomes int8 rows with
    one scale each, converted a few rows at a time: within half a step of the stored table."""
    from jaxkv.model import quant

    table = RNG.standard_normal((96, 64)).astype(np.float32)  # [V, E]
    kept = quantize(table.T, QuantScheme.parse(spec))  # [E, V], as a GGUF table is kept
    monkeypatch.setattr(quant, "CHUNK", 64 * 10)  # 10 rows at a time
    t = quant.as_table(kept)
    assert t.values.shape == (96, 64) and t.values.dtype == np.int8 and t.scales.shape == (96, 1)
    step = np.asarray(t.scales, np.float32)
    err = np.abs(np.asarray(t.values, np.float32) * step - numpy_dequantize(kept).T)
    assert np.all(err <= step / 2 + 1e-6)
    assert np.abs(err).max() > 0  # requantized, not a copy of the float table


def _optimized_hlo(model) -> str:

    module = model.module()
    c = model.config

    def forward(tokens):
        def attention(layer, q, k, v, carry):
            return jnp.repeat(v, c.num_heads // c.num_kv_heads, axis=1), carry
        hidden, _ = module(tokens, jnp.arange(tokens.shape[0]), attention, None)
        return module.logits(hidden)

    return jax.jit(forward).lower(jnp.zeros(4, jnp.int32)).compile().as_text()


@pytest.mark.parametrize("spec", ["int8", "int8-g32", "int4-g32", "int4-g64"])
def test_cpu_path_never_materializes_a_float_weight(plain_model, spec):
    """On CPU every linear goes through the integer kernel (`pallas_kernels.cpu_quant_matmul`),
    the tied LM head through an int8 x int8 dot: no float copy of any weight in the program."""
    c = plain_model.config
    weights = [f"f32[{c.hidden_size},{c.intermediate_size}]",
               f"f32[{c.intermediate_size},{c.hidden_size}]",
               f"f32[{c.vocab_size},{c.hidden_size}]"]
    hlo = _optimized_hlo(jaxkv.quantize(plain_model, spec, integer_dot=True))
    assert not [w for w in weights if w in hlo]
    # wv, wo, gate, up, down of every layer (this attention stub leaves q and k unused)
    assert hlo.count('custom_call_target="jaxkv_quantized_matmul"') == 5 * c.num_layers
    assert "s32[" in hlo and "s8[" in hlo  # the LM head: an int8 x int8 -> int32 dot
    # the check can fail: the dequantizing path does materialize them
    hlo = _optimized_hlo(jaxkv.quantize(plain_model, spec, integer_dot=False))
    assert [w for w in weights if w in hlo]


def test_load_pretrained_quantizes_as_it_reads(plain_model, tmp_path):
    save_params(plain_model.module(), tmp_path)
    loaded = jaxkv.load_pretrained(tmp_path, quantization="int4-g32", dtype="float32")
    assert loaded.quantization == QuantScheme(4, 32)
    want = jaxkv.quantize(jaxkv.load_pretrained(tmp_path, dtype="float32"), "int4-g32")
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want.params), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    leaves = jax.tree_util.tree_flatten_with_path(loaded.params)[0]
    wq = [x for p, x in leaves if "wq" in jax.tree_util.keystr(p) and x.dtype == jnp.uint8]
    assert wq and wq[0].shape == (plain_model.config.hidden_size // 2,
                                  plain_model.config.num_heads * plain_model.config.head_dim)
    with pytest.raises(ValueError, match="already quantized"):
        jaxkv.quantize(loaded, "int8")


# The CPU kernel rounds activations to int8 per 32 inputs: an eager pass and the engine's
# jitted steps differ in the activations' last bits, which can flip a rounding and move a logit
# by ~1e-3 (on an AVX2 host a 3e-4 near-tie of this random model went the other way).
ROUNDING_TIE = 1e-3


def _is_greedy_under(model, prompt, output) -> bool:
    """Whether every output token is the argmax of ``model``'s dense logits after the prompt
    and the tokens before it (one teacher-forced pass), or within ROUNDING_TIE of it."""
    logits = dense_logits(model, [*prompt, *output])[len(prompt) - 1:-1]
    return all(row.max() - row[t] <= ROUNDING_TIE for row, t in zip(logits, output,
                                                                     strict=True))


@pytest.mark.parametrize("spec", ["int8", "int4-g32"])
def test_llm_serves_the_quantized_weights(plain_model, spec):
    prompts = [IDS[:9], IDS[:17]]
    llm = LLM(plain_model, quantization=spec, page_size=8, num_pages=64, max_num_seqs=4,
              max_model_len=128, warmup=False)
    assert llm.model.quantization == QuantScheme.parse(spec)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        assert _is_greedy_under(llm.model, prompt, out.outputs[0].token_ids)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(llm.model, quantization="int8" if spec != "int8" else "int4", warmup=False,
            num_pages=64)


def test_update_params_quantizes_float_weights_like_the_served_ones(plain_model):
    shape = dict(page_size=8, num_pages=64, max_num_seqs=4, max_model_len=128, warmup=False)
    llm = LLM(plain_model, quantization="int8", **shape)
    other = jaxkv.random_model(plain_model.config, seed=5)
    llm.engine.update_params(other)  # float weights, quantized by the engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate(prompt_token_ids=[IDS[:12]], sampling_params=greedy, use_tqdm=False)
    fresh = LLM(other, quantization="int8", **shape)
    want = fresh.generate(prompt_token_ids=[IDS[:12]], sampling_params=greedy, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    bad = jax.tree.map(lambda x: x, fresh.model.params)
    bad = jax.tree_util.tree_map_with_path(
        lambda p, x: x.astype(jnp.int32) if x.dtype == jnp.int8 else x, bad)
    with pytest.raises(ValueError, match="dtype int32"):
        llm.engine.update_params(bad)


def test_shardings_split_quantized_weights_like_float_ones(plain_model):
    from jax.sharding import PartitionSpec as P

    from jaxkv.sharding import param_spec  # the rule table itself, without 2 devices

    config = dataclasses.replace(plain_model.config, num_layers=1)
    model = jaxkv.quantize(jaxkv.random_model(config), "int4-g32")
    specs = {jax.tree_util.keystr(p): param_spec(p, tuple(x.shape), 2)
             for p, x in jax.tree_util.tree_flatten_with_path(model.params)[0]}

    def find(*parts):
        return next(s for k, s in specs.items() if all(part in k for part in parts))

    assert find("'wq'", ".q") == P(None, "tp") and find("'wq'", ".scale") == P(None, "tp")
    assert find("'w_down'", ".q") == P("tp", None)
    assert find("'w_down'", ".scale") == P("tp", None)  # 4 groups of 32 over 2 devices
    # the quantized table is [E, V] (the LM head's layout): split over the vocabulary still
    assert find("'embed'", ".q") == P(None, "tp") and find("'embed'", ".scale") == P(None, "tp")
    per_channel = jaxkv.quantize(jaxkv.random_model(config), "int8")
    leaves = jax.tree_util.tree_flatten_with_path(per_channel.params)[0]
    down = next((p, x) for p, x in leaves if "w_down" in jax.tree_util.keystr(p)
                and jax.tree_util.keystr(p).endswith(".scale"))
    assert param_spec(down[0], tuple(down[1].shape), 2) == P()  # one group: replicated
    assert isinstance(model.module().layers.layer(0)["wq"], QuantizedWeight)
