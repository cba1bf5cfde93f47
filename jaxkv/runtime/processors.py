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
   (int32[B, ceil(V / 32)], bit j of word w for token 32 w + j, filled on the host by
   `jaxkv.structured.grammar`), unpacked here.

Then temperature, top-k/top-p and the draw (`jaxkv.runtime.sampling`). Logprobs stay those of
the raw logits (vLLM's default). A row without processors has only padding entries, and its
logits pass unchanged (bit for bit), so one program serves a mixed batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.runtime.sampling import SamplingArrays, sample_tokens
from jaxkv.structured.grammar import bitmask_words

MIN_ENTRIES = 64  # the smallest entry bucket (entries per row are padded to a power of two)


@struct.dataclass
class LogitsProcessors:
    """Per-row logit edits for B rows of L entries (see the module docstring)."""

    ids: jax.Array  # i32[B, L]  token ids the row edits (-1: padding)
    bias: jax.Array  # f32[B, L]  added: logit_bias, and -inf for a bad word's banned token
    counts: jax.Array  # i32[B, L]  occurrences of the id in the output
    seen: jax.Array  # bool[B, L]  the id occurs in the prompt or the output
    allowed: jax.Array  # bool[B, L]  in allowed_token_ids
    restrict: jax.Array  # bool[B]  only allowed entries may be sampled
    active: jax.Array  # bool[B]  the row has processors (the others keep their tokens)
    repetition: jax.Array  # f32[B]  1: off
    frequency: jax.Array  # f32[B]  0: off
    presence: jax.Array  # f32[B]  0: off
    mask: jax.Array  # i32[B, ceil(V / 32)]  a grammar's allowed tokens, packed (see above)
    masked: jax.Array  # bool[B]  the row has a grammar


def apply_processors(logits, p: LogitsProcessors):
    """f32[B, V] logits after the row's edits."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    real = p.ids >= 0
    g = logits[rows, jnp.where(real, p.ids, 0)]
    g = jnp.where(p.restrict[:, None] & ~p.allowed, -jnp.inf, g)
    g = g + p.bias
    r = p.repetition[:, None]
    g = jnp.where(p.seen, jnp.where(g > 0, g / r, g * r), g)
    g = g - p.frequency[:, None] * p.counts.astype(jnp.float32)
    g = g - p.presence[:, None] * (p.counts > 0).astype(jnp.float32)
    base = jnp.where(p.restrict[:, None], -jnp.inf, logits)
    out = base.at[rows, jnp.where(real, p.ids, v)].set(g, mode="drop")
    return apply_token_bitmask(out, p.mask, p.masked)


def apply_token_bitmask(logits, mask, masked):
    """f32[B, V] ``logits`` with the tokens that rows with ``masked`` set do not allow in
    their packed ``mask`` (i32[B, ceil(V / 32)]) at -inf."""
    token = jnp.arange(logits.shape[1], dtype=jnp.int32)
    words = jnp.take(jnp.asarray(mask, jnp.int32), token // 32, axis=1, mode="clip")
    bits = (words >> (token % 32)) & 1
    return jnp.where(masked[:, None] & (bits == 0), -jnp.inf, logits)


@jax.jit
def sample_processed(logits, keys, sampling: SamplingArrays, processors: LogitsProcessors,
                     tokens):
    """`sample_tokens` of the processed logits for the rows with processors; the other rows
    keep ``tokens`` (what the program without processors drew: a row's draw never depends on
    its company). One program per entry bucket L."""
    drawn = sample_tokens(apply_processors(logits.astype(jnp.float32), processors), keys,
                          sampling)
    return jnp.where(processors.active, drawn, tokens)


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


def build_processors(rows, num_rows: int, grammars=None) -> LogitsProcessors:
    """Host builder. ``rows``: (row, token_ids, num_prompt_tokens, sampling params,
    bad word token-id sequences, grammar `Matcher` or None) for every row with processors;
    the other rows pass through. Entries are padded to a power of two >= MIN_ENTRIES; the
    grammars' masks are filled by ``grammars`` (a `GrammarCompiler`: on its threads)."""
    built = []
    for row, token_ids, num_prompt, sp, bad_words_ids, _ in rows:
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
        built.append((row, sp, ids, bias, counts, np.isin(ids, seen),
                      np.isin(ids, np.asarray(sp.allowed_token_ids or (), np.int64))))
    width = MIN_ENTRIES
    while width < max((len(b[2]) for b in built), default=0):
        width *= 2
    constrained = [(r[5], r[0]) for r in rows if r[5] is not None]
    words = bitmask_words(grammars.vocab_size) if constrained else 1  # (1: no mask to ship)
    p = LogitsProcessors(
        ids=np.full((num_rows, width), -1, np.int32),
        bias=np.zeros((num_rows, width), np.float32),
        counts=np.zeros((num_rows, width), np.int32),
        seen=np.zeros((num_rows, width), bool), allowed=np.zeros((num_rows, width), bool),
        restrict=np.zeros(num_rows, bool), active=np.zeros(num_rows, bool),
        repetition=np.ones(num_rows, np.float32),
        frequency=np.zeros(num_rows, np.float32), presence=np.zeros(num_rows, np.float32),
        mask=np.zeros((num_rows, words), np.int32), masked=np.zeros(num_rows, bool))
    if constrained:
        grammars.fill(constrained, p.mask)
        p.masked[[row for _, row in constrained]] = True
    for row, sp, ids, bias, counts, seen, allowed in built:
        n = len(ids)
        p.ids[row, :n], p.bias[row, :n], p.counts[row, :n] = ids, bias, counts
        p.seen[row, :n], p.allowed[row, :n] = seen, allowed
        p.restrict[row], p.active[row] = sp.allowed_token_ids is not None, True
        p.repetition[row] = sp.repetition_penalty
        p.frequency[row], p.presence[row] = sp.frequency_penalty, sp.presence_penalty
    return p
