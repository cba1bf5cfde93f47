"""`ModelConfig.from_hf` reads a Llama config.json itself when nothing is left to transformers'
defaults (importing transformers' configs imports torch: seconds of every start); on random
config.json files it gives exactly what reading them through `AutoConfig` gives, or refuses
alike."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv.model.config import ModelConfig, _from_hf_config, _plain_llama
from jaxkv.model.pretrained import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.host  # no engine: `make test-fast`

_ABSENT = object()


def _through_transformers(folder):
    from transformers import AutoConfig

    try:
        return _from_hf_config(AutoConfig.from_pretrained(str(folder)))
    except Exception as e:  # noqa: BLE001 - whichever error, both readers alike
        return type(e).__name__


def _through_jaxkv(folder):
    try:
        return ModelConfig.from_hf(folder)
    except Exception as e:  # noqa: BLE001 - whichever error, both readers alike
        return type(e).__name__


def test_the_embedded_models_config_is_read_without_transformers():
    assert _plain_llama(DEFAULT_MODEL_DIR / "config.json") is not None
    assert ModelConfig.from_hf(DEFAULT_MODEL_DIR) == _through_transformers(DEFAULT_MODEL_DIR)


def _write_config(tmp_path, raw):
    """A checkpoint folder whose config.json holds ``raw`` without its absent keys."""
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(
        {k: v for k, v in raw.items() if v is not _ABSENT}))
    return folder


def _maybe(value):
    return st.one_of(st.just(_ABSENT), value)


heads = st.sampled_from([2, 4, 6])
rope = st.one_of(
    st.just(_ABSENT), st.none(),
    st.fixed_dictionaries({"rope_type": st.just("default"),
                           "rope_theta": st.sampled_from([10000.0, 500000.0])}),
    st.fixed_dictionaries({"type": st.just("linear"), "factor": st.sampled_from([2.0, 4.0])}),
    st.fixed_dictionaries({"rope_type": st.just("llama3"), "factor": st.just(8.0),
                           "low_freq_factor": st.just(1.0), "high_freq_factor": st.just(4.0),
                           "original_max_position_embeddings": st.just(64)}),
    st.fixed_dictionaries({"rope_type": st.just("yarn"), "factor": st.just(2.0)}),
)
config = st.fixed_dictionaries({
    "model_type": st.sampled_from(["llama", "llama", "llama", "mistral"]),
    "vocab_size": _maybe(st.sampled_from([96, 128, 128.0])),
    "hidden_size": _maybe(st.sampled_from([48, 64, 66])),
    "intermediate_size": _maybe(st.just(128)),
    "num_hidden_layers": _maybe(st.sampled_from([1, 2])),
    "num_attention_heads": _maybe(heads),
    "num_key_value_heads": _maybe(st.one_of(st.none(), st.sampled_from([1, 2]))),
    "head_dim": _maybe(st.one_of(st.none(), st.sampled_from([8, 16, 7]))),
    "rms_norm_eps": _maybe(st.sampled_from([1e-5, 1e-6])),
    "rope_theta": _maybe(st.sampled_from([10000.0, 1000000.0, 10000])),
    "rope_scaling": rope,
    "max_position_embeddings": _maybe(st.sampled_from([128, 512])),
    "tie_word_embeddings": _maybe(st.one_of(st.booleans(), st.just("false"))),
    "attention_bias": _maybe(st.booleans()),
    "mlp_bias": _maybe(st.booleans()),
    "hidden_act": _maybe(st.sampled_from(["silu", "gelu"])),
    "bos_token_id": _maybe(st.one_of(st.none(), st.sampled_from([0, 1]))),
    "eos_token_id": _maybe(st.one_of(st.none(), st.sampled_from([2, [2, 3]]))),
})


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=config)
def test_jaxkvs_reader_agrees_with_transformers(raw, tmp_path):
    folder = _write_config(tmp_path, raw)
    assert _through_jaxkv(folder) == _through_transformers(folder)


def test_the_reader_is_used_where_the_file_is_complete(tmp_path):
    full = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    for key, absent in [("rms_norm_eps", True), ("bos_token_id", True), ("vocab_size", 96.0),
                        ("model_type", "mistral"), ("num_attention_heads", 3)]:
        raw = dict(full)
        if absent is True:
            del raw[key]
        else:
            raw[key] = absent
        (tmp_path / "config.json").write_text(json.dumps(raw))
        assert _plain_llama(tmp_path / "config.json") is None, key  # left to AutoConfig


complete = config.map(lambda raw: {**raw, "model_type": "llama", "vocab_size": 128,
                                   "head_dim": 16 if raw["head_dim"] == 7 else raw["head_dim"],
                                   "tie_word_embeddings": raw["tie_word_embeddings"] is True,
                                   "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                   "max_position_embeddings": 256,
                                   "bos_token_id": raw["bos_token_id"] if raw["bos_token_id"]
                                   is not _ABSENT else 1,
                                   "eos_token_id": raw["eos_token_id"] if raw["eos_token_id"]
                                   is not _ABSENT else [2, 3]})


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=complete)
def test_complete_llama_configs_are_read_by_jaxkv_alike(raw, tmp_path):
    folder = _write_config(tmp_path, raw)
    assert _plain_llama(folder / "config.json") is not None  # (the path under test)
    assert _through_jaxkv(folder) == _through_transformers(folder)


def test_a_generic_tokenizer_is_built_as_autotokenizer_builds_it():
    from transformers import AutoTokenizer

    from jaxkv.model.pretrained import load_tokenizer

    ours, theirs = load_tokenizer(DEFAULT_MODEL_DIR), AutoTokenizer.from_pretrained(
        str(DEFAULT_MODEL_DIR))
    assert type(ours) is type(theirs)
    texts = ["the cat sat on the mat.", "<|user|>\nhi<|eos|>", " spaces  and\ttabs\n", "é ü 中文"]
    for text in texts:
        assert ours(text).input_ids == theirs(text).input_ids
        ids = theirs(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(ours, name) == getattr(theirs, name), name
    chat = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
