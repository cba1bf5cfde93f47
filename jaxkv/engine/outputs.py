"""Output assembly: a request's `RequestOutput` after a step, from its sample streams.

Text comes from each sample's incremental detokenizer (`jaxkv.engine.detokenizer`, which also
finds stop strings); logprobs were recorded on the samples when their tokens were read
(`jaxkv.engine.logprobs`). The output kind of the request's SamplingParams decides what goes
out: everything so far (CUMULATIVE), only what is new (DELTA), or only the final output.
"""

from __future__ import annotations

import dataclasses

from jaxkv.engine.request import CompletionOutput, Request, RequestOutput, request_metrics
from jaxkv.sampling_params import RequestOutputKind


@dataclasses.dataclass
class RequestEntry:
    """An unfinished request in an engine's request table."""

    prompt: str | None
    samples: list[Request]  # samples[j] is sample j; samples[0] prefills the prompt
    error: str | None = None  # why the request failed (finish_reason "error")

    @property
    def finished(self) -> bool:
        return all(s.is_done for s in self.samples)


def build_output(request_id: str, entry: RequestEntry) -> RequestOutput | None:
    """The request's output after a step (None when its output_kind is FINAL_ONLY and it is
    still running); DELTA outputs hold only what is new since the last one (and record what
    went out, so call it once per step)."""
    sp = entry.samples[0].sampling_params
    finished = entry.finished
    if sp.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    outs = [_completion(s, sp.output_kind) for s in entry.samples]
    first = entry.samples[0]
    prompt_lps = first.prompt_logprobs
    if prompt_lps is not None and (first.needs_prompt_logits or (
            sp.output_kind is RequestOutputKind.DELTA and first.prompt_logprobs_sent)):
        prompt_lps = None
    elif prompt_lps is not None:
        first.prompt_logprobs_sent = True
    return RequestOutput(
        request_id=request_id, prompt=entry.prompt, prompt_token_ids=first.prompt_token_ids,
        outputs=outs, finished=finished, num_cached_tokens=first.num_cached_tokens or 0,
        metrics=request_metrics(entry.samples), prompt_logprobs=prompt_lps,
        error=entry.error or next((s.error for s in entry.samples if s.error), None))


def _completion(s: Request, kind: RequestOutputKind) -> CompletionOutput:
    tokens, text = s.output_token_ids, s.text(s.is_done)
    versions = list(s.token_versions)
    if kind is RequestOutputKind.DELTA:
        (n, c), s.emitted = s.emitted, (len(tokens), len(text))
        tokens, text, versions = tokens[n:], text[c:], versions[n:]
    lps = cum = None
    if s.logprobs is not None:
        every = s.logprobs[:s.num_output_tokens]
        cum = sum(e[t].logprob for e, t in zip(every, s.output_token_ids, strict=False))
        lps = every[len(every) - len(tokens):] if tokens else []
    return CompletionOutput(index=s.sample_index, token_ids=tokens,
                            finish_reason=s.finish_reason, text=text,
                            stop_reason=s.stop_reason, logprobs=lps,
                            cumulative_logprob=cum, weight_versions=versions)
