"""The embedded default model (jaxkv/assets/tiny-llama): loads in jaxkv and in transformers,
agrees with transformers token for token, and ships its tokenizer, chat template and card."""

import pytest

import jaxkv
from jaxkv.model.pretrained import DEFAULT_MODEL_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["def fibonacci(n):", "import os\n\n\nclass ", "    for i in range(len("]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_default()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR),
                                                             dtype=torch.float32).eval()


def test_greedy_tokens_match_transformers(model, tokenizer, hf_model):
    hf = hf_model
    greedy = jaxkv.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = jaxkv.generate(model, PROMPTS, greedy)
    eos = set(model.config.eos_token_ids)
    for prompt, out in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            full = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        theirs = full[0, ids.shape[1]:].tolist()
        assert len(out) == len(theirs) == NEW_TOKENS
        # min_new_tokens masks EOS in transformers; ignore_eos samples it in jaxkv: the two
        # agree up to the first EOS.
        n = next((i for i, t in enumerate(out) if t in eos), NEW_TOKENS)
        assert out[:n] == theirs[:n], (prompt, model.decode(out), tokenizer.decode(theirs))


def test_model_is_trained_on_python(tokenizer, hf_model):
    src = "def main():\n    parser = argparse.ArgumentParser()\n    args = parser.parse_args()\n"
    ids = torch.tensor([tokenizer.encode(src)])
    with torch.no_grad():
        loss = hf_model(ids, labels=ids).loss.item()
    assert loss < 4.0, loss  # a uniform guess over the vocabulary scores ln(4096) = 8.3


def test_tokenizer_round_trips_python_without_adding_bos(model, tokenizer):
    src = 'class A:\n\tdef f(self, x=1):\n        """Doc: é ✓."""\n        return {x: [x ** 2]}\n'
    ids = tokenizer.encode(src)
    assert tokenizer.decode(ids) == src
    assert ids[0] != tokenizer.bos_token_id and tokenizer.eos_token_id not in ids
    assert model.decode(ids) == src


def test_chat_template_renders_markers_as_special_tokens(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>\nBe brief.<|eos|>\n<|user|>\nHi<|eos|>\n<|assistant|>\n"
    ids = tokenizer.encode(text)
    for marker in ("<|system|>", "<|user|>", "<|assistant|>", "<|eos|>"):
        assert tokenizer.convert_tokens_to_ids(marker) in ids, marker


def test_weights_are_small_and_config_consistent(model):
    size = (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size
    assert size <= 10_000_000
    assert size >= 4 * model.config.num_params()  # float32
    assert model.config.tie_word_embeddings and model.config.num_kv_heads < model.config.num_heads


def test_model_card_names_corpus_and_license():
    card = (DEFAULT_MODEL_DIR / "README.md").read_text()
    for phrase in ("standard library", "PSF License", "Apache-2.0", "scripts/train_tiny.py"):
        assert phrase in card, phrase
