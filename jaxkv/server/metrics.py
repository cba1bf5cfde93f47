"""Prometheus metrics of a server, in a registry of its own (vLLM-style names, ``jaxkv:``).

Token and cache counters follow `EngineStats` (updated after every step from its deltas);
latency histograms are observed when a request finishes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def counter(name, doc):
            return Counter(f"jaxkv:{name}", doc, labels, registry=r).labels(**self._labels)

        def gauge(name, doc):
            return Gauge(f"jaxkv:{name}", doc, labels, registry=r).labels(**self._labels)

        def histogram(name, doc):
            return Histogram(f"jaxkv:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=r).labels(**self._labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests added.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens served by the prefix cache at admission.")
        self.host_hits = counter(
            "prefix_cache_host_hits", "Prompt tokens of prefix-cache hits copied back from the "
            "host-memory tier (host_kv_cache_bytes) instead of recomputed.")
        self.preemptions = counter("num_preemptions", "Requests preempted (KV recomputed).")
        self.kv_transfers = counter(
            "kv_transfers", "Requests whose KV moved from the prefill to the decode engine "
            "(prefill/decode disaggregation).")
        self.kv_transfer_pages = counter(
            "kv_transfer_pages", "KV pages copied from the prefill to the decode engine.")
        self.kv_transfer_bytes = counter(
            "kv_transfer_bytes", "Bytes of those pages (scales included).")
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Verifications of speculated drafts (one per request "
            "per step that speculated; mean accepted length = 1 + accepted / drafts).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted (acceptance rate = accepted / draft tokens).")
        self.requests = Counter("jaxkv:request_success", "Requests finished, by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.running = gauge("num_requests_running", "Requests holding KV pages.")
        self.waiting = gauge("num_requests_waiting", "Requests queued for admission.")
        self.pages_used = gauge("kv_pages_used", "KV pages held by unfinished requests.")
        self.pages_cached = gauge("kv_pages_cached",
                                  "KV pages held only by the prefix cache (evictable).")
        self.pages_free = gauge("kv_pages_free", "KV pages free.")
        self.host_pages = gauge("host_kv_pages_used", "Host-tier KV pages holding evicted "
                                "prefix-cache entries.")
        self.host_bytes = gauge("host_kv_bytes_used", "Bytes of those host-tier pages.")
        self.window_pinned = gauge("window_kv_slots_used", "Local layers' window slots held "
                                   "by running requests (window-only KV).")
        self.window_cached = gauge("window_kv_slots_cached", "Window slots kept only for the "
                                   "prefix cache (reused by a later hit, else taken back).")
        self.window_total = gauge("window_kv_slots_total", "Window slots in the pool.")
        self.compiling = gauge("programs_compiling", "Programs still compiling in the "
                               "background after start-up (background_warmup): until then "
                               "steps are capped at the largest token bucket ready.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self._last = None

    def update(self, stats, running: int, waiting: int) -> None:
        """Moves the counters by what `stats` (an EngineStats) gained since the last call."""
        last = self._last
        if last is not None:
            self.prompt_tokens.inc(stats.prompt_tokens - last.prompt_tokens)
            self.generation_tokens.inc(stats.generated_tokens - last.generated_tokens)
            queried = (stats.cached_prompt_tokens + stats.computed_prompt_tokens
                       - last.cached_prompt_tokens - last.computed_prompt_tokens)
            self.prefix_cache_queries.inc(queried)
            self.prefix_cache_hits.inc(stats.cached_prompt_tokens - last.cached_prompt_tokens)
            self.preemptions.inc(stats.preemptions - last.preemptions)
            self.host_hits.inc(stats.host_hit_tokens - last.host_hit_tokens)
            self.kv_transfers.inc(stats.kv_transfers - last.kv_transfers)
            self.kv_transfer_pages.inc(stats.kv_pages_transferred - last.kv_pages_transferred)
            self.kv_transfer_bytes.inc(stats.kv_bytes_transferred - last.kv_bytes_transferred)
            self.spec_drafts.inc(stats.spec_verifications - last.spec_verifications)
            self.spec_draft_tokens.inc(stats.spec_draft_tokens - last.spec_draft_tokens)
            self.spec_accepted_tokens.inc(stats.spec_accepted_tokens
                                          - last.spec_accepted_tokens)
        self._last = stats
        self.running.set(running)
        self.waiting.set(waiting)
        self.pages_used.set(stats.kv_pages_used)
        self.pages_cached.set(stats.kv_pages_cached)
        self.pages_free.set(stats.kv_pages_free)
        self.host_pages.set(stats.host_kv_pages)
        self.host_bytes.set(stats.host_kv_bytes)
        self.window_pinned.set(stats.window_slots_pinned)
        self.window_cached.set(stats.window_slots_cached)
        self.window_total.set(stats.window_slots_total)
        self.compiling.set(stats.programs_compiling)

    def finished(self, output) -> None:
        """Observes a finished RequestOutput's latencies."""
        m = output.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
        reason = output.outputs[0].finish_reason if output.outputs else "error"
        self.requests.labels(finished_reason=reason or "unknown", **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
