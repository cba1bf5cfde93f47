"""Logprobs of generated and prompt tokens: dispatching their programs, and the host records.

Both come as vLLM shapes them: per token, ``{id: Logprob}`` with the token itself first (its
logprob and rank under the raw logits), then the k most likely. Prompt logprobs score every
prompt token after the first from the step's hidden states, in blocks of
``PROMPT_LOGPROBS_BLOCK`` positions (one program per token bucket of the step).
"""

from __future__ import annotations

import numpy as np

from jaxkv.engine.request import Logprob
from jaxkv.sampling_params import MAX_LOGPROBS

PROMPT_LOGPROBS_BLOCK = 128  # prompt positions scored per program call


def entry(token: int, logprob, rank, top_ids, top_logprobs, name) -> dict[int, Logprob]:
    """{id: Logprob} in vLLM's order: the token itself first, then the top k by rank."""
    out = {token: Logprob(float(logprob), int(rank), name(token))}
    for j, (i, v) in enumerate(zip(top_ids, top_logprobs, strict=True)):
        out.setdefault(int(i), Logprob(float(v), j + 1, name(int(i))))
    return out


def namer(tokenizer):
    return (lambda i: tokenizer.decode([i])) if tokenizer is not None else (lambda i: None)


def record_logprobs(rows, k: int, tokens, lp, tokenizer) -> None:
    """Appends sample k's logprobs of this step to each row's sequence that asked: the
    sampled token's, and the top SamplingParams.logprobs ones'."""
    chosen, rank, ids, top = lp
    name = namer(tokenizer)
    for r in rows:
        if len(r.samples) <= k or r.samples[k].logprobs is None or r.num_draft:
            continue  # (a speculating row's come with its verification)
        seq, b = r.samples[k], r.slot
        n = seq.sampling_params.logprobs
        seq.logprobs.append(entry(int(tokens[b]), chosen[b], rank[b], ids[b, :n], top[b, :n],
                                  name))


def dispatch_prompt_logprobs(steps, params, rows, cu_q_lens, hidden):
    """Dispatches the prompt logprobs this step's chunks give (chunk position p scores prompt
    token p + 1): ((sequence, target position) per entry, device outputs per block), or None
    when no row asks."""
    idx, targets, where = [], [], []
    for r in rows:
        seq = r.request
        if not seq.needs_prompt_logits:
            continue
        at, have = int(cu_q_lens[r.slot]), len(seq.prompt_logprobs)
        for j in range(len(r.tokens)):
            p = r.start + j + 1
            if have <= p < seq.num_prompt_tokens:
                idx.append(at + j)
                targets.append(seq.prompt_token_ids[p])
                where.append((seq, p))
    if not idx:
        return None
    blocks = []
    for i in range(0, len(idx), PROMPT_LOGPROBS_BLOCK):
        a = np.zeros(PROMPT_LOGPROBS_BLOCK, np.int32)
        t = np.zeros(PROMPT_LOGPROBS_BLOCK, np.int32)
        part = slice(i, i + PROMPT_LOGPROBS_BLOCK)
        a[:len(idx[part])], t[:len(idx[part])] = idx[part], targets[part]
        blocks.append(steps.prompt_logprobs(params, hidden, a, t, MAX_LOGPROBS))
    return where, blocks


def record_prompt_logprobs(where, blocks, tokenizer) -> None:
    """Appends each scored prompt token's entry, in order; a position already recorded (a
    recomputation after preemption) is skipped."""
    chosen, rank, ids, top = (np.concatenate([np.asarray(b[i]) for b in blocks])
                              for i in range(4))
    name = namer(tokenizer)
    for e, (seq, p) in enumerate(where):
        if len(seq.prompt_logprobs) != p:
            continue
        n, t = seq.sampling_params.prompt_logprobs, seq.prompt_token_ids[p]
        seq.prompt_logprobs.append(entry(t, chosen[e], rank[e], ids[e, :n], top[e, :n], name))
