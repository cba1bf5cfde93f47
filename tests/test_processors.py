"""Logits processors (allowed_token_ids, bad_words, logit_bias, penalties) against vLLM's rules.

Three levels: the device edit against a dense numpy statement of vLLM's sampler; the sampled
distribution against the exact one (chi-square, with a check that the test rejects the
distribution without the processors); and the engine against Hugging Face `generate` on the
same weights, its logits processed by a torch statement of the same rules.
"""

import jax
import numpy as np
import pytest
import torch
import transformers
from hf_models import build_hf_model, save_hf_model
from sampling_ref import filtered_distribution
from scipy import stats

import jaxkv
from jaxkv import SamplingParams
from jaxkv.model.pretrained import DEFAULT_MODEL_DIR
from jaxkv.runtime.processors import (
    apply_processors,
    bad_word_bans,
    build_processors,
    sample_processed,
)
from jaxkv.runtime.sampling import SamplingArrays

P_VALUE = 1e-3  # chi-square: a correct sampler fails with probability 1e-3 per test


def _dense(logits, token_ids, num_prompt, sp, bans=()):
    """vLLM V1's processing of one row, on the whole vocabulary (float32, as vLLM)."""
    x = logits.astype(np.float32).copy()
    v = x.size
    if sp.allowed_token_ids is not None:
        mask = np.ones(v, bool)
        mask[list(sp.allowed_token_ids)] = False
        x[mask] = -np.inf
    x[list(bans)] = -np.inf
    for t, b in (sp.logit_bias or {}).items():
        x[t] += np.float32(b)
    out = np.bincount(np.asarray(token_ids[num_prompt:], int), minlength=v)
    seen = np.bincount(np.asarray(token_ids, int), minlength=v) > 0
    r = np.float32(sp.repetition_penalty)
    pen = np.where(x > 0, x / r, x * r)
    x = np.where(seen, pen, x).astype(np.float32)
    x = x - np.float32(sp.frequency_penalty) * out.astype(np.float32)
    x = x - np.float32(sp.presence_penalty) * (out > 0).astype(np.float32)
    return x


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.5, presence_penalty=-1.0),
    SamplingParams(frequency_penalty=2.0, logit_bias={3: 5.0, 10: -2.5, 44: 100.0}),
    SamplingParams(allowed_token_ids=[1, 5, 7, 8, 60], repetition_penalty=1.3,
                   logit_bias={5: 1.0, 9: 3.0}),
    SamplingParams(presence_penalty=1.5, allowed_token_ids=list(range(0, 97, 3))),
]


def test_edits_match_vllms_dense_rules():
    rng = np.random.default_rng(0)
    v, b = 97, len(CASES) + 1
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    rows, want = [], logits.copy()
    for i, sp in enumerate(CASES):
        prompt = rng.integers(0, v, size=rng.integers(1, 30)).tolist()
        output = rng.integers(0, v, size=rng.integers(0, 40)).tolist()
        bans = [int(rng.integers(0, v))] if i % 2 else []
        words = [(bans[0],)] if bans else []
        rows.append((i, prompt + output, len(prompt), sp, words, None))
        want[i] = _dense(logits[i], prompt + output, len(prompt), sp, bans)
    got = np.asarray(apply_processors(logits, build_processors(rows, b)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[-1], logits[-1])  # a row without processors: unchanged
    assert np.isneginf(got[3]).sum() == v - 5  # restricted to the allowed five


def test_many_entries_take_a_wider_bucket():
    sp = SamplingParams(repetition_penalty=2.0)
    hist = list(range(300))
    p = build_processors([(0, hist, 100, sp, [], None)], 2)
    assert p.ids.shape == (1, 512) and p.mask.shape == (1, 0)  # one row edited, no grammar
    logits = np.full((2, 400), 3.0, np.float32)
    got = np.asarray(apply_processors(logits, p))
    np.testing.assert_allclose(got[0], np.where(np.arange(400) < 300, 1.5, 3.0), rtol=0,
                               atol=0)


def test_bad_words_ban_the_last_token_after_the_rest():
    words = [(5,), (7, 8), (1, 2, 3)]
    assert bad_word_bans(words, []) == [5]
    assert bad_word_bans(words, [9, 7]) == [5, 8]
    assert bad_word_bans(words, [1, 2]) == [5, 3]
    assert bad_word_bans(words, [2, 1]) == [5]


def _chi_square(draws, p):
    """p-value of the draws under distribution p (cells with expected count < 5 pooled)."""
    counts = np.bincount(draws, minlength=p.size).astype(float)
    expected = p * draws.size
    assert counts[expected == 0].sum() == 0, "a token outside the distribution was drawn"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, repetition_penalty=1.5,
                   frequency_penalty=0.4, logit_bias={0: 2.0}),
    SamplingParams(temperature=1.6, top_p=0.8, presence_penalty=1.0,
                   allowed_token_ids=list(range(10, 40))),
])
def test_processed_draws_follow_the_exact_distribution(sp):
    rng = np.random.default_rng(1)
    v, n = 48, 20_000
    logits = (rng.standard_normal(v) * 1.5).astype(np.float32)
    hist = rng.integers(0, v, size=30).tolist()
    want = filtered_distribution(_dense(logits, hist, 10, sp), sp.temperature, sp.top_k, sp.top_p)
    plain = filtered_distribution(logits, sp.temperature, sp.top_k, sp.top_p)
    procs = build_processors([(i, hist, 10, sp, [], None) for i in range(n)], n)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.PRNGKey(7), n)),
                      np.uint32)
    arrays = SamplingArrays.build([sp.temperature] * n, [sp.top_k] * n, [sp.top_p] * n,
                                  [0] * n, n)
    draws = np.asarray(sample_processed(np.tile(logits, (n, 1)), keys, arrays, procs,
                                        np.zeros(n, np.int32)))
    assert _chi_square(draws, want) > P_VALUE
    # The test has power: the same draws reject the distribution without the processors.
    assert np.any(plain[draws] == 0) or _chi_square(draws, plain) < P_VALUE


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=[3]), "bad_words"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={True: 1.0}), "logit_bias"),
])
def test_bad_processor_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_logit_bias_takes_json_keys_and_numpy_ids():
    assert SamplingParams(logit_bias={"12": 1}).logit_bias == {12: 1.0}
    sp = SamplingParams(logit_bias={np.int64(3): np.float32(-2)},
                        allowed_token_ids=np.arange(4, 7))
    assert sp.logit_bias == {3: -2.0} and sp.allowed_token_ids == (4, 5, 6)
    with pytest.raises(TypeError):  # validated once: read-only afterwards
        sp.logit_bias[5] = 100.0


@pytest.mark.parametrize("edited", [[1], [1, 4, 7, 10, 19]], ids=["one", "five"])
def test_rows_without_processors_keep_their_tokens(edited):
    """Only the edited rows (gathered into a bucket of 1 or 16, the padding dropped) are drawn
    again; the others keep the step's tokens."""
    b = 20
    logits = np.random.default_rng(2).standard_normal((b, 50)).astype(np.float32)
    sp = SamplingParams(repetition_penalty=3.0)
    procs = build_processors([(i, [4, 4, 9 + i], 1, sp, [], None) for i in edited], b)
    assert procs.rows.shape == (1 if len(edited) == 1 else 16,)
    keys = np.zeros((b, 2), np.uint32)
    got = np.asarray(sample_processed(logits, keys, SamplingArrays.greedy(b), procs,
                                      np.full(b, 7)))
    for i in range(b):
        want = _dense(logits[i], [4, 4, 9 + i], 1, sp).argmax() if i in edited else 7
        assert got[i] == want, i


# ---- the engine against transformers ----------------------------------------------------------


class _VllmRules(transformers.LogitsProcessor):
    """vLLM's processing in torch, for HF generate (which has no presence/frequency penalty)."""

    def __init__(self, sp, num_prompt):
        self.sp, self.num_prompt = sp, num_prompt

    def __call__(self, input_ids, scores):
        sp, out = self.sp, input_ids[:, self.num_prompt:]
        scores = scores.clone()
        v = scores.shape[-1]
        if sp.allowed_token_ids is not None:
            mask = torch.ones(v, dtype=torch.bool)
            mask[list(sp.allowed_token_ids)] = False
            scores[:, mask] = -torch.inf
        for t, b in (sp.logit_bias or {}).items():
            scores[:, t] += b
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, input_ids, True)
        ones = torch.ones_like(out, dtype=scores.dtype)
        counts = torch.zeros_like(scores).scatter_add_(1, out, ones)
        r = sp.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
        scores = scores - sp.frequency_penalty * counts
        return scores - sp.presence_penalty * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    hf = build_hf_model("llama_gqa", seed=4)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("procs") / "m")
    return hf, jaxkv.load_pretrained(folder)


ENGINE_CASES = [
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(frequency_penalty=1.2, presence_penalty=0.7, logit_bias={17: 2.0}),
    SamplingParams(allowed_token_ids=list(range(40, 90)), repetition_penalty=1.3),
]


def test_engine_greedy_matches_hf_with_the_same_rules(hf_pair):
    from serving import drive

    hf, model = hf_pair
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (9, 21, 14)]
    engine = jaxkv.Engine(model, page_size=8, num_pages=64, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=128)
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(**greedy, **{f: getattr(sp, f) for f in (
        "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
        "allowed_token_ids")}) for sp in ENGINE_CASES]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=sp)
    got = drive(engine)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                              logits_processor=[_VllmRules(sp, len(p))], output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        want = ref.sequences[0, len(p):].tolist()
        tokens = got[str(i)].outputs[0].token_ids
        assert len(tokens) == 24
        for j, (a, b) in enumerate(zip(tokens, want, strict=True)):
            if a != b:  # allowed only at a near-tie of the processed logits
                top2 = torch.topk(ref.scores[j][0], 2).values
                assert float(top2[0] - top2[1]) < 1e-3, (i, j, tokens, want)
                break
        if sp.allowed_token_ids is not None:
            assert set(tokens) <= set(sp.allowed_token_ids)


def test_engine_bad_words_never_complete():
    from serving import drive

    model = jaxkv.load_pretrained(DEFAULT_MODEL_DIR)
    prompt = "def fib(n):"
    free = jaxkv.LLM(model, num_pages=64, max_model_len=256, warmup=False).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=2,
                                 prompt_logprobs=1))[0]
    n_prompt = len(free.prompt_token_ids)
    assert len(free.prompt_logprobs) == n_prompt and free.prompt_logprobs[0] is None
    assert all(free.prompt_token_ids[p] in free.prompt_logprobs[p] for p in range(1, n_prompt))
    assert free.outputs[0].token_ids == free.outputs[1].token_ids  # greedy samples agree
    text = free.outputs[0].text
    words = [w for w in text.split() if w.isalpha()]
    assert words, text
    word = words[len(words) // 2]
    engine = jaxkv.Engine(model, page_size=16, num_pages=64, max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, bad_words=[word])
    engine.add_request("r", prompt=prompt, sampling_params=sp)
    out = drive(engine)["r"].outputs[0]
    for seq in sp.bad_words_ids(model.tokenizer, model.config.vocab_size):
        ids = out.token_ids
        assert not any(tuple(ids[i:i + len(seq)]) == seq for i in range(len(ids))), (word, seq)
    assert out.token_ids != free.outputs[0].token_ids
