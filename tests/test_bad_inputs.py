"""Bad input at every API edge: a ValueError (or a documented subclass) that names the field
and the value, and nothing already accepted is lost.

One table. Each case runs against an engine that is serving a request mid-flight; after the
bad call, that request and a new one must complete with the tokens `jaxkv.generate` gives
them alone, with the page invariants checked after every step and no page left in use.
"""

import dataclasses
import json
import math
import shutil
import types

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from serving import drive

import jaxkv
from jaxkv import (
    LLM,
    CheckpointError,
    CheckpointNotFoundError,
    Engine,
    KVStateError,
    SamplingParams,
    UnsupportedModelError,
)
from jaxkv.kv import init_state
from jaxkv.model.loading import save_params
from jaxkv.runtime.batch import PageTable, Row, build_batch

SMALL = dict(page_size=16, num_pages=8, max_num_seqs=4, max_model_len=128,
             max_num_batched_tokens=16)
IN_FLIGHT = list(range(10, 40))  # 30 tokens: two prefill chunks, then decoding
GOOD = [5, 6, 7, 8, 9]


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def checkpoint(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_params(tiny_model.module(), folder)
    return folder


@pytest.fixture(scope="module")
def expected(tiny_model):
    return jaxkv.generate(tiny_model, [IN_FLIGHT, GOOD], [greedy(40), greedy()])


def _copy_checkpoint(ctx, edit_config=None, edit_tensors=None):
    bad = ctx.tmp / "bad"
    shutil.copytree(ctx.checkpoint, bad)
    if edit_config:
        config = json.loads((bad / "config.json").read_text())
        edit_config(config)
        (bad / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(str(bad / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


def _add(**kw):
    def call(ctx):
        ctx.engine.add_request("new", **kw)
    return call


def _sp(**kw):
    return lambda ctx: SamplingParams(**kw)


def _engine(**kw):
    return lambda ctx: Engine(ctx.model, **dict(SMALL, **kw))


def _state_step(ctx, state):
    engine = ctx.engine
    batch = build_batch([Row(0, GOOD, 0, [0])], PageTable(engine.max_num_seqs, 8, 8, 16),
                        tokens_bucket=16)
    keys, arrays = engine.runner.sampling([])
    engine.steps.step(ctx.model.params, state, batch, keys, arrays)


def _batch(row, **kw):
    args = dict(tokens_bucket=16, vocab_size=97) | kw
    return lambda ctx: build_batch([row], PageTable(4, 8, 8, 16), **args)


K_PROJ = "model.layers.1.self_attn.k_proj.weight"


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _drop_k_proj(t):
    del t[K_PROJ]


def _shrink_k_proj(t):
    t[K_PROJ] = np.ascontiguousarray(t[K_PROJ][:-1])


BAD = [
    # --- Engine.add_request: the prompt ---------------------------------------------------
    pytest.param(_add(prompt=""), ValueError, "prompt is empty", id="empty prompt"),
    pytest.param(_add(prompt_token_ids=[]), ValueError, "prompt_token_ids is empty",
                 id="empty token ids"),
    pytest.param(_add(prompt_token_ids=[5, 97]), ValueError,
                 r"prompt_token_ids\[1\]=97 is not a token id in the vocabulary \[0, 97\)",
                 id="token id = vocab"),
    pytest.param(_add(prompt_token_ids=[-1, 5]), ValueError, r"prompt_token_ids\[0\]=-1",
                 id="negative token id"),
    pytest.param(_add(prompt_token_ids=[5, 2.0]), ValueError, r"prompt_token_ids\[1\]=2.0",
                 id="float token id"),
    pytest.param(_add(prompt_token_ids="abc"), ValueError, "prompt_token_ids must be a sequence",
                 id="token ids as a string"),
    pytest.param(_add(prompt="hi"), ValueError, "no tokenizer", id="text without tokenizer"),
    pytest.param(_add(), ValueError, "exactly one of prompt", id="no prompt"),
    pytest.param(_add(prompt="x", prompt_token_ids=[1]), ValueError, "exactly one of prompt",
                 id="two prompts"),
    pytest.param(_add(prompt_token_ids=[1] * 128, sampling_params=greedy(1)), ValueError,
                 r"the prompt has 128 tokens; max_model_len=128", id="prompt > max_model_len"),
    pytest.param(_add(prompt_token_ids=[1] * 100, sampling_params=greedy(29)), ValueError,
                 r"prompt \(100 tokens\) \+ max_tokens \(29\) = 129 tokens exceeds "
                 r"max_model_len=128", id="prompt + max_tokens > max_model_len"),
    pytest.param(lambda ctx: Engine(ctx.model, **dict(SMALL, num_pages=4)).add_request(
        "big", prompt_token_ids=[1] * 60, sampling_params=greedy(20)), ValueError,
        r"request 'big' needs 5 KV pages .* only 4 pages", id="more pages than the cache"),
    # --- Engine.add_request: the other fields ----------------------------------------------
    pytest.param(lambda ctx: ctx.engine.add_request("inflight", prompt_token_ids=GOOD),
                 ValueError, "request_id 'inflight' is already used", id="duplicate id"),
    pytest.param(lambda ctx: ctx.engine.add_request("", prompt_token_ids=GOOD), ValueError,
                 "request_id must be a non-empty string", id="empty id"),
    pytest.param(lambda ctx: ctx.engine.add_request(7, prompt_token_ids=GOOD), ValueError,
                 "request_id must be a non-empty string, got 7", id="int id"),
    pytest.param(_add(prompt_token_ids=GOOD, sampling_params={"n": 2}), ValueError,
                 "sampling_params must be a SamplingParams, got dict", id="params as dict"),
    pytest.param(_add(prompt_token_ids=GOOD, cache_salt=3), ValueError, "cache_salt",
                 id="salt not a string"),
    pytest.param(_add(prompt_token_ids=GOOD, sampling_params=SamplingParams(n=5)), ValueError,
                 r"SamplingParams.n=5 exceeds max_num_seqs=4", id="n > max_num_seqs"),
    pytest.param(_add(prompt_token_ids=GOOD, sampling_params=SamplingParams(
        stop_token_ids=[3, 200])), ValueError, r"stop_token_ids=\(3, 200\): 200 is not a token",
        id="stop token outside vocab"),
    pytest.param(_add(prompt_token_ids=GOOD, sampling_params=SamplingParams(
        allowed_token_ids=[5, 97])), ValueError,
        r"SamplingParams.allowed_token_ids=\(5, 97\): 97 is not a token",
        id="allowed id outside vocab"),
    pytest.param(_add(prompt_token_ids=GOOD, sampling_params=SamplingParams(
        logit_bias={500: 1.0})), ValueError, r"SamplingParams.logit_bias=.*500 is not a token",
        id="biased id outside vocab"),
    pytest.param(_add(prompt_token_ids=GOOD, sampling_params=SamplingParams(
        bad_words=["x"])), ValueError, r"SamplingParams.bad_words=.*need a model with a tokenizer",
        id="bad words without a tokenizer"),
    pytest.param(_add(prompt_token_ids=GOOD, sampling_params=SamplingParams(
        min_tokens=2, stop_token_ids=list(range(4, 24)))), ValueError,
        r"SamplingParams.stop_token_ids=.*at most 16 stop ids", id="min_tokens, 20 stop ids"),
    pytest.param(_add(prompt_token_ids=GOOD, sampling_params=SamplingParams(
        allowed_token_ids=[3, 9], stop_token_ids=[9], min_tokens=2)), ValueError,
        r"allowed_token_ids=\(3, 9\): every allowed token is a stop token, which cannot "
        r"be sampled until min_tokens=2 are out", id="only stop ids allowed, min_tokens"),
    # --- Engine.abort -----------------------------------------------------------------------
    pytest.param(lambda ctx: ctx.engine.abort("nope"), ValueError,
                 "no unfinished request with request_id 'nope'", id="abort unknown id"),
    # --- SamplingParams ---------------------------------------------------------------------
    pytest.param(_sp(max_tokens=0), ValueError, r"SamplingParams.max_tokens=0", id="max_tokens 0"),
    pytest.param(_sp(max_tokens=-3), ValueError, r"SamplingParams.max_tokens=-3",
                 id="max_tokens < 0"),
    pytest.param(_sp(temperature=-0.5), ValueError, r"SamplingParams.temperature=-0.5",
                 id="temperature < 0"),
    pytest.param(_sp(temperature=math.nan), ValueError, r"SamplingParams.temperature=nan",
                 id="temperature nan"),
    pytest.param(_sp(temperature=math.inf), ValueError, r"SamplingParams.temperature=inf",
                 id="temperature inf"),
    pytest.param(_sp(top_p=0.0), ValueError, r"SamplingParams.top_p=0.0", id="top_p 0"),
    pytest.param(_sp(top_p=1.5), ValueError, r"SamplingParams.top_p=1.5", id="top_p > 1"),
    pytest.param(_sp(top_p=math.nan), ValueError, r"SamplingParams.top_p=nan", id="top_p nan"),
    pytest.param(_sp(top_k=-2), ValueError, r"SamplingParams.top_k=-2", id="top_k < -1"),
    pytest.param(_sp(n=0), ValueError, r"SamplingParams.n=0", id="n 0"),
    pytest.param(_sp(n=True), ValueError, r"SamplingParams.n=True", id="n bool"),
    pytest.param(_sp(min_tokens=9, max_tokens=4), ValueError, r"SamplingParams.min_tokens=9",
                 id="min_tokens > max_tokens"),
    pytest.param(_sp(seed=2**64), ValueError, r"SamplingParams.seed=18446744073709551616",
                 id="seed >= 2**64"),
    pytest.param(_sp(seed=-(2**63) - 1), ValueError, r"SamplingParams.seed=-9223372036854775809",
                 id="seed < -2**63"),
    pytest.param(_sp(stop_token_ids=[-4]), ValueError, r"SamplingParams.stop_token_ids=\[-4\]",
                 id="negative stop token"),
    pytest.param(_sp(logit_bias={"\u00b2": 5}), ValueError,
                 r"SamplingParams.logit_bias=.*key '\u00b2' is not a token id",
                 id="logit_bias key a unicode digit"),
    pytest.param(_sp(logit_bias={"1_0": 5}), ValueError,
                 r"SamplingParams.logit_bias=.*key '1_0' is not a token id",
                 id="logit_bias key int() reads"),
    # --- LLM.generate -----------------------------------------------------------------------
    pytest.param(lambda ctx: ctx.llm.generate(prompt_token_ids=[[5, 6], []], use_tqdm=False),
                 ValueError, r"prompt_token_ids\[1\]: prompt_token_ids is empty",
                 id="LLM: one empty prompt in a batch"),
    pytest.param(lambda ctx: ctx.llm.generate(prompt_token_ids=[[5, 6], [1] * 130],
                                              use_tqdm=False),
                 ValueError, r"prompt_token_ids\[1\]: .*130 tokens", id="LLM: one long prompt"),
    pytest.param(lambda ctx: ctx.llm.generate([], use_tqdm=False), ValueError,
                 "prompts is empty", id="LLM: no prompts"),
    pytest.param(lambda ctx: ctx.llm.generate(prompt_token_ids=[[5], [6]],
                                              sampling_params=[greedy()], use_tqdm=False),
                 ValueError, "sampling_params has 1 entries for 2 prompts",
                 id="LLM: params per prompt mismatch"),
    pytest.param(lambda ctx: LLM(ctx.model, kv_cache_memory_bytes=10, warmup=False), ValueError,
                 "kv_cache_memory_bytes=10 holds no page", id="LLM: no room for a page"),
    # --- Engine construction ----------------------------------------------------------------
    pytest.param(_engine(page_size=12), ValueError, "page_size must be a power of two, got 12",
                 id="page_size not a power of two"),
    pytest.param(_engine(page_size=4, attention_impl="interpret-tpu"), ValueError,
                 r"page_size=4: the TPU kernel .* needs a multiple of 8 for float32",
                 id="page_size below the TPU tile"),
    pytest.param(_engine(num_pages=0), ValueError, "num_pages must be an int >= 1, got 0",
                 id="num_pages 0"),
    pytest.param(_engine(max_num_seqs=0), ValueError, "max_num_seqs must be an int >= 1",
                 id="max_num_seqs 0"),
    pytest.param(_engine(max_model_len=4096), ValueError,
                 "max_model_len=4096 exceeds the model's max_position_embeddings=512",
                 id="max_model_len too long"),
    pytest.param(_engine(attention_impl="flash"), ValueError, "attention_impl must be one of",
                 id="unknown attention_impl"),
    # --- load_pretrained --------------------------------------------------------------------
    pytest.param(lambda ctx: jaxkv.load_pretrained(ctx.tmp / "no-such-model"),
                 CheckpointNotFoundError, "no such file or folder .*no-such-model",
                 id="checkpoint path missing"),
    pytest.param(lambda ctx: jaxkv.load_pretrained(_write(ctx.tmp / "notes.txt", b"hello")),
                 CheckpointError, "notes.txt.* is a file but not a GGUF checkpoint",
                 id="checkpoint path a non-checkpoint file"),
    pytest.param(lambda ctx: jaxkv.load_pretrained(_write(ctx.tmp / "empty" / "README", b"")
                                                   .parent),
                 CheckpointNotFoundError, "folder .*empty.* has no config.json",
                 id="checkpoint folder without config"),
    pytest.param(lambda ctx: jaxkv.load_pretrained(_copy_checkpoint(
        ctx, edit_config=lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))),
        UnsupportedModelError, "gpt2", id="unsupported architecture"),
    pytest.param(lambda ctx: jaxkv.load_pretrained(_copy_checkpoint(
        ctx, edit_config=lambda c: c.update(hidden_act="gelu"))),
        UnsupportedModelError, "hidden_act 'gelu'", id="unsupported option"),
    pytest.param(lambda ctx: jaxkv.load_pretrained(_copy_checkpoint(
        ctx, edit_tensors=_drop_k_proj)), CheckpointError, f"missing tensors \\(1\\): {K_PROJ}",
        id="tensor missing"),
    pytest.param(lambda ctx: jaxkv.load_pretrained(_copy_checkpoint(
        ctx, edit_tensors=_shrink_k_proj)), CheckpointError,
        rf"{K_PROJ}: expected \(32, 64\), got \(31, 64\)", id="tensor of the wrong shape"),
    # --- init_state and the jitted steps ----------------------------------------------------
    pytest.param(lambda ctx: init_state(ctx.model.config, 8, 12), ValueError,
                 "init_state: page_size must be a power of two, got 12", id="init_state page_size"),
    pytest.param(lambda ctx: init_state(ctx.model.config, 0, 16), ValueError,
                 "init_state: num_pages must be a positive int, got 0", id="init_state num_pages"),
    pytest.param(lambda ctx: _state_step(ctx, init_state(
        dataclasses.replace(ctx.model.config, num_kv_heads=4), 8, 16)),
        KVStateError, r"PagedKVState.kv_pages", id="state of another model"),
    pytest.param(lambda ctx: _state_step(ctx, init_state(ctx.model.config, 8, 16,
                                                         jnp.bfloat16)),
                 KVStateError, r"PagedKVState.kv_pages: dtype bfloat16 does not match",
                 id="state of the wrong dtype"),
    pytest.param(lambda ctx: _state_step(ctx, init_state(ctx.model.config, 8, 16).replace(
        kv_pages=jnp.zeros((2, 2, 8, 16, 33)))), KVStateError, r"PagedKVState.kv_pages",
        id="state with a wrong field shape"),
    # --- the batch builder ------------------------------------------------------------------
    pytest.param(_batch(Row(4, GOOD, 0, [0])), ValueError, "slot 4 is out of range",
                 id="batch: slot out of range"),
    pytest.param(_batch(Row(0, [5, 120], 0, [0])), ValueError,
                 r"token id 120 is outside the vocabulary \[0, 97\)", id="batch: token id"),
    pytest.param(_batch(Row(0, list(range(20)), 0, [0])), ValueError,
                 "needs 2 pages for 20 tokens", id="batch: too few pages"),
    pytest.param(_batch(Row(0, GOOD, 0, [8])), ValueError, r"page id outside \[0, 8\)",
                 id="batch: page id"),
]


@pytest.mark.parametrize("call, error, match", BAD)
def test_bad_input_is_named_and_nothing_is_lost(tiny_model, checkpoint, expected, tmp_path,
                                                call, error, match):
    llm = LLM(tiny_model, **SMALL, warmup=False)
    engine = llm.engine
    engine.add_request("inflight", prompt_token_ids=IN_FLIGHT, sampling_params=greedy(40))
    for _ in range(3):  # two prefill chunks and a decode loop: the request is mid-flight
        engine.step()
    ctx = types.SimpleNamespace(model=tiny_model, engine=engine, llm=llm, tmp=tmp_path,
                                checkpoint=checkpoint)
    with pytest.raises(error, match=match):
        call(ctx)
    engine.check()
    engine.add_request("good", prompt_token_ids=GOOD, sampling_params=greedy())
    final = drive(engine)
    served = {rid for rid, out in final.items() if out.outputs[0].finish_reason != "abort"}
    assert served == {"good", "inflight"}  # others: a rejected LLM batch, withdrawn whole
    assert final["inflight"].outputs[0].token_ids == expected[0]
    assert final["good"].outputs[0].token_ids == expected[1]
    assert engine.stats().kv_pages_used == 0
