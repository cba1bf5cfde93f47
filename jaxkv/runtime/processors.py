"""Logits processors on device: vLLM's allowed_token_ids, bad_words, logit_bias and penalties.

They act on a few entries per row, not on [B, V] tensors built by the host: each row lists the
token ids it touches (``ids``, -1 padding) with what to do to each, and the device gathers those
logits, edits them and scatters them back. In vLLM's order (its V1 sampler):

1. ``allowed_token_ids``: a restricted row keeps only its allowed entries (the rest of the
   vocabulary goes to -inf);
2. ``bad_words``: the last token of a bad word whose other tokens end the output gets -inf
   (the host decides which, per step), as part of ``bias``;
3. ``logit_bias``: added;
4. penalties: ``repetition_penalty`` r on every token of the prompt or the output (a positive
   logit is divided by r, another multiplied), then ``frequency_penalty`` times the token's
   count in the output and ``presence_penalty`` once if it occurs there are subtracted.

5. structured outputs: a row with a grammar keeps only the tokens its packed bitmask allows
   (int32[R, ceil(V / 32)], bit j of word w for token 32 w + j, filled on the host by
   `jaxkv.structured.grammar`), unpacked here.

Then temperature, top-k/top-p and the draw (`jaxkv.runtime.sampling`). Logprobs stay those of
the raw logits (vLLM's default). Only the rows with processors are gathered (R of them, a power
of 4 or the whole batch), edited and drawn again, after the step drew every row: the others
keep that token. A row with a grammar and nothing else has no entries, and a batch whose rows
all are so skips the entries' gather and scatter (L = 0); without a grammar, no mask is
shipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.runtime.sampling import SamplingArrays, sample_tokens
from jaxkv.runtime.stored_jit import stored_jit
from jaxkv.structured.grammar import bitmask_words

MIN_ENTRIES = 64  # the smallest entry bucket (entries per row are padded to a power of two)


@struct.dataclass
class LogitsProcessors:
    """Per-row logit edits for R of a batch's rows, L entries each (see the module
    docstring). L is 0 when no row has entries (only grammars), and the mask has no words
    when no row has a grammar: the program then skips that part."""

    rows: jax.Array  # i32[R]  the batch rows edited (padding: past the batch, dropped)
    ids: jax.Array  # i32[R, L]  token ids the row edits (-1: padding)
    bias: jax.Array  # f32[R, L]  added: logit_bias, and -inf for a bad word's banned token
    counts: jax.Array  # i32[R, L]  occurrences of the id in the output
    seen: jax.Array  # bool[R, L]  the id occurs in the prompt or the output
    allowed: jax.Array  # bool[R, L]  in allowed_token_ids
    restrict: jax.Array  # bool[R]  only allowed entries may be sampled
    repetition: jax.Array  # f32[R]  1: off
    frequency: jax.Array  # f32[R]  0: off
    presence: jax.Array  # f32[R]  0: off
    mask: jax.Array  # i32[R, ceil(V / 32)] (or [R, 0])  a grammar's allowed tokens, packed
    masked: jax.Array  # bool[R]  the row has a grammar


def _edit(logits, p: LogitsProcessors):
    """f32[R, V] logits of p's rows after their edits."""
    if p.ids.shape[1]:  # (static: a batch whose only edits are grammars skips this)
        r, v = logits.shape
        rows = jnp.arange(r)[:, None]
        real = p.ids >= 0
        g = logits[rows, jnp.where(real, p.ids, 0)]
        g = jnp.where(p.restrict[:, None] & ~p.allowed, -jnp.inf, g)
        g = g + p.bias
        rep = p.repetition[:, None]
        g = jnp.where(p.seen, jnp.where(g > 0, g / rep, g * rep), g)
        g = g - p.frequency[:, None] * p.counts.astype(jnp.float32)
        g = g - p.presence[:, None] * (p.counts > 0).astype(jnp.float32)
        base = jnp.where(p.restrict[:, None], -jnp.inf, logits)
        logits = base.at[rows, jnp.where(real, p.ids, v)].set(g, mode="drop")
    if p.mask.shape[1]:  # (static: no grammar, no mask)
        logits = apply_token_bitmask(logits, p.mask, p.masked)
    return logits


def _take(x, rows):
    return jnp.take(x, rows, axis=0, mode="clip")  # (padding rows: any row, then dropped)


def apply_processors(logits, p: LogitsProcessors):
    """f32[B, V] logits after the edits of p's rows (the other rows unchanged)."""
    logits = jnp.asarray(logits, jnp.float32)
    return logits.at[p.rows].set(_edit(_take(logits, p.rows), p), mode="drop")


def apply_token_bitmask(logits, mask, masked):
    """f32[B, V] ``logits`` with the tokens that rows with ``masked`` set do not allow in
    their packed ``mask`` (i32[B, ceil(V / 32)]) at -inf."""
    token = jnp.arange(logits.shape[1], dtype=jnp.int32)
    words = jnp.take(jnp.asarray(mask, jnp.int32), token // 32, axis=1, mode="clip")
    bits = (words >> (token % 32)) & 1
    return jnp.where(masked[:, None] & (bits == 0), -jnp.inf, logits)


@stored_jit
def sample_processed(logits, keys, sampling: SamplingArrays, processors: LogitsProcessors,
                     tokens):
    """``tokens`` with the rows that have processors drawn again (`sample_tokens`, their own
    keys and settings) from their processed logits; only those rows are gathered, edited and
    drawn (a row's draw never depends on its company). One program per (rows R, entries L,
    mask or not)."""
    rows = processors.rows
    edited = _edit(_take(logits, rows).astype(jnp.float32), processors)
    drawn = sample_tokens(edited, _take(keys, rows),
                          jax.tree.map(lambda a: _take(a, rows), sampling))
    return tokens.at[rows].set(drawn, mode="drop")


def bad_word_bans(bad_words_ids, output_ids) -> list[int]:
    """Token ids banned next (vLLM's rule): the last token of every bad word whose other
    tokens are the end of the output so far (a one-token bad word always)."""
    bans = []
    for word in bad_words_ids:
        m = len(word) - 1
        if m < 0 or m > len(output_ids):
            continue
        if m == 0 or list(output_ids[-m:]) == list(word[:-1]):
            bans.append(word[-1])
    return bans


def has_processors(sp) -> bool:
    return sp.edits_logits


def _row_bucket(n: int, num_rows: int) -> int:
    """Rows a program of n edited rows takes: a power of 4 (at most the batch's rows)."""
    r = 1
    while r < n:
        r *= 4
    return min(r, num_rows)


def build_processors(rows, num_rows: int, grammars=None) -> LogitsProcessors:
    """Host builder. ``rows``: (row, token_ids, num_prompt_tokens, sampling params,
    bad word token-id sequences, grammar `Matcher` or None) for every row with processors,
    of a batch of ``num_rows``; the other rows pass through. Rows are padded to a power of 4,
    entries to a power of two >= MIN_ENTRIES (none when no row has any); the grammars' masks
    are filled by ``grammars`` (a `GrammarCompiler`: on its threads)."""
    built = []
    for i, (_, token_ids, num_prompt, sp, bad_words_ids, _) in enumerate(rows):
        if not sp.uses_processors:
            continue  # a grammar only
        hist = np.asarray(token_ids, np.int64)
        out = hist[num_prompt:]
        parts = [np.asarray(list(sp.logit_bias or ()), np.int64),
                 np.asarray(sp.allowed_token_ids or (), np.int64)]
        bans = np.asarray(bad_word_bans(bad_words_ids, out), np.int64)
        penal = sp.frequency_penalty or sp.presence_penalty
        seen = hist if sp.repetition_penalty != 1 else out[:0]
        parts += [bans, seen, out if penal else out[:0]]
        ids = np.unique(np.concatenate(parts))
        bias = np.zeros(len(ids), np.float32)
        for t, x in (sp.logit_bias or {}).items():
            bias[np.searchsorted(ids, t)] += x
        bias[np.searchsorted(ids, bans)] = -np.inf
        uniq, cnt = np.unique(out, return_counts=True)
        hit = np.isin(uniq, ids)
        counts = np.zeros(len(ids), np.int32)
        counts[np.searchsorted(ids, uniq[hit])] = cnt[hit]
        built.append((i, sp, ids, bias, counts, np.isin(ids, seen),
                      np.isin(ids, np.asarray(sp.allowed_token_ids or (), np.int64))))
    width = 0 if not built else MIN_ENTRIES
    while width < max((len(b[2]) for b in built), default=0):
        width *= 2
    constrained = [(r[5], i) for i, r in enumerate(rows) if r[5] is not None]
    words = bitmask_words(grammars.vocab_size) if constrained else 0
    p = _blank(_row_bucket(len(rows), num_rows), width, words, num_rows)
    p.rows[:len(rows)] = [r[0] for r in rows]
    if constrained:
        grammars.fill(constrained, p.mask)
        p.masked[[i for _, i in constrained]] = True
    for i, sp, ids, bias, counts, seen, allowed in built:
        k = len(ids)
        p.ids[i, :k], p.bias[i, :k], p.counts[i, :k] = ids, bias, counts
        p.seen[i, :k], p.allowed[i, :k] = seen, allowed
        p.restrict[i] = sp.allowed_token_ids is not None
        p.repetition[i] = sp.repetition_penalty
        p.frequency[i], p.presence[i] = sp.frequency_penalty, sp.presence_penalty
    return p


def _blank(n: int, width: int, words: int, num_rows: int) -> LogitsProcessors:
    """Host processors of n padding rows (dropped: past the batch's ``num_rows``), ``width``
    entries and ``words`` mask words each, editing nothing."""
    return LogitsProcessors(
        rows=np.full(n, num_rows, np.int32), ids=np.full((n, width), -1, np.int32),
        bias=np.zeros((n, width), np.float32), counts=np.zeros((n, width), np.int32),
        seen=np.zeros((n, width), bool), allowed=np.zeros((n, width), bool),
        restrict=np.zeros(n, bool), repetition=np.ones(n, np.float32),
        frequency=np.zeros(n, np.float32), presence=np.zeros(n, np.float32),
        mask=np.zeros((n, words), np.int32), masked=np.zeros(n, bool))


def idle_masks(rows: int, num_rows: int, vocab_size: int) -> LogitsProcessors:
    """Processors of ``rows`` padding rows with a grammar's mask and no entries (what a batch
    of constrained rows runs): compiling `sample_processed` ahead with them edits nothing."""
    return _blank(rows, 0, bitmask_words(vocab_size), num_rows)
