"""Data parallelism: M engine replicas behind one Engine-shaped front, routed by cached prefix.

Each replica is a full `Engine` (its own weights, KV pages, prefix cache and scheduler) on its
own devices (a tensor-parallel mesh of its own, or one device). A new request goes to the
replica whose prefix cache holds the longest prefix of its prompt (cache-aware routing, as in
SGLang's router), and to the least loaded replica (fewest unfinished requests, then fewest KV
pages in use) when no replica has any of it. A request stays on its replica until it finishes.
"""

from __future__ import annotations

import dataclasses

from jaxkv.engine.engine import Engine
from jaxkv.engine.request import EngineStats, RequestOutput
from jaxkv.sampling_params import SamplingParams


class ReplicatedEngine:
    """The `Engine` API (add_request, step, abort, ...) over several replicas."""

    def __init__(self, replicas: list[Engine]):
        if not replicas:
            raise ValueError("ReplicatedEngine needs at least one replica")
        self.replicas = replicas
        self.model = replicas[0].model
        self._where: dict[str, int] = {}  # unfinished request id -> replica index
        self.routed_by_prefix = self.routed_by_load = 0

    def route(self, prompt_ids: list[int], cache_salt: str | None) -> int:
        """The replica for a prompt: longest cached prefix, else least loaded."""
        def load(i):
            e = self.replicas[i]
            return len(e._requests), e.stats().kv_pages_used, i

        hits = [e.radix.match_prefix(prompt_ids[:-1], cache_salt, peek=True).num_tokens
                if e.radix is not None else 0 for e in self.replicas]
        best = max(hits)
        if best > 0:
            self.routed_by_prefix += 1
            return min((i for i, h in enumerate(hits) if h == best), key=load)
        self.routed_by_load += 1
        return min(range(len(self.replicas)), key=load)

    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids=None,
                    sampling_params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        if isinstance(request_id, str) and request_id in self._where:
            raise ValueError(f"request_id {request_id!r} is already used by an unfinished "
                             "request")
        ids = self.replicas[0]._prompt_ids(prompt, prompt_token_ids)  # validates the prompt
        i = self.route(ids, cache_salt)
        self.replicas[i].add_request(request_id, prompt, prompt_token_ids, sampling_params,
                                     cache_salt)
        self._where[request_id] = i

    def abort(self, request_id: str) -> None:
        if request_id not in self._where:
            raise ValueError(f"abort: no unfinished request with request_id {request_id!r}")
        self.replicas[self._where.pop(request_id)].abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work (their device work overlaps: dispatch is
        asynchronous until each step reads its logits back)."""
        outputs = []
        for e in self.replicas:
            if e.has_unfinished_requests() or e._pending:
                outputs += e.step()
        for out in outputs:
            if out.finished:
                self._where.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def warmup(self) -> int:
        return sum(e.warmup() for e in self.replicas)

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
