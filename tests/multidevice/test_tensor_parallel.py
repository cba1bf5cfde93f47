"""Tensor and data parallelism on virtual CPU devices: the same greedy tokens as one device,
each device holding 1/tp of the weights and KV pages, and the host side (prefix cache,
preemption) unchanged under tp = 2."""

import dataclasses

import jax
import numpy as np
import pytest
from serving import drive

import jaxkv
from jaxkv import LLM, Engine, SamplingParams
from jaxkv.model.loading import save_params
from jaxkv.runtime.compiles import count_compiles
from jaxkv.sharding import bytes_per_device, make_mesh, shard

BASE = jaxkv.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                         eos_token_ids=(3,))
# name: (config, layers stacked and scanned as on GPU/TPU, or a list looped as on CPU)
CONFIGS = {"gqa": (BASE, False), "mqa": (dataclasses.replace(BASE, num_kv_heads=1), False),
           "gqa-scan": (BASE, True)}
SHAPE = dict(page_size=8, num_pages=64, max_num_seqs=8, max_model_len=128,
             max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
RNG = np.random.default_rng(0)
SHARED = RNG.integers(4, 128, 20).tolist()
PROMPTS = [SHARED + RNG.integers(4, 128, int(n)).tolist() for n in (3, 9, 17)] + \
          [RNG.integers(4, 128, int(n)).tolist() for n in (5, 30, 2)]


def spec(x) -> tuple:
    """The PartitionSpec of an array, padded with None to its rank."""
    s = tuple(x.sharding.spec)
    return s + (None,) * (x.ndim - len(s))


def test_eight_virtual_devices():
    assert jax.device_count() == 8


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    config, scan = CONFIGS[request.param]
    m = jaxkv.random_model(config, seed=1, scan_layers=scan)
    module = m.module()
    module.embed.set_value(module.embed[...] * 25.0)  # sharp logits: clear greedy winners
    return jaxkv.Model.from_module(module)


@pytest.fixture(scope="module")
def one_device(model):
    outs = LLM(model, **SHAPE, warmup=False).generate(prompt_token_ids=PROMPTS,
                                                      sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("tp, dp", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_greedy_tokens_equal_one_device(model, one_device, tp, dp):
    llm = LLM(model, tensor_parallel_size=tp, data_parallel_size=dp, **SHAPE, warmup=False)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == one_device
    engines = llm.engine.replicas if dp > 1 else [llm.engine]
    used = {d for e in engines for d in e.state.kv_pages.sharding.device_set}
    assert len(used) == tp * dp  # each replica on its own devices
    if dp > 1:  # a second round follows the cached prefixes to the replicas holding them
        assert llm.engine.routed_by_prefix == 0 and llm.engine.routed_by_load == len(PROMPTS)
        again = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == one_device
        assert llm.engine.routed_by_prefix == len(PROMPTS)
        assert all(o.num_cached_tokens == len(p) - 1 for o, p in zip(again, PROMPTS,
                                                                     strict=True))


@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_holds_its_share(model, tp):
    engine = Engine(model, mesh=make_mesh(tp), **SHAPE)
    params, state = engine.model.params, engine.state
    c = engine.model.config
    assert c.num_kv_heads == max(tp, model.config.num_kv_heads)  # replicated only if needed
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        shard_shape = x.addressable_shards[0].data.shape
        for axis, name in enumerate(spec(x)):
            want = x.shape[axis] // tp if name == "tp" else x.shape[axis]
            assert shard_shape[axis] == want, (jax.tree_util.keystr(path), spec(x))
    split = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
             if "tp" in x.sharding.spec]
    for name in ("embed", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert any(f"'{name}'" in k for k in split), name
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    replicated = sum(x.nbytes for x in jax.tree.leaves(params) if "tp" not in x.sharding.spec)
    per_device = bytes_per_device(params)
    assert len(per_device) == tp
    assert all(b == (total - replicated) // tp + replicated for b in per_device)
    assert replicated < 0.01 * total  # only the norm scales
    kv = bytes_per_device(state.kv_pages)
    assert kv == [state.kv_pages.nbytes // tp] * tp
    assert spec(state.kv_pages) == (None, "tp", None, None, None)
    assert state.kv_pages.addressable_shards[0].data.shape[1] == c.num_kv_heads // tp
    # A step keeps the layout (so the donated buffers are reused in place).
    engine.add_request("a", prompt_token_ids=PROMPTS[0], sampling_params=GREEDY)
    engine.step()
    assert spec(engine.state.kv_pages) == (None, "tp", None, None, None)
    assert bytes_per_device(engine.state.kv_pages) == kv


def test_prefix_caching_and_preemption_under_tp2(model):
    engine = Engine(model, mesh=make_mesh(2), **dict(SHAPE, num_pages=14))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=GREEDY)
    final = drive(engine)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.cached_prompt_tokens > 0
    want = jaxkv.generate(model, PROMPTS, GREEDY, page_size=8)
    assert [final[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == want


def test_shard_is_functional(model):
    mesh = make_mesh(2)
    sharded = shard(model, mesh)
    assert sharded is not model
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(model.params))
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(sharded.params))


def test_bad_parallel_sizes_are_named(model):
    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide num_heads=4"):
        LLM(model, tensor_parallel_size=8, **SHAPE, warmup=False)
    with pytest.raises(ValueError, match="needs 16 devices; 8 available"):
        LLM(model, tensor_parallel_size=4, data_parallel_size=4, **SHAPE, warmup=False)
    with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
        LLM(model, data_parallel_size=0, **SHAPE, warmup=False)


def test_checkpoint_loads_into_shards(model, one_device, tmp_path):
    save_params(model.module(), tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **SHAPE, warmup=False)
    params = llm.engine.model.params
    assert all(isinstance(x, jax.Array) and len(x.sharding.device_set) == 2
               for x in jax.tree.leaves(params))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == one_device


def test_after_warmup_tp2_serving_compiles_nothing(model):
    engine = Engine(model, mesh=make_mesh(2), **dict(SHAPE, num_pages=14,
                                                      max_num_batched_tokens=16))
    engine.warmup()
    with count_compiles() as serving:
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), prompt_token_ids=p, sampling_params=GREEDY)
        drive(engine)
    assert engine.stats().preemptions > 0 and engine.stats().cached_prompt_tokens > 0
    assert serving.count == 0


@pytest.mark.parametrize("impl", ["interpret", "interpret-tpu"])
def test_pallas_kernels_run_per_device_inside_shard_map(impl):
    model = jaxkv.random_model(BASE, seed=1)
    module = model.module()
    module.embed.set_value(module.embed[...] * 25.0)
    model = jaxkv.Model.from_module(module)
    prompts = PROMPTS[:2]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = jaxkv.generate(model, prompts, sp, page_size=8)
    engine = Engine(model, mesh=make_mesh(2), attention_impl=impl, **SHAPE)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=sp)
    final = drive(engine)
    assert [final[str(i)].outputs[0].token_ids for i in range(2)] == want


@pytest.mark.parametrize("tp", [2, 4])
def test_int8_pages_and_scales_shard_by_kv_head(model, tp):
    """Quantized pages and their scales split by kv head; with prefix hits and preemption
    the greedy tokens equal int8 on one device (the same quantized KV, computed per shard)."""
    shape = dict(SHAPE, num_pages=14, kv_cache_dtype="int8")
    want = jaxkv.generate(model, PROMPTS, GREEDY, page_size=8, kv_cache_dtype="int8")
    engine = Engine(model, mesh=make_mesh(tp), **shape)
    state = engine.state
    assert spec(state.kv_scales) == (None, "tp", None, None)
    assert bytes_per_device(state.kv_scales) == [state.kv_scales.nbytes // tp] * tp
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=GREEDY)
    final = drive(engine)
    assert engine.stats().preemptions > 0 and engine.stats().cached_prompt_tokens > 0
    assert [final[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == want
    assert spec(engine.state.kv_scales) == (None, "tp", None, None)
    assert spec(engine.state.kv_pages) == (None, "tp", None, None, None)


def test_host_tier_under_tp2_with_int8_pages(model):
    """Conversations over a small pool with the host tier, int8 pages split by kv head: the
    saved and loaded pages (values and scales) gather from and scatter to every shard, and the
    greedy tokens equal one device without the tier."""
    shape = dict(SHAPE, num_pages=12, max_num_seqs=2, kv_cache_dtype="int8")
    on = Engine(model, mesh=make_mesh(2), host_kv_cache_bytes=2**20, **shape)
    off = Engine(model, **shape)
    outs = {}
    for engine in (on, off):
        history = {c: list(PROMPTS[c]) for c in range(4)}
        for turn in range(2):
            for c in range(4):
                prompt = history[c] + [5 + turn, 6]
                engine.add_request(f"{c}-{turn}", prompt_token_ids=prompt, sampling_params=GREEDY)
                out = drive(engine)[f"{c}-{turn}"].outputs[0].token_ids
                outs.setdefault(id(engine), []).append(out)
                history[c] = prompt + out
                engine.check()
    assert outs[id(on)] == outs[id(off)]
    assert on.stats().host_hit_tokens > 0
    assert spec(on.state.kv_scales) == (None, "tp", None, None)


def test_update_params_under_tp2_compiles_nothing_and_matches_a_fresh_engine():
    """New weights given as an unsharded params pytree (as a trainer holds them) land on a
    tp=2 mesh whose engine replicated the model's one kv head: each leaf placed like the one
    it replaces, nothing compiled, and the greedy tokens those of a fresh tp=2 engine."""
    old, new = (jaxkv.random_model(CONFIGS["mqa"][0], seed=s) for s in (1, 2))

    def serve(engine, tag):
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"{tag}{i}", prompt_token_ids=p, sampling_params=GREEDY)
        final = drive(engine)
        return [final[f"{tag}{i}"].outputs[0] for i in range(len(PROMPTS))]

    engine = Engine(old, mesh=make_mesh(2), **SHAPE)
    assert engine.model.config.num_kv_heads == 2  # the one kv head, stored twice
    before = serve(engine, "a")
    layout = [(x.shape, x.sharding) for x in jax.tree.leaves(engine.model.params)]
    with count_compiles() as compiles:
        engine.update_params(new.params)
        after = serve(engine, "b")
    assert compiles.count == 0
    assert [(x.shape, x.sharding) for x in jax.tree.leaves(engine.model.params)] == layout
    want = serve(Engine(new, mesh=make_mesh(2), **SHAPE), "c")
    assert [o.token_ids for o in after] == [o.token_ids for o in want]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert all(o.weight_versions == [1] * len(o.token_ids) for o in after)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_quantized_weights_split_and_serve_like_one_device(scheme):
    """Quantized weights (integers, scales, offsets) split over tp like the float ones: the
    same greedy tokens as one device, each device holding its share of the integers."""
    model = jaxkv.random_model(BASE, seed=1, quantization=scheme)
    want = LLM(model, **SHAPE, warmup=False).generate(
        prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    llm = LLM(model, tensor_parallel_size=2, **SHAPE, warmup=False)
    got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    ints = [x for x in jax.tree.leaves(llm.engine.model.params) if x.dtype.kind in "iu"]
    assert ints and all(spec(x).count("tp") == 1 for x in ints)
    total = sum(x.nbytes for x in ints)
    assert sum(bytes_per_device(ints)) == total and max(bytes_per_device(ints)) == total // 2


@pytest.mark.parametrize("split", ["column", "row"])
def test_quantized_kernel_runs_on_each_shard(split):
    """Under tp=2 the CPU kernel (a custom call, which the partitioner cannot split) runs per
    device on half the integers, and the result equals one device's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxkv.model.quant import QuantScheme, qdot, quantize

    rng = np.random.default_rng(0)
    w = jax.tree.map(jax.numpy.asarray,
                     quantize(rng.standard_normal((256, 128)).astype(np.float32),
                              QuantScheme(4, 32)))
    x = jax.numpy.asarray(rng.standard_normal((3, 256)).astype(np.float32))
    mesh = make_mesh(2)
    w_spec = P(None, "tp") if split == "column" else P("tp", None)
    w = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, w_spec)), w)

    def f(x, w):
        return qdot(x, w, jax.numpy.float32, kernel="cpu", split=split, mesh=mesh)

    hlo = jax.jit(f).lower(x, w).compile().as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxkv_quantized_matmul"'
             in line]
    local_q = "u8[128,64]" if split == "column" else "u8[64,128]"  # q is u8[128, 128] whole
    assert calls and all(local_q in c for c in calls), calls
    gathered = [line for line in hlo.splitlines() if " all-gather(" in line and "= u8[" in line]
    assert not gathered  # the integers never move
    want = qdot(x, jax.device_get(w), jax.numpy.float32, kernel="cpu")
    np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(want), rtol=1e-5, atol=1e-5)
