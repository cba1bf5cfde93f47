"""Verifying speculated tokens against the target model's logits, on device (issue 29).

A speculating row proposes K draft tokens x_1..x_K after its last sampled token; one target
step scores the K + 1 positions, giving the target's next-token distribution p_0..p_K (p_i
follows x_1..x_i). Verification walks the drafts in order and accepts x_{i+1} with probability
``min(1, p_i(x_{i+1}) / q_i(x_{i+1}))``, q_i being the draft's distribution (one-hot for a
deterministic proposer: n-gram lookup, a greedy draft); at the first rejection it samples from
the residual ``max(p_i - q_i, 0)`` normalized, and when every draft is accepted it samples a
bonus token from p_K. Every emitted token is then distributed exactly as sampling the target
alone (Leviathan et al. 2023; Chen et al. 2023). Greedy rows need no special case: their p_i
is one-hot on the argmax, so a draft is accepted iff it is the argmax and the residual is the
argmax.

The target distribution is what `jaxkv.runtime.sampling` samples from: temperature, then the
top-k / top-p threshold, with the row's banned ids masked. Random numbers come from the row's
key folded with the output position, so a row's draws do not depend on the batch.

Every proposer jaxkv runs is deterministic (n-gram lookup, greedy drafts), so the engine uses
the coupled form of that rule (`accept_drawn`): the sampler draws each of the K + 1 positions
exactly as a plain step would (the row's key folded with that output index), and a draft is
kept while it equals the draw. For a one-hot q this is the rule above: x is kept with
probability p(x), and a rejection emits the draw, which then follows p without x, the
residual. Its tokens are also the ones sampling without speculation would give, so a seeded
request's output does not depend on whether (or how far) it speculated. `verify` keeps the
general rule, for a proposer whose drafts are themselves sampled (q not one-hot).

Axes: R rows, K draft tokens per row (a row may propose fewer: ``num_draft``), V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.runtime.sampling import argmax, inverse_cdf, keep_threshold, min_p_floor


def target_probs(logits, temperature, top_k, top_p, banned=None, min_p=None):
    """f32[N, V] probabilities the sampler draws from for f32[N, V] logits: one-hot argmax
    where ``temperature`` is 0, else softmax(logits / temperature) over the min-p, top-k and
    top-p set; ``banned`` (i32[N, M], -1 = none) ids get probability 0."""
    n, v = logits.shape
    if banned is not None:
        logits = logits.at[jnp.arange(n)[:, None], jnp.where(banned >= 0, banned, v)].set(
            -jnp.inf, mode="drop")
    hot = temperature > 0
    greedy = jax.nn.one_hot(argmax(logits), v, dtype=jnp.float32)

    def sampled():
        x = logits / jnp.maximum(temperature, 1e-6)[:, None]
        floor = None if min_p is None else min_p_floor(x, min_p)
        filtered = jnp.any(hot & ((top_k > 0) | (top_p < 1) |
                                  (False if min_p is None else min_p > 0)))
        thr = jax.lax.cond(filtered, lambda: keep_threshold(x, top_k, top_p, floor),
                           lambda: jnp.full(x.shape[:1], -jnp.inf))
        x = jnp.where(x >= thr[:, None], x, -jnp.inf)
        return jnp.where(hot[:, None], jax.nn.softmax(x, axis=-1), greedy)

    return jax.lax.cond(jnp.any(hot), sampled, lambda: greedy)  # all greedy: one-hots only


def _uniforms(keys, step, k: int):
    """(u_accept f32[R, K + 1], u_draw f32[R, K + 1]): two numbers per output position, from
    the row's key folded with the position's output index (``step + i``)."""
    def row(key, s):
        def at(i):
            a, b = jax.random.split(jax.random.fold_in(key, s + i))
            return (jax.random.uniform(a, dtype=jnp.float32),
                    jax.random.uniform(b, dtype=jnp.float32))
        return jax.vmap(at)(jnp.arange(k + 1))
    return jax.vmap(row)(keys, step)


def accept_drawn(drawn, draft, num_draft):
    """Keeps each row's drafts while they equal the sampler's draws at their positions.

    ``drawn`` i32[R, K + 1]: the token a plain step samples at the row's last token and after
    each draft (the row's key folded with that output index); ``draft`` i32[R, K];
    ``num_draft`` i32[R] (<= K). Returns (tokens i32[R, K + 1]: the kept drafts, then the draw
    after them, -1 after; emitted i32[R]: kept + 1), as `verify`."""
    k = draft.shape[1]
    ok = (drawn[:, :k] == draft) & (jnp.arange(k)[None] < num_draft[:, None])
    kept = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [R]
    cols = jnp.arange(k + 1)[None]
    return jnp.where(cols <= kept[:, None], drawn, -1).astype(jnp.int32), kept + 1


def verify(p, draft, num_draft, keys, step, q=None):
    """Accepts a prefix of each row's drafts and draws the token after it.

    ``p`` f32[R, K + 1, V]: the target's distributions (`target_probs`) at the row's last token
    and after each draft; ``draft`` i32[R, K]; ``num_draft`` i32[R] (<= K; 0: a plain decode
    step); ``keys`` u32[R, 2] and ``step`` i32[R] (the row's output tokens so far); ``q``
    f32[R, K, V]: the draft's distributions (None: one-hot on the drafts).

    Returns (tokens i32[R, K + 1]: the accepted drafts then the drawn token, -1 after;
    emitted i32[R]: accepted + 1)."""
    r, k1, v = p.shape
    k = k1 - 1
    pos = jnp.arange(k)
    q = jax.nn.one_hot(draft, v, dtype=jnp.float32) if q is None else q
    p_draft = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]  # [R, K]
    q_draft = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    ratio = jnp.where(q_draft > 0, p_draft / jnp.where(q_draft > 0, q_draft, 1.0), 0.0)
    u_accept, u_draw = _uniforms(keys, step, k)
    ok = (u_accept[:, :k] < ratio) & (pos[None] < num_draft[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [R]
    # The token after the accepted prefix: the residual at a rejection, p_K's bonus after all.
    p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [R, V]
    q_pad = jnp.concatenate([q, jnp.zeros((r, 1, v), q.dtype)], axis=1)
    q_at = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    rejected = accepted < num_draft
    residual = jnp.where(rejected[:, None], jnp.maximum(p_at - q_at, 0.0), p_at)
    # (rounding can empty the residual when p == q: then p itself, which it equals)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_at)
    u = jnp.take_along_axis(u_draw, accepted[:, None], axis=1)[:, 0]
    drawn = inverse_cdf(jnp.log(residual), u)
    cols = jnp.arange(k1)[None]
    padded = jnp.concatenate([draft, jnp.zeros((r, 1), draft.dtype)], axis=1)
    tokens = jnp.where(cols < accepted[:, None], padded,
                       jnp.where(cols == accepted[:, None], drawn[:, None], -1))
    return tokens.astype(jnp.int32), accepted + 1
