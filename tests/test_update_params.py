"""Engine.update_params: new weights mid-serving (RL rollouts) compile nothing and serve exactly
what a fresh engine with those weights serves; no request reuses KV of other weights (either
cache tier); requests in flight restart or keep their KV, and every token records the weight
version that sampled it; bad inputs are named and change nothing.

The weights: two tiny random HF Llama checkpoints of one config, differing only in their seed
(hf_models' initializer range keeps greedy top-2 logit gaps far above fp32 rounding).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import build_hf_model, save_hf_model

import jaxkv
from jaxkv import Engine, SamplingParams
from jaxkv.engine.replicas import ReplicatedEngine
from jaxkv.engine.request import cache_namespace
from jaxkv.runtime.compiles import count_compiles
from jaxkv.sampling_params import RequestOutputKind

SHAPE = dict(page_size=8, num_pages=64, max_num_seqs=4, max_model_len=128,
             max_num_batched_tokens=32)
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(4, 256, n).tolist() for n in (9, 21, 40)]
LONG = RNG.integers(4, 256, 21).tolist()  # decodes across an update


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(old, new): same config and structure, other weights."""
    return tuple(jaxkv.load_pretrained(save_hf_model(
        build_hf_model("llama_gqa", seed=seed), tmp_path_factory.mktemp(f"seed{seed}")))
        for seed in (0, 1))


def run(engine, outs=None):
    """Steps to completion, checking the page books every step; returns every output of each
    request in order (a DELTA request's outputs are its pieces)."""
    outs = {} if outs is None else outs
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        engine.check()
    return outs


def serve(engine, prompts, tag, sp=None):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt_token_ids=p, sampling_params=sp or greedy(12))
    outs = run(engine)
    return [outs[f"{tag}{i}"][-1] for i in range(len(prompts))]


def tokens_of(outs):
    return [o.outputs[0].token_ids for o in outs]


def fresh(model, prompt, max_tokens):
    """Greedy tokens of a new engine with ``model`` alone (the oracle for served weights)."""
    return tokens_of(serve(Engine(model, **SHAPE), [prompt], "f", greedy(max_tokens)))[0]


def test_update_serves_new_weights_compiling_nothing_and_reusing_no_old_kv(models):
    old, new = models
    engine = Engine(old, **SHAPE)
    before = serve(engine, PROMPTS, "a")
    again = serve(engine, PROMPTS, "b")  # one version: the prefix cache serves the prompts
    assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in PROMPTS]
    assert tokens_of(again) == tokens_of(before)
    cached = engine.stats().cached_prompt_tokens
    with count_compiles() as compiles:  # both rounds' shapes ran above, under the old weights
        engine.update_params(new)
        after = serve(engine, PROMPTS, "c")
        repeat = serve(engine, PROMPTS, "d")
    assert compiles.count == 0
    assert engine.weight_version == 1
    want = tokens_of(serve(Engine(new, **SHAPE), PROMPTS, "e"))
    assert tokens_of(after) == want and tokens_of(repeat) == want
    assert want != tokens_of(before)  # the weights did change what greedy picks
    # No stale hit: the old weights' entries are still cached, yet nothing is reused.
    assert [o.num_cached_tokens for o in after] == [0, 0, 0]
    assert engine.radix.cached_length(PROMPTS[2][:-1], cache_namespace(None, 0)) > 0
    assert [o.num_cached_tokens for o in repeat] == [len(p) - 1 for p in PROMPTS]
    assert engine.stats().cached_prompt_tokens == cached + sum(len(p) - 1 for p in PROMPTS)
    assert [o.outputs[0].weight_versions for o in before] == [[0] * 12] * 3
    assert [o.outputs[0].weight_versions for o in after] == [[1] * 12] * 3
    assert engine.stats().kv_pages_used == 0


def _mid_decode(engine, sp):
    """Adds LONG and steps until it has tokens and a decode loop is in flight (dispatched,
    unread); returns its outputs so far."""
    engine.add_request("r", prompt_token_ids=LONG, sampling_params=sp)
    outs = {}
    while engine.loop_in_flight() is None:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        engine.check()
    assert engine.scheduler.running[0].num_output_tokens >= 2
    return outs


def _joined(outs):
    """(tokens, versions) of a DELTA request's outputs put together."""
    toks = [t for o in outs for t in o.outputs[0].token_ids]
    versions = [v for o in outs for v in o.outputs[0].weight_versions]
    assert all(len(o.outputs[0].token_ids) == len(o.outputs[0].weight_versions) for o in outs)
    return toks, versions


def test_restart_recomputes_in_flight_requests_under_the_new_weights(models):
    old, new = models
    engine = Engine(old, **SHAPE)
    sp = greedy(30, output_kind=RequestOutputKind.DELTA)
    outs = _mid_decode(engine, sp)
    k = engine.scheduler.running[0].num_output_tokens  # read and reported so far
    preemptions = engine.stats().preemptions
    engine.update_params(new, version="step-1")  # in_flight="restart"
    assert engine.loop_in_flight() is None and not engine.scheduler.running
    toks, versions = _joined(run(engine, outs)["r"])
    # The first k tokens stand; the loop in flight (sampled by the old weights) is never
    # reported; the rest continue prompt + those k tokens under the new weights.
    assert toks[:k] == fresh(old, LONG, 30)[:k]
    assert toks[k:] == fresh(new, LONG + toks[:k], 30 - k)
    assert versions == [0] * k + ["step-1"] * (30 - k)
    assert engine.stats().preemptions == preemptions + 1
    assert engine.stats().kv_pages_used == 0


def test_keep_decodes_on_with_the_old_kv_and_records_each_tokens_weights(models):
    old, new = models
    engine = Engine(old, **SHAPE)
    sp = greedy(30, output_kind=RequestOutputKind.DELTA)
    outs = _mid_decode(engine, sp)
    k = engine.scheduler.running[0].num_output_tokens
    in_flight = engine.loop_in_flight().limits[0]  # tokens the loop in flight samples (no stop)
    engine.update_params(new, in_flight="keep")
    assert engine.scheduler.running[0].num_computed_tokens > len(LONG)  # its KV stayed
    engine.add_request("n", prompt_token_ids=LONG, sampling_params=greedy(30))
    done = run(engine, outs)
    toks, versions = _joined(done["r"])
    old_part = k + in_flight  # read before the update, then the loop dispatched before it
    assert versions == [0] * old_part + [1] * (30 - old_part)
    assert toks[:old_part] == fresh(old, LONG, 30)[:old_part]
    assert toks[old_part:] != fresh(old, LONG, 30)[old_part:]  # the new weights decode on
    # A new request with the same prompt reuses none of the old weights' KV.
    n = done["n"][-1]
    assert n.num_cached_tokens == 0
    assert n.outputs[0].token_ids == fresh(new, LONG, 30)
    assert n.outputs[0].weight_versions == [1] * 30
    assert engine.stats().kv_pages_used == 0


def _replace_leaf(params, name, fn):
    """params with fn applied to the first leaf whose path names ``name``; (params, path)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    target = next(p for p in paths if name in p)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: fn(x) if jax.tree_util.keystr(p) == target else x, params), target


def test_bad_updates_are_named_and_change_nothing(models):
    old, new = models
    engine = Engine(old, **SHAPE)
    outs = _mid_decode(engine, greedy(30))
    running = engine.scheduler.running[0]
    computed, pages = running.num_computed_tokens, list(running.pages)
    wide, path = _replace_leaf(new.params, "wq", lambda x: jnp.zeros((x.shape[0], 1)))
    half, _ = _replace_leaf(new.params, "wq", lambda x: x.astype(jnp.bfloat16))
    text, _ = _replace_leaf(new.params, "wq", lambda x: "weights")
    other = jaxkv.random_model(dataclasses.replace(old.config, rope_theta=500.0))
    bad = [
        (dict(params=wide), r"params\['layers'\].*wq.* shape \(64, 1\)"),
        (dict(params=half), r"params.*wq.* dtype bfloat16"),
        (dict(params=text), r"params.*wq.* must be an array, got str"),
        (dict(params=jax.tree.leaves(new.params)), r"params\['embed'\]\.value is missing"),
        (dict(params=other), "params: the Model's config differs .* rope_theta"),
        (dict(params=new, in_flight="later"), "in_flight must be one of 'restart', 'keep'"),
        (dict(params=new, in_flight=None), "in_flight must be one of"),
        (dict(params=new, version=1.5), "version must be None, an int or a str, got 1.5"),
        (dict(params=new, version=True), "version must be None, an int or a str"),
        # The version served now: its cached KV would be reused under the new weights.
        (dict(params=new, version=0), "version=0 is the current one"),
    ]
    assert "wq" in path
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.update_params(**kwargs)
        assert engine.weight_version == 0 and engine.loop_in_flight() is not None
        assert running.num_computed_tokens == computed and running.pages == pages
        engine.check()
    done = run(engine, outs)["r"][-1].outputs[0]
    assert done.token_ids == fresh(old, LONG, 30) and done.weight_versions == [0] * 30
    stats = engine.stats()
    assert stats.kv_pages_used == 0 and stats.preemptions == 0
    assert stats.kv_pages_cached + stats.kv_pages_free == stats.kv_pages_total
    # Versions: an int counts on by default; a str must be followed by an explicit one.
    engine.update_params(new.params, version=5)  # a params pytree, as a trainer holds it
    engine.update_params(old)
    assert engine.weight_version == 6
    with pytest.raises(ValueError, match="version=5 is one served before"):  # 5's KV may be cached
        engine.update_params(new, version=5)
    engine.update_params(new, version="rl-7")
    with pytest.raises(ValueError, match="version: the current weight version 'rl-7' is not"):
        engine.update_params(old)
    assert tokens_of(serve(engine, PROMPTS[:1], "s")) == [fresh(new, PROMPTS[0], 12)]


def test_host_tier_entries_of_old_weights_are_not_reused(models):
    old, new = models
    engine = Engine(old, host_kv_cache_bytes=2**20, **SHAPE)  # SHAPE: programs compiled
    first, *others = [RNG.integers(4, 256, 100).tolist() for _ in range(6)]
    serve(engine, [first], "a")
    serve(engine, others, "b")  # 5 x 14 pages: pushes the first prompt's entry to the host
    ns = cache_namespace(None, 0)
    assert engine.radix.match_prefix(first[:-1], ns, peek=True).num_tokens < len(first) - 1
    assert engine.radix.cached_length(first[:-1], ns) == len(first) - 1  # on the host
    host_hits = engine.stats().host_hit_tokens
    engine.update_params(new)
    out = serve(engine, [first], "c")[0]
    assert out.num_cached_tokens == 0 and engine.stats().host_hit_tokens == host_hits
    assert out.outputs[0].token_ids == fresh(new, first, 12)
    again = serve(engine, [first], "e")[0]  # the new weights' own entry does hit
    assert again.num_cached_tokens == len(first) - 1
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_replicas_and_llm_update_every_engine(models):
    old, new = models
    want = tokens_of(serve(Engine(new, **SHAPE), PROMPTS, "w"))
    replicated = ReplicatedEngine([Engine(old, **SHAPE), Engine(old, seed=1, **SHAPE)])
    serve(replicated, PROMPTS, "a")
    replicated.update_params(new)
    assert [e.weight_version for e in replicated.replicas] == [1, 1]
    after = serve(replicated, PROMPTS, "b")
    assert tokens_of(after) == want
    assert [o.num_cached_tokens for o in after] == [0, 0, 0]
    assert replicated.routed_by_prefix == 0  # old entries do not attract the new requests
    with pytest.raises(ValueError, match="in_flight"):
        replicated.update_params(old, in_flight="never")
    assert [e.weight_version for e in replicated.replicas] == [1, 1]
    llm = jaxkv.LLM(old, **SHAPE, warmup=False)
    llm.update_params(new, version=3)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(12), use_tqdm=False)
    assert tokens_of(outs) == want and llm.engine.weight_version == 3
    assert llm.model.params is new.params


def test_a_quantized_llm_keeps_what_it_serves_after_a_float_update(models):
    """A float Model given to a quantized LLM: the engine serves it quantized, and so does
    ``llm.model`` (which then updates and builds an LLM like any quantized model)."""
    old, new = models
    llm = jaxkv.LLM(old, **SHAPE, quantization="int8", warmup=False)
    llm.update_params(new)
    want = tokens_of(llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(12),
                                  use_tqdm=False))
    oracle = jaxkv.quantize(new, "int8")
    assert llm.model.quantization == oracle.quantization
    assert jax.tree.structure(llm.model.params) == jax.tree.structure(oracle.params)
    for a, b in zip(jax.tree.leaves(llm.model.params), jax.tree.leaves(oracle.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert tokens_of(serve(Engine(oracle, **SHAPE), PROMPTS, "q")) == want
    llm.update_params(llm.model)  # its own model: the same structure as what it serves
    again = jaxkv.LLM(llm.model, **SHAPE, warmup=False)
    assert tokens_of(again.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(12),
                                    use_tqdm=False)) == want
