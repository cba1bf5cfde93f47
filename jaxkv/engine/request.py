"""Request state of the serving engine and its public output types (plain Python, no jax).

A user request with ``SamplingParams.n`` samples is n `Request` objects (one per sample stream)
sharing a ``request_id``: sample 0 prefills the prompt; the other n - 1 fork off it when its
prefill completes and share the prompt's pages until they write into them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Hashable

from jaxkv.engine.detokenizer import IncrementalDetokenizer
from jaxkv.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued: new, preempted, or a sample waiting for its fork
    RUNNING = "running"  # holds a slot and pages
    TRANSFERRING = "transferring"  # prefilled; its KV moves to the decode side (disaggregation)
    FINISHED = "finished"
    ABORTED = "aborted"  # aborted by the caller, or failed ("error")


@dataclasses.dataclass(eq=False)
class Request:
    """One sample stream: its tokens, its pages and how many of its tokens have KV computed."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int  # submission order: FCFS order and tie-breaks
    arrival_time: float
    sample_index: int = 0
    cache_salt: str | None = None
    key: object = None  # u32[2] raw PRNG key of this sample (set by the engine)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    pages: list[int] = dataclasses.field(default_factory=list)  # page i holds positions i*S..
    num_computed_tokens: int = 0  # leading tokens whose KV is in `pages`
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    slot: int | None = None  # state slot while running
    prefix_handle: object = None  # locked radix path while running
    prefill_end: int = 0  # len(token_ids) at admission: positions below it are prefill work
    forks: list[Request] = dataclasses.field(default_factory=list)  # samples 1..n-1, unborn
    peeked: tuple | None = None  # ((cache version, tokens), cached prefix) of the last look
    pages_offered: int = 0  # whole prompt pages already offered to the prefix cache
    window_pins: tuple[int, int] = (0, 0)  # pages [lo, hi) whose local-layer slot it pins
    skipped: int = 0  # steps that admitted a later arrival ahead of it while it waited (aging)
    detok: IncrementalDetokenizer | None = None  # its text, when the model has a tokenizer
    logprobs: list[dict[int, Logprob]] | None = None  # per output token, with logprobs=k
    emitted: tuple[int, int] = (0, 0)  # (tokens, characters) already in delta outputs
    bad_words_ids: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    # With SamplingParams.prompt_logprobs: entry p for prompt token p (entry 0 is None).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # given in a DELTA output already
    # Weight versions (`Engine.update_params`): the weights its KV was computed with (set at
    # each admission; it names the prefix-cache namespace it reads and writes), and the
    # weights that sampled each output token.
    kv_version: int | str | None = None
    token_versions: list[int | str] = dataclasses.field(default_factory=list)
    # Speculative decoding (`jaxkv.spec`): draft tokens verified for it, those
    # accepted, and whether it still speculates.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    speculating: bool = True
    idle_looks: int = 0  # looks for drafts in a row that found none
    # Structured outputs: its grammar's state (`jaxkv.structured.grammar.Matcher`).
    grammar: object = None
    error: str | None = None  # why it ended with "error", when this sample knows

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None \
                and self.sample_index == 0:  # the request's; sample 0 prefills the prompt
            self.prompt_logprobs = [None]

    @property
    def cache_namespace(self) -> Hashable:
        """Where its KV goes in the prefix cache: its salt and the weights that computed it."""
        return cache_namespace(self.cache_salt, self.kv_version)

    @property
    def needs_prompt_logits(self) -> bool:
        """Its prompt logprobs are not all computed yet (so its prompt must run whole)."""
        return self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is still to be computed (1 for a decoding sequence)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_done(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def append_token(self, token: int, eos_token_ids: Collection[int]) -> str | None:
        """Appends a sampled token; returns the finish reason if it ends the sequence.

        Stop tokens (EOS unless ignore_eos, and stop_token_ids) are kept in the output; they
        are masked at sampling until min_tokens have been generated, as in `jaxkv.generate`.
        A stop string in the text (checked once min_tokens are out) ends it with "stop", even
        at max_tokens.
        """
        self.token_ids.append(token)
        sp = self.sampling_params
        reason = sp.finish_reason(token, self.num_output_tokens, eos_token_ids)
        if self.grammar is not None and not self.grammar.consume(token):
            # the logits processors banned every token the grammar allows, or llguidance
            # cannot go on (a limit it hit): blame only the restrictions this request used
            used = [f for f in ("logit_bias", "allowed_token_ids", "bad_words") if getattr(sp, f)]
            self.error = self.grammar.refusal(token, used)
            return "error"
        if self.detok is not None and (reason != "stop" or sp.include_stop_str_in_output):
            self.detok.push(token)  # a stop token's text only with include_stop_str_in_output
            if reason != "stop" and sp.stop and self.num_output_tokens > sp.min_tokens and \
                    self.detok.find_stop():
                reason = "stop"
        if reason is None and self.grammar is not None and self.grammar.done:
            reason = "stop"  # the grammar is complete (its last token's text is kept)
        return reason

    @property
    def stop_reason(self) -> str | int | None:
        """What stopped it (vLLM's meaning): the stop string, or the stop_token_ids id
        (None for EOS, a length limit, or a running sequence)."""
        if self.detok is not None and self.detok.stop_reason is not None:
            return self.detok.stop_reason
        if self.finish_reason == "stop" and self.num_output_tokens and \
                self.token_ids[-1] in self.sampling_params.stop_token_ids:
            return self.token_ids[-1]
        return None

    def text(self, finished: bool) -> str:
        """The output text; an unfinished one holds back what a stop string may still take
        (its last ``stop_buffer`` characters, all of it while it is shorter than that)."""
        if self.detok is None:
            return ""
        text, hold = self.detok.text, 0 if finished else self.sampling_params.stop_buffer
        return text[:max(0, len(text) - hold)]


def cache_namespace(salt: str | None, version: int | str | None) -> Hashable:
    """The prefix-cache namespace of KV computed for ``salt`` with weights ``version``: KV
    of other weights (or another tenant) is never reused."""
    return salt, version


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model and its rank (1 = the most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request: its generated tokens and text so far (all of them, or only the
    new ones for ``RequestOutputKind.DELTA``), why it ended, and the stop string that ended
    it, if one did. The text is decoded incrementally as tokens arrive (empty without a
    tokenizer)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None: running
    text: str = ""
    stop_reason: str | int | None = None  # the stop string or stop_token_ids id that ended it
    # With SamplingParams.logprobs=k: per token, {id: Logprob} for the sampled token and the
    # k most likely ones (vLLM's shape); the sum of the sampled tokens' logprobs.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # The weight version (`Engine.update_params`) that sampled each token of token_ids.
    weight_versions: list[int | str] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request; ttft/tpot in seconds, None until known."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    ttft: float | None  # first token - arrival
    tpot: float | None  # (finish - first token) / (tokens - 1), longest sample
    # Speculative decoding, over its samples: draft tokens verified and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens (None before any was verified)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else None


@dataclasses.dataclass
class RequestOutput:
    """The state of a request after a step, in the shape of vLLM's RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served by the prefix cache (first admission)
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed (its finish_reason is "error")
    # With SamplingParams.prompt_logprobs=k, once the prompt has run: per prompt token, None
    # for the first, then {id: Logprob} for the token and the k most likely (vLLM's shape).
    # DELTA outputs carry it once.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started, and the KV pages now in use.

    Every admission (first or after a preemption) splits the sequence's pending tokens into
    cached (prefix-cache hit) and computed ones, so cached + computed prompt tokens equals
    prompt_tokens when nothing was preempted. kv_pages_used + kv_pages_cached + kv_pages_free
    == kv_pages_total.
    """

    prompt_tokens: int  # prompt tokens of the requests added (once per request, whatever n)
    cached_prompt_tokens: int  # served by the prefix cache at admission
    computed_prompt_tokens: int  # run through prefill, recomputation after preemption included
    generated_tokens: int  # tokens sampled
    preemptions: int
    kv_pages_total: int
    kv_pages_used: int  # held by unfinished requests
    kv_pages_cached: int  # held only by the prefix cache (evictable)
    kv_pages_free: int
    steps: int  # device steps run
    programs_compiling: int = 0  # still compiling in the background (background_warmup)
    # Of the prefix-cache hit tokens: found on the device, or brought back from the host tier
    # (``host_kv_cache_bytes``), whose pages and bytes in use are counted below.
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    host_kv_pages: int = 0
    host_kv_bytes: int = 0
    host_kv_pages_total: int = 0
    # Prefill/decode disaggregation (`DisaggregatedEngine`): requests whose KV moved from the
    # prefill pool to the decode pool, and the pages and bytes copied (pages the decode side's
    # prefix cache already held are not copied).
    kv_transfers: int = 0
    kv_pages_transferred: int = 0
    kv_bytes_transferred: int = 0
    # Window-only KV (`jaxkv.cache.window`): the local layers' pool of slots, those running
    # sequences' windows pin, those kept only for the prefix cache, and those taken back.
    window_slots_total: int = 0
    window_slots_pinned: int = 0
    window_slots_cached: int = 0
    window_slot_evictions: int = 0
    # Speculative decoding: verifications (a row with drafts in a step), draft tokens
    # verified, and those accepted. Mean accepted length = 1 + accepted / verifications.
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        total = self.cached_prompt_tokens + self.computed_prompt_tokens
        return self.cached_prompt_tokens / total if total else 0.0


def request_metrics(samples: list[Request]) -> RequestMetrics:
    """Metrics of a request from its sample streams."""
    first = [s.first_token_time for s in samples if s.first_token_time is not None]
    first_time = min(first) if first else None
    done = all(s.is_done for s in samples)
    finish = max((s.finish_time or 0.0) for s in samples) if done else None
    tpot = None
    if finish is not None and first_time is not None:
        longest = max(s.num_output_tokens for s in samples)
        if longest > 1:
            tpot = (finish - first_time) / (longest - 1)
    return RequestMetrics(
        arrival_time=samples[0].arrival_time, first_token_time=first_time, finish_time=finish,
        ttft=None if first_time is None else first_time - samples[0].arrival_time, tpot=tpot,
        num_draft_tokens=sum(s.num_draft_tokens for s in samples),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in samples))
