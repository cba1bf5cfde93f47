"""Data parallelism: M engine replicas behind one Engine-shaped front, routed by cached prefix.

Each replica is a full `Engine` (its own weights, KV pages, prefix cache and scheduler) on its
own devices (a tensor-parallel mesh of its own, or one device). A new request goes to the
replica whose prefix cache holds the longest prefix of its prompt (cache-aware routing, as in
SGLang's router) when that prefix is at least ``cache_threshold`` of the prompt and that
replica is not overloaded (at most ``balance_slack`` more unfinished requests than the least
loaded); otherwise to the least loaded replica (fewest unfinished requests, then fewest KV
pages in use). So a system prompt shared by all traffic spreads over every replica instead of
pinning it to the first one that cached it. A request stays on its replica until it finishes.
"""

from __future__ import annotations

import dataclasses

from jaxkv.engine.engine import Engine
from jaxkv.engine.request import EngineStats, RequestOutput, cache_namespace
from jaxkv.engine.weights import check_in_flight, next_version
from jaxkv.sampling_params import SamplingParams


class ReplicatedEngine:
    """The `EngineClient` API (add_request, step, abort, ...) over several replicas."""

    def __init__(self, replicas: list[Engine], *, cache_threshold: float = 0.5,
                 balance_slack: int = 4):
        if not replicas:
            raise ValueError("ReplicatedEngine needs at least one replica")
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if not isinstance(balance_slack, int) or balance_slack < 0:
            raise ValueError(f"balance_slack must be an int >= 0, got {balance_slack!r}")
        self.replicas = replicas
        self.cache_threshold, self.balance_slack = cache_threshold, balance_slack
        self.model = replicas[0].model
        self._where: dict[str, int] = {}  # unfinished request id -> replica index
        self.routed_by_prefix = self.routed_by_load = 0

    def route(self, prompt_ids: list[int], cache_salt: str | None) -> int:
        """The replica for a prompt: longest cached prefix, else least loaded."""
        def load(i):
            e = self.replicas[i]
            return e.num_unfinished(), e.stats().kv_pages_used, i

        hits = [e.radix.cached_length(prompt_ids[:-1],  # device and host tiers
                                      cache_namespace(cache_salt, e.weight_version))
                for e in self.replicas]
        least = min(range(len(self.replicas)), key=load)
        best = max(hits)
        if best > 0 and best >= self.cache_threshold * (len(prompt_ids) - 1):
            cached = min((i for i, h in enumerate(hits) if h == best), key=load)
            if load(cached)[0] <= load(least)[0] + self.balance_slack:
                self.routed_by_prefix += 1
                return cached
        self.routed_by_load += 1
        return least

    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids=None,
                    sampling_params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        if isinstance(request_id, str) and request_id in self._where:
            raise ValueError(f"request_id {request_id!r} is already used by an unfinished "
                             "request")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be None or a string, got {cache_salt!r}")
        ids = self.replicas[0].prompt_ids(prompt, prompt_token_ids)  # validates the prompt
        i = self.route(ids, cache_salt)
        self.replicas[i].add_request(request_id, prompt, prompt_token_ids, sampling_params,
                                     cache_salt)
        self._where[request_id] = i

    def abort(self, request_id: str) -> None:
        if request_id not in self._where:
            raise ValueError(f"abort: no unfinished request with request_id {request_id!r}")
        self.replicas[self._where.pop(request_id)].abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work: every replica's device work is dispatched
        before any replica's tokens are read back, so the replicas compute at the same time."""
        busy = [e for e in self.replicas if e.has_work()]
        outputs = []
        for e, dispatched in [(e, e.dispatch()) for e in busy]:
            outputs += e.collect(dispatched)
        for out in outputs:  # (an aborted id may already be reused: keep the new mapping)
            i = self._where.get(out.request_id)
            if out.finished and i is not None and \
                    not self.replicas[i].has_request(out.request_id):
                del self._where[out.request_id]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def num_running(self) -> int:
        return sum(e.num_running() for e in self.replicas)

    def num_waiting(self) -> int:
        return sum(e.num_waiting() for e in self.replicas)

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    def warmup(self) -> int:
        return sum(e.warmup() for e in self.replicas)

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        return all([e.wait_for_warmup(timeout) for e in self.replicas])

    @property
    def weight_version(self) -> int | str:
        return self.replicas[0].weight_version

    def update_params(self, params, *, version: int | str | None = None,
                      in_flight: str = "restart") -> None:
        """`Engine.update_params` on every replica, under one version: each places the new
        weights on its own devices, compiling nothing. The first replica checks the input
        before any replica changes (they were all built from the same model)."""
        check_in_flight(in_flight)
        version = next_version(self.weight_version, version,
                               self.replicas[0].served_versions)
        for e in self.replicas:
            e.update_params(params, version=version, in_flight=in_flight)

    def check(self) -> None:
        for e in self.replicas:
            e.check()

    def stats(self) -> EngineStats:
        """Counters summed over the replicas (steps: the most any replica ran)."""
        per = [e.stats() for e in self.replicas]
        fields = {f.name: sum(getattr(s, f.name) for s in per)
                  for f in dataclasses.fields(EngineStats)}
        fields["steps"] = max(s.steps for s in per)
        return EngineStats(**fields)
