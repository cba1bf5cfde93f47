"""Isolation between tenants: requests with different ``cache_salt`` never share a page and
never see each other's prefix-cache hits, running together or one after the other.

(Stale-page isolation, reads of freed pages, is shown by the NaN-poisoning test in
test_engine_traces.py.)
"""

import numpy as np

from jaxkv import Engine, SamplingParams
from jaxkv.engine.request import cache_namespace

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_different_salts_never_share_pages_or_hits(tiny_model, tiny_config):
    prompt = np.random.default_rng(4).integers(4, tiny_config.vocab_size, 40).tolist()
    engine = Engine(tiny_model, page_size=8, num_pages=64, max_num_seqs=8, max_model_len=128,
                    max_num_batched_tokens=64)
    tenants = ["alice", "bob", None, "alice"]  # None: the unsalted namespace
    engine.add_request("alice-1", prompt_token_ids=prompt, sampling_params=GREEDY,
                       cache_salt="alice")
    engine.step()  # alice's prompt is computed and offered to her cache namespace
    for i, salt in enumerate(tenants[1:], start=2):
        engine.add_request(f"{salt}-{i}", prompt_token_ids=prompt, sampling_params=GREEDY,
                           cache_salt=salt)
    final, overlaps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check()
        by_salt = {}
        for r in engine.scheduler.running:
            by_salt.setdefault(r.cache_salt, set()).update(r.pages)
        salts = list(by_salt)
        overlaps += sum(bool(by_salt[a] & by_salt[b])
                        for i, a in enumerate(salts) for b in salts[i + 1:])
    assert overlaps == 0
    assert final["bob-2"].num_cached_tokens == final["None-3"].num_cached_tokens == 0
    assert final["alice-4"].num_cached_tokens == len(prompt) - 1  # same tenant: a hit
    outputs = {out.outputs[0].token_ids == final["alice-1"].outputs[0].token_ids
               for out in final.values()}
    assert outputs == {True}
    # Each served tenant has its own copy; a new tenant finds nothing of anyone's.
    assert engine.radix.match_prefix(prompt, cache_namespace("bob", 0)).num_tokens >= len(prompt)
    assert engine.radix.match_prefix(prompt, cache_namespace("carol", 0)).num_tokens == 0
