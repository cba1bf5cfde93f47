"""The host-memory KV tier end to end: an engine whose device pool keeps about two
conversations serves more, with outputs equal to the engine without the tier, prompt tokens
loaded back from host memory instead of recomputed, every freed page poisoned with NaN, and
after `warmup` no compile; bad sizes are named; a quantized pool moves its scales too."""

import numpy as np
import pytest
from test_warmup import _serve_varied

from jaxkv import Engine, SamplingParams
from jaxkv.runtime.compiles import count_compiles

SHAPE = dict(page_size=4, num_pages=24, max_num_seqs=2, max_model_len=96,
             max_num_batched_tokens=16, debug_nan_freed_pages=True)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _conversations(engine, turns=3, convs=6, salted=False):
    """Every conversation's turns in order (a turn: its history plus 3 new tokens)."""
    rng = np.random.default_rng(0)
    history = {c: rng.integers(4, 96, 20).tolist() for c in range(convs)}
    outs = {}
    for turn in range(turns):
        for c in range(convs):
            prompt = history[c] + rng.integers(4, 96, 3).tolist()
            engine.add_request(f"{c}-{turn}", prompt_token_ids=prompt, sampling_params=GREEDY,
                               cache_salt=f"user{c % 2}" if salted else None)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outs[out.request_id] = out.outputs[0].token_ids
                engine.check()
            history[c] = prompt + outs[f"{c}-{turn}"]
    return outs


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_host_tier_serves_the_same_tokens_and_recomputes_less(tiny_model, kv):
    off = Engine(tiny_model, kv_cache_dtype=kv, **SHAPE)
    on = Engine(tiny_model, kv_cache_dtype=kv, host_kv_cache_bytes=2**20, **SHAPE)
    assert _conversations(on) == _conversations(off)
    s_off, s_on = off.stats(), on.stats()
    assert s_on.host_hit_tokens > 0 and s_on.host_kv_pages > 0
    assert s_on.device_hit_tokens + s_on.host_hit_tokens == s_on.cached_prompt_tokens
    assert s_on.device_hit_tokens >= 0
    assert s_on.host_kv_bytes == s_on.host_kv_pages * on.runner.host_pool.page_bytes
    assert s_off.host_hit_tokens == 0 and s_off.host_kv_pages_total == 0
    # The history of every later turn was evicted from the device; with the tier it comes back.
    assert s_on.computed_prompt_tokens < 0.6 * s_off.computed_prompt_tokens, (s_on, s_off)
    pool = on.runner.host_pool
    assert pool.loaded_pages > 0 and pool.saved_pages >= pool.loaded_pages
    if kv == "int8":
        assert pool.scales is not None and pool.scales.any()


def test_salted_conversations_do_not_share_host_entries(tiny_model):
    on = Engine(tiny_model, host_kv_cache_bytes=2**20, **SHAPE)
    off = Engine(tiny_model, **SHAPE)
    assert _conversations(on, turns=2, salted=True) == _conversations(off, turns=2, salted=True)
    on.check()


def test_an_aborted_request_leaks_nothing_in_either_tier(tiny_model):
    engine = Engine(tiny_model, host_kv_cache_bytes=2**20, **SHAPE)
    _conversations(engine, turns=1)
    assert engine.stats().host_kv_pages > 0
    prompt = next(e.tokens for e in engine.radix.entries()  # a cached history
                  if e.salt == (None, 0) and e.start == 0)
    engine.add_request("x", prompt_token_ids=list(prompt) + [5, 6], sampling_params=GREEDY)
    engine.step()  # admitted: its history promoted from the host
    engine.abort("x")
    engine.step()
    engine.check()
    assert engine.stats().kv_pages_used == 0


def test_after_warmup_the_host_tier_compiles_nothing(tiny_model, tiny_config):
    engine = Engine(tiny_model, page_size=4, num_pages=20, max_num_seqs=4, max_model_len=64,
                    max_num_batched_tokens=24, host_kv_cache_bytes=2**20)
    assert engine.warmup() == len(engine.programs())
    assert ("host_load", 8) in engine.programs()
    with count_compiles() as serving:
        _serve_varied(engine, tiny_config.vocab_size)
        _conversations(engine, turns=2, convs=4)
    assert engine.stats().host_hit_tokens > 0
    assert serving.count == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(host_kv_cache_bytes=-1), "host_kv_cache_bytes must be an int >= 0, got -1"),
    (dict(host_kv_cache_bytes=1.5), "host_kv_cache_bytes must be an int >= 0, got 1.5"),
    # A page: 2 layers x 2 kv heads x 4 tokens x 32 lanes (K|V, head_dim 16) x 4 bytes.
    (dict(host_kv_cache_bytes=100), "host_kv_cache_bytes=100 holds no page of 2048 bytes"),
    (dict(host_kv_cache_bytes=2**20, enable_prefix_caching=False),
     "host_kv_cache_bytes needs enable_prefix_caching=True"),
])
def test_bad_host_sizes_are_named(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(tiny_model, page_size=4, num_pages=8, **kwargs)


class InjectedFault(RuntimeError):
    pass


def _turns_retrying(engine, turns=3, convs=6):
    """`_conversations`, with a turn that ended in an error sent again (same prompt, new id)."""
    rng = np.random.default_rng(0)
    history = {c: rng.integers(4, 96, 20).tolist() for c in range(convs)}
    outs, errors = {}, 0
    for turn in range(turns):
        for c in range(convs):
            prompt = history[c] + rng.integers(4, 96, 3).tolist()
            for attempt in range(3):
                engine.add_request(f"{c}-{turn}-{attempt}", prompt_token_ids=prompt,
                                   sampling_params=GREEDY)
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            final = out
                    engine.check()
                if final.error is None:
                    break
                errors += 1
            outs[f"{c}-{turn}"] = final.outputs[0].token_ids
            history[c] = prompt + outs[f"{c}-{turn}"]
    return outs, errors


def test_a_failed_host_copy_leaves_no_entry_on_unfilled_pages(plain_model, monkeypatch):
    """A run of queued copies whose save raises (the page gather runs out of memory) before
    its load ran must not leave the promoted entries in the cache: their pages were never
    filled."""
    from jaxkv.engine import host_tier

    on = Engine(plain_model, host_kv_cache_bytes=2**20, **SHAPE)
    pool, failed, kinds = on.runner.host_pool, [], []
    real_run, real_gather = pool.run, host_tier.gather_pages

    def run(state, transfers):
        kinds[:] = [t[0] for t in transfers]
        return real_run(state, transfers)

    def gather(state, pages):
        if not failed and "save" in kinds and "load" in kinds[kinds.index("save"):]:
            failed.append(list(kinds))
            raise InjectedFault("injected: a page gather ran out of memory")
        return real_gather(state, pages)

    pool.run = run
    monkeypatch.setattr(host_tier, "gather_pages", gather)
    got, errors = _turns_retrying(on)
    want, _ = _turns_retrying(Engine(plain_model, **SHAPE))
    assert failed and errors == 1  # the failing turn, then its retry went through
    assert got == want
    assert on.stats().kv_pages_used == 0
