"""Speculative decoding's device side for a `ModelRunner`: drafting on device (``self``,
``draft_model``), and
verifying every speculating row of a ragged step (`jaxkv.spec` has the host's
part, `jaxkv.runtime.spec_verify` the rule).

A step with speculating rows runs as any ragged step (each such row holds its pending token and
its drafts), then one ``verify`` program per row bucket turns those rows' hidden states into the
target's logits at every position and accepts or draws. A row with a grammar (structured
outputs) has its drafts cut before the first token the grammar refuses and its mask at every
position, filled on the host before the verification is dispatched (drafts from the device
are read back for it first); with such rows the verification is a second program per row
bucket, compiled on first use. With ``self``, a draft program (a decode
loop of the first layers, greedy) runs first on the same rows and pages, and its tokens are
written into the step's token array on device: nothing goes back to the host in between.
``draft_model`` does the same with a second model over its own pool (`DraftModel`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.engine.logprobs import entry, namer
from jaxkv.engine.reads import TokenRead
from jaxkv.runtime.batch import StepBatch, build_batch, fit, padding_batch, pow2
from jaxkv.runtime.draft_steps import draft_loop_inputs
from jaxkv.runtime.sampling import MAX_BANNED, token_logprobs
from jaxkv.runtime.steps import DecodeLoopBatch, take_rows
from jaxkv.runtime.stored_jit import stored_jit
from jaxkv.sampling_params import MAX_LOGPROBS
from jaxkv.sharding import commit
from jaxkv.structured.grammar import bitmask_words


@stored_jit
def _place(tokens, at, out):
    """(``tokens`` with the draft loop's ``out`` (i32[K, R]) written at ``at`` (i32[R, K]; past
    the end: dropped), the drafts i32[R, K])."""
    drafts = out.T
    return tokens.at[at.reshape(-1)].set(drafts.reshape(-1), mode="drop"), drafts


def committed_tokens(runner, batch: StepBatch) -> StepBatch:
    """``batch`` with its tokens on the device, committed, as a step whose drafts were written
    there has them: a self-speculating engine's steps all take them so (one program per
    token bucket, whether or not a row speculates)."""
    if runner.mesh is None:
        tokens = commit(batch.tokens)
    else:
        tokens = jax.device_put(batch.tokens, NamedSharding(runner.mesh, PartitionSpec()))
    return batch.replace(tokens=tokens)


def draft_on_device(runner, rows, batch: StepBatch) -> tuple[StepBatch, jax.Array]:
    """Runs the device's draft (``self``: the first layers; ``draft_model``: the draft
    model, `jaxkv.spec.draft_model`) for ``rows`` (their pages and tables already set by
    `build_batch`) and writes its tokens into ``batch``; returns the batch and the drafts
    (i32[R, K], -1 past each row's ``num_draft``)."""
    k = runner.spec_k
    r = fit(len(rows), runner.row_buckets)
    at = np.full((r, k), len(batch.tokens), np.int32)
    for i, row in enumerate(rows):
        first = int(batch.cu_q_lens[row.slot]) + 1
        at[i, :row.num_draft] = np.arange(first, first + row.num_draft)
    if runner.draft_model is not None:
        out = runner.draft_model.propose(runner, rows)
    else:
        table = np.zeros((r, runner.max_pages_per_seq), np.int32)
        loop = _draft_inputs(runner, r)
        for i, row in enumerate(rows):
            loop.tokens[i], loop.positions[i] = row.tokens[0], row.start
            loop.limit[i], loop.live[i] = row.num_draft, True
            table[i] = runner.page_table.table[row.slot]
            if loop.window_page_table is not None:
                loop.window_page_table[i] = runner.window_table.table[row.slot]
        out, _ = runner.run(runner.steps.draft, loop.replace(page_table=table))
    tokens, drafts = _place(batch.tokens, at, out)
    return batch.replace(tokens=tokens), drafts


def _draft_inputs(runner, r: int) -> DecodeLoopBatch:
    """The self draft loop's inputs for r idle rows: greedy, k steps."""
    return draft_loop_inputs(r, runner.max_pages_per_seq, runner.spec_k, runner.window_rows(r))


@dataclasses.dataclass
class Verified:
    """A dispatched verification: the device's tokens, and logprobs where a row asked."""

    rows: list  # the verified ScheduledRows, in order
    tokens: jax.Array  # i32[R, K + 1]
    logprobs: tuple | None  # token_logprobs' four over R * (K + 1) positions
    draft: object = None  # the runner's DraftModel, told what each row kept

    def read(self, tokenizer) -> dict[int, list[int]]:
        """Each row's emitted tokens by slot; records their logprobs for those that ask."""
        got = np.asarray(self.tokens)
        k1 = got.shape[1]
        lps = None if self.logprobs is None else [np.asarray(x) for x in self.logprobs]
        out = {}
        for i, row in enumerate(self.rows):
            emitted = [int(t) for t in got[i] if t >= 0]
            out[row.slot] = emitted
            seq = row.request
            if self.draft is not None:  # its K/V past the accepted tokens is stale
                self.draft.settle(seq, row.start + len(emitted))
            if lps is not None and seq.logprobs is not None:
                n, name = seq.sampling_params.logprobs, namer(tokenizer)
                for j, t in enumerate(emitted):
                    e = i * k1 + j
                    seq.logprobs.append(entry(t, lps[0][e], lps[1][e], lps[2][e, :n],
                                              lps[3][e, :n], name))
        return out


def _masks(runner, rows, r: int, drafted: list):
    """The grammar masks of ``rows`` (in a bucket of r; ``drafted``: each row's drafts) per
    position, as `steps._verify` takes them, filled on llguidance's threads: position j of a
    row allows what its grammar allows after its first j drafts. None without a grammar."""
    grammar = [i for i, row in enumerate(rows) if row.request.grammar is not None]
    if not grammar:
        return None
    k1 = runner.spec_k + 1
    words = np.zeros((r * k1, bitmask_words(runner.grammars.vocab_size)), np.int32)
    masked = np.zeros((r, k1), bool)
    runner.grammars.fill_with_drafts(
        [(rows[i].request.grammar, i * k1, drafted[i]) for i in grammar], words)
    for i in grammar:
        masked[i, :len(drafted[i]) + 1] = True
    words = words.reshape(r, k1, -1)
    # Past a draft that completes the grammar llguidance writes nothing: those positions stay
    # unmasked (their token is never taken: the request ends at the completing draft).
    return words, masked & words.any(axis=-1)


def _drafted(rows, drafts) -> list:
    """Each row's drafts to verify: its own (n-gram drafts, already cut for a grammar), or,
    with ``drafts`` from the device, None (they stand as drafted) except for a row with a
    grammar: its drafts are read back (which waits for the draft program) and cut before the
    first token the grammar refuses."""
    if drafts is None:
        return [list(row.tokens[1:]) for row in rows]
    host = None
    if any(r.request.grammar is not None and r.num_draft for r in rows):
        host = np.asarray(drafts)
    out = []
    for i, row in enumerate(rows):
        grammar = row.request.grammar
        mine = [int(t) for t in host[i, :row.num_draft]] if grammar and row.num_draft else []
        out.append(None if grammar is None else mine[:grammar.valid_prefix(mine)] if mine
                   else [])
    return out


def _inputs(runner, rows, cu_q_lens, drafts=None):
    """Verification inputs of ``rows`` in a row bucket (``drafts``: the device's, or None):
    (positions in the step i32[R, K + 1], drafts i32[R, K], num_draft i32[R], keys,
    SamplingArrays, banned ids per position, grammar masks per position or None)."""
    k = runner.spec_k
    r = fit(len(rows), runner.row_buckets)
    idx = np.zeros((r, k + 1), np.int32)
    draft = np.full((r, k), -1, np.int32)
    num = np.zeros(r, np.int32)
    banned = np.full((r, k + 1, MAX_BANNED), -1, np.int32)
    eos = runner.model.config.eos_token_ids
    drafted = _drafted(rows, drafts)
    for i, row in enumerate(rows):
        seq = row.request
        d = row.num_draft if drafted[i] is None else len(drafted[i])
        at = int(cu_q_lens[row.slot])
        idx[i, :d + 1] = np.arange(at, at + d + 1)
        draft[i, :d], num[i] = drafted[i] or 0, d
        for j in range(d + 1):  # stop ids stay banned until min_tokens are out
            ids = seq.sampling_params.banned_ids(seq.num_output_tokens + j, eos)
            banned[i, j, :len(ids)] = ids
    keys, arrays = runner.sampling([(i, row.request) for i, row in enumerate(rows)], rows=r)
    return idx, draft, num, keys, arrays, banned, _masks(runner, rows, r, drafted)


def _logprobs(rows, tokens, logits):
    if any(row.request.logprobs is not None for row in rows):
        return token_logprobs(logits, jnp.maximum(tokens, 0).reshape(-1), MAX_LOGPROBS)
    return None


def dispatch_verify(runner, rows, batch: StepBatch, hidden, drafts=None) -> Verified:
    """Dispatches the verification of the speculating ``rows`` of a step over ``batch``
    (``drafts``: the device's, for self-speculation; else the rows' own)."""
    idx, draft, num, keys, arrays, banned, mask = _inputs(runner, rows, batch.cu_q_lens, drafts)
    tokens, logits = runner.steps.verify(runner.model.params, take_rows(hidden, idx),
                                         draft if drafts is None else drafts, num, keys,
                                         arrays, banned, mask)
    return Verified(list(rows), tokens, _logprobs(rows, tokens, logits), runner.draft_model)


def decodes_only(rows) -> bool:
    """Whether a step's rows are all one-sample decodes (some with drafts) that a spec step
    runs: no prefill chunk, fork, logits processor or prompt logprobs (a grammar's mask it
    applies itself)."""
    return any(r.num_draft for r in rows) and all(
        len(r.tokens) == 1 + r.num_draft and r.samples == (r.request,)
        and not r.request.sampling_params.uses_processors
        and not r.request.needs_prompt_logits for r in rows)


def spec_tokens(runner, rows: int) -> int:
    """The token bucket of a spec step of ``rows`` rows (a row bucket): each row's k + 1."""
    return pow2(rows * (runner.spec_k + 1))


def launch_spec_step(runner, rows, version):
    """Dispatches a spec step (`jaxkv.runtime.steps`) over decode ``rows``: logits only at
    their positions, verification and plain sampling in one program. Returns what
    `ModelRunner.launch_step` returns."""
    r = fit(len(rows), runner.row_buckets)
    batch = build_batch(rows, runner.page_table, tokens_bucket=spec_tokens(runner, r),
                        vocab_size=runner.model.config.vocab_size, window=runner.window_table)
    drafts = None
    if runner.drafts_on_device:
        batch, drafts = draft_on_device(runner, rows, batch)
    idx, draft, num, keys, arrays, banned, mask = _inputs(runner, rows, batch.cu_q_lens, drafts)
    tokens, logits = runner.run(runner.steps.spec_step, batch, idx,
                                draft if drafts is None else drafts, num, keys, arrays, banned,
                                mask)
    runner.num_steps += 1
    verified = Verified(list(rows), tokens, _logprobs(rows, tokens, logits), runner.draft_model)
    tokenizer = runner.model.tokenizer

    def read():
        emitted = verified.read(tokenizer)
        return "step", [emitted[r.slot] if r.num_draft else emitted[r.slot][:1] for r in rows]
    return TokenRead(read, version, tokens)


def warm_draft(runner, r: int) -> None:
    """Compiles the draft program for r rows (idle: it writes nothing), the placing of its
    drafts in each token bucket, and their verification."""
    if runner.draft_model is not None:
        out = runner.draft_model.warm(runner, r)
    else:
        out, _ = runner.run(runner.steps.draft, _draft_inputs(runner, r))
    for t in {*runner.token_buckets, spec_tokens(runner, r)}:
        _, drafts = _place(np.zeros(t, np.int32), np.full((r, runner.spec_k), t, np.int32), out)
    _warm_verify_rows(runner, r, drafts)
    _warm_spec_step(runner, r, drafts)


def _warm_spec_step(runner, r: int, drafts) -> None:
    """Compiles the spec step of r rows (padding: it writes nothing)."""
    batch = padding_batch(spec_tokens(runner, r), runner.page_table, runner.window_table)
    if runner.drafts_on_device:
        batch = committed_tokens(runner, batch)
    k1 = runner.spec_k + 1
    keys, arrays = runner.sampling([], rows=r)
    tokens, logits = runner.run(
        runner.steps.spec_step, batch, np.zeros((r, k1), np.int32), drafts,
        np.zeros(r, np.int32), keys, arrays, np.full((r, k1, MAX_BANNED), -1, np.int32),
        None)  # (no grammar row: as serving passes it)
    token_logprobs(logits, jnp.maximum(tokens, 0).reshape(-1), MAX_LOGPROBS)


def warm_verify(runner, t: int, r: int) -> None:
    """Compiles the gather of r rows' hidden states from a step of t tokens; with the first
    t, their verification (whose shapes depend on r only) and its logprobs."""
    hidden = commit(np.zeros((t, runner.model.config.hidden_size), runner.model.dtype))
    take_rows(hidden, np.zeros((r, runner.spec_k + 1), np.int32))
    if t == runner.token_buckets[0] and not runner.drafts_on_device:  # (else: warm_draft)
        drafts = np.zeros((r, runner.spec_k), np.int32)
        _warm_verify_rows(runner, r, drafts)
        _warm_spec_step(runner, r, drafts)


def _warm_verify_rows(runner, r: int, drafts) -> None:
    k1 = runner.spec_k + 1
    hidden = take_rows(commit(np.zeros((k1, runner.model.config.hidden_size),
                                       runner.model.dtype)), np.zeros((r, k1), np.int32))
    keys, arrays = runner.sampling([], rows=r)
    tokens, logits = runner.steps.verify(
        runner.model.params, hidden, drafts, np.zeros(r, np.int32), keys, arrays,
        np.full((r, k1, MAX_BANNED), -1, np.int32), None)
    token_logprobs(logits, jnp.maximum(tokens, 0).reshape(-1), MAX_LOGPROBS)
