"""Window-only KV: local (sliding-window) layers keep only the pages their window can read.

The host books (`jaxkv.cache.window.WindowSlots`) are checked directly; then engines with the
local layers in a pool far smaller than the page pool, against transformers' greedy tokens
and against the same engine keeping every token (identical logprobs), with prefix hits that
must be capped, preemption, forks, aborts, decode loops and int8 pages, `Engine.check()` (which
checks the slots' books too) after every step.
"""

import numpy as np
import pytest
from hf_models import build_hf_model, save_hf_model
from serving import drive
from test_hf_oracle import _hf_greedy

import jaxkv
from jaxkv.cache.window import OutOfSlotsError, WindowSlots, first_page, slots_needed
from jaxkv.config import EngineConfig
from jaxkv.engine.pool_plan import plan_kv_pool
from jaxkv.runtime.batch import WindowTable

# make test's time: one of each engine check per model in CI; the rest under -m slow
# (tests/conftest.py reads SLOW).
SLOW = {"test_window_kv_serves_exactly_what_keeping_every_token_serves[gemma3-auto]",
        "test_window_kv_serves_exactly_what_keeping_every_token_serves[mistral_swa-int8]",
        "test_a_copy_source_freed_by_the_same_plan_keeps_its_slot_until_the_plan_is_built"
        "[mistral_swa]",
        "test_a_long_generation_pins_only_its_window[mistral_swa]"}

# ---- the host books --------------------------------------------------------------------


def test_first_page_is_the_first_page_the_window_reaches():
    # a query at position 40 with a window of 16 sees keys 25..40: pages of 8 from index 3
    assert first_page(40, 16, 8) == 3
    assert first_page(23, 16, 8) == 1  # keys 8..23
    assert first_page(24, 16, 8) == 1  # keys 9..24: 9 is still in page 1
    assert first_page(10, 16, 8) == 0


def test_pins_idle_slots_and_eviction_oldest_first():
    w = WindowSlots(3, window=16, page_size=8)
    a, b, c = w.pin(10), w.pin(11), w.pin(12)
    assert sorted((a, b, c)) == [0, 1, 2] and w.num_pinned == 3
    with pytest.raises(OutOfSlotsError):
        w.pin(13)
    w.unpin(11)
    w.unpin(10)  # idle: 11 first, then 10
    assert (w.num_pinned, w.num_idle) == (1, 2)
    assert w.pin(11) == b  # an idle slot pinned again keeps its contents
    w.unpin(11)
    assert w.pin(13) == a  # the oldest idle slot (page 10's) is taken back
    assert 10 not in w.slot_of and w.evictions == 1
    w.check(holders=[[12], [13]])
    with pytest.raises(AssertionError, match="pins"):
        w.check(holders=[[12], [13], [13]])


def test_a_dropped_page_frees_its_slot_and_a_pinned_one_cannot_be_dropped():
    w = WindowSlots(2, window=16, page_size=8)
    w.pin(5)
    with pytest.raises(ValueError, match="holders"):
        w.dropped(5)
    w.unpin(5)
    w.dropped(5)
    assert w.slot_of == {} and w.num_idle == 0
    w.dropped(99)  # a page that never had a slot: nothing to do
    w.check(holders=[])


def test_usable_prefix_ends_where_the_window_still_has_every_slot():
    w = WindowSlots(8, window=16, page_size=8)
    pages = [100, 101, 102, 103, 104, 105]  # a cached prefix of 45 tokens (6 pages)
    for p in (101, 102, 103, 104, 105):
        w.pin(p)
    assert w.usable_prefix(pages, 45) == 45  # a query at 45 sees pages 3..5
    w.unpin(104)
    w.dropped(104)
    # 45 needs pages 3..5 (104 lost); whole pages before it: 32 needs pages 2..3
    assert w.usable_prefix(pages, 45) == 32
    w.unpin(103)
    w.dropped(103)
    assert w.usable_prefix(pages, 45) == 24  # needs pages 1..2
    assert w.usable_prefix(pages, 0) == 0


def test_window_table_points_pages_out_of_the_window_at_the_null_slot():
    w = WindowSlots(6, window=16, page_size=8)
    pages = [7, 8, 9, 10]
    for p in pages[1:]:
        w.pin(p)
    t = WindowTable(2, 6, w)
    t.update(1, pages, start=26, owner="a")  # sees keys 11..26: pages 1..3
    assert t.table[1].tolist() == [w.null, w.slot_of[8], w.slot_of[9], w.slot_of[10],
                                   w.null, w.null]
    w.pin(11)
    t.update(1, pages + [11], start=33, owner="a")  # keys 18..33: pages 2..4
    assert t.table[1].tolist() == [w.null, w.null, w.slot_of[9], w.slot_of[10],
                                   w.slot_of[11], w.null]
    with pytest.raises(ValueError, match="page 7 has no window slot"):
        t.update(0, pages, start=8, owner="b")


def test_slots_needed_grows_with_the_window_not_the_context():
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, decode_steps=8)
    assert slots_needed(512, 16, **kw) < slots_needed(1024, 16, **kw)
    # per sequence: the window's 32 pages, 3 more, one decode loop pair's 1; then 4 chunks
    assert slots_needed(512, 16, **kw) == 4 * (32 + 3 + 1) + 4


# ---- engines -----------------------------------------------------------------------------

RNG = np.random.default_rng(11)
SHARED = RNG.integers(3, 256, 41).tolist()  # past the 16-token window, not page-aligned
PROMPTS = [SHARED + RNG.integers(3, 256, int(n)).tolist() for n in (5, 22, 13)] + \
          [RNG.integers(3, 256, 37).tolist()]
NEW = 40
# 96 pages, but the local layers get only what 4 windows of 16 tokens pin (28 slots): slots
# are taken back from finished requests' windows, so later prefix hits are capped.
SHAPE = dict(page_size=8, num_pages=96, max_num_seqs=4, max_num_batched_tokens=32,
             max_model_len=160, max_decode_steps=4, warmup=False)


@pytest.fixture(scope="module", params=["gemma3", "mistral_swa"])
def pair(request, tmp_path_factory):
    hf = build_hf_model(request.param)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, jaxkv.load_pretrained(folder, scan_layers=False)


def _serve(model, prompts, sp, **kw):
    engine = jaxkv.Engine(model, **{**SHAPE, **kw})
    engine.add_request("0", prompt_token_ids=prompts[0], sampling_params=sp)
    drive(engine)  # its pages go to the prefix cache
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(str(i), prompt_token_ids=p, sampling_params=sp)
    final = drive(engine)
    return engine, [final[str(i)] for i in range(1, len(prompts))]


def test_local_layers_store_only_their_window_and_match_transformers(pair):
    hf, model = pair
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    engine, outs = _serve(model, PROMPTS, sp)
    w = engine.window
    assert w is not None and w.num_slots == 28 < engine.num_pages
    local = model.config.num_local_layers
    assert engine.state.window_pages.shape[:3] == (local, model.config.num_kv_heads, 29)
    assert engine.state.kv_pages.shape[0] == model.config.num_layers - local
    stats = engine.stats()
    assert stats.window_slot_evictions > 0 and stats.window_slots_pinned == 0
    assert stats.cached_prompt_tokens > 0
    for out, prompt in zip(outs, PROMPTS[1:], strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, NEW)


def _trace(engine, seed: int):
    """Requests with shared prefixes, n = 2 forks, a temperature sample, an abort mid-way
    and a pool small enough to preempt; returns each finished request's (tokens, logprobs)."""
    rng = np.random.default_rng(seed)
    got, step = {}, 0
    for i in range(7):
        prompt = (SHARED[:int(rng.integers(8, 41))] if i % 2 else []) + \
            rng.integers(3, 256, int(rng.integers(3, 30))).tolist()
        sp = jaxkv.SamplingParams(temperature=0.8 if i == 3 else 0, seed=i, n=2 if i == 5 else 1,
                                  max_tokens=int(rng.integers(30, 70)), ignore_eos=True,
                                  logprobs=1)
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [(c.token_ids, [lp[t].logprob for t, lp in
                                                      zip(c.token_ids, c.logprobs, strict=True)])
                                       for c in out.outputs]
        engine.check()
        step += 1
        if step == 12 and engine.has_request("r4"):
            engine.abort("r4")
    return got


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_window_kv_serves_exactly_what_keeping_every_token_serves(pair, kv_cache_dtype):
    _, model = pair
    # two sequences at a time (16 slots pinned at most), and 18 pages: preemption
    kw = dict(SHAPE, num_pages=18, max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
    windowed = jaxkv.Engine(model, **kw, num_window_slots=16)
    full = jaxkv.Engine(model, **kw, window_kv=False)
    assert windowed.window is not None and full.window is None
    a, b = _trace(windowed, 3), _trace(full, 3)
    assert a.keys() == b.keys() and len(a) == 7  # r4 aborted (reported, as finished)
    for rid in a:
        for (ta, la), (tb, lb) in zip(a[rid], b[rid], strict=True):
            assert ta == tb, rid
            np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)
    assert windowed.stats().preemptions > 0
    w = windowed.window
    assert w.num_pinned == 0  # every pin let go; the idle slots are the cache's
    assert w.num_idle == len(w.slot_of)


def test_a_long_generation_pins_only_its_window(pair):
    _, model = pair
    engine = jaxkv.Engine(model, **dict(SHAPE, max_model_len=400, num_pages=60),
                          num_window_slots=28)
    engine.add_request("long", prompt_token_ids=PROMPTS[0], sampling_params=jaxkv.SamplingParams(
        temperature=0, max_tokens=300, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
        most = max(most, engine.window.num_pinned)
    # 2 pages of window, the page being written, and two decode loops' reservations
    assert 0 < most <= 5
    assert engine.stats().kv_pages_cached * 8 >= len(PROMPTS[0]) + 299  # pages: everything


def test_window_kv_is_off_where_it_saves_nothing_or_cannot_apply(pair):
    _, model = pair
    assert jaxkv.Engine(model, **dict(SHAPE, num_pages=28)).window is None  # 28 slots needed
    assert jaxkv.Engine(model, **SHAPE, window_kv=False).window is None
    assert jaxkv.Engine(model, **SHAPE, host_kv_cache_bytes=1 << 20).window is None
    assert jaxkv.Engine(model, **dict(SHAPE, max_model_len=16)).window is None
    with pytest.raises(ValueError, match="num_window_slots=8 is below the 28 slots"):
        jaxkv.Engine(model, **SHAPE, num_window_slots=8)


def test_the_pool_plan_spends_memory_on_pages_not_on_old_windows(pair):
    _, model = pair
    memory = 1 << 20
    cfg = EngineConfig.from_kwargs(page_size=8, max_num_seqs=4, max_model_len=160,
                                   max_num_batched_tokens=32, max_decode_steps=4,
                                   kv_cache_memory_bytes=memory)
    windowed = plan_kv_pool(model, cfg, 1, None)
    full = plan_kv_pool(model, EngineConfig.from_kwargs(cfg, window_kv=False), 1, None)
    assert windowed.window_slots >= 28 and full.window_slots == 0
    assert windowed.bytes <= memory and full.bytes <= memory
    if windowed.bytes_per_token:  # full-attention layers: the same memory holds more pages
        assert windowed.pages > full.pages
    else:  # every layer local (Mistral): pages cost nothing, max_num_seqs sequences fit
        assert windowed.full_sequences >= 4 and windowed.window_slots >= 28


def test_a_copy_source_freed_by_the_same_plan_keeps_its_slot_until_the_plan_is_built(pair):
    # P (n = 2, a partly filled last page) forks; next step P copies that shared page on
    # write, then R's new page finds the pool full and preempts P's sibling, the page's last
    # holder: the copy's source is freed by the plan that copies it.
    _, model = pair
    engine = jaxkv.Engine(model, page_size=8, num_pages=5, num_window_slots=5, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=64, max_decode_steps=1,
                          enable_prefix_caching=False, warmup=False)
    sp = dict(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("P", prompt_token_ids=PROMPTS[0][:13],
                       sampling_params=jaxkv.SamplingParams(n=2, **sp))
    engine.add_request("R", prompt_token_ids=PROMPTS[3][:16],
                       sampling_params=jaxkv.SamplingParams(**sp))
    final = drive(engine)
    assert engine.stats().preemptions > 0
    assert engine.window.num_pinned == 0 and engine.allocator.num_free == 5
    alone = jaxkv.Engine(model, **dict(SHAPE, enable_prefix_caching=False), window_kv=False)
    alone.add_request("P", prompt_token_ids=PROMPTS[0][:13],
                      sampling_params=jaxkv.SamplingParams(n=2, **sp))
    want = drive(alone)["P"].outputs
    assert [c.token_ids for c in final["P"].outputs] == [c.token_ids for c in want]


def test_the_plan_keeps_every_token_where_the_windows_would_cost_as_much(pair):
    # 20 pages of every layer fit; the windows of 4 sequences need 28 slots
    _, model = pair
    c = model.config
    page = c.num_layers * c.num_kv_heads * 2 * c.head_dim * 4 * 8  # fp32, every layer
    cfg = EngineConfig.from_kwargs(page_size=8, max_num_seqs=4, max_model_len=160,
                                   max_num_batched_tokens=32, max_decode_steps=4,
                                   kv_cache_memory_bytes=20 * page)
    plan = plan_kv_pool(model, cfg, 1, None)
    assert (plan.window_slots, plan.pages, plan.bytes_per_token * 8) == (0, 20, page)
    assert plan.bytes <= 20 * page
