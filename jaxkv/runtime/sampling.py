"""Per-request sampling on device, without sorting the vocabulary.

- greedy rows (temperature 0): argmax;
- other rows: inverse-CDF sampling from softmax(logits / temperature), one uniform number per
  row, in two passes (block sums, then one block) instead of a sort or V random numbers;
- min-p: tokens less likely than ``min_p`` times the most likely one are dropped (after the
  temperature, before top-k / top-p, as vLLM applies it);
- top-k / top-p: a threshold on the scaled logits, taken from a `lax.top_k` candidate set of
  TOP_K_CAP entries. A top-k within the cap, and a nucleus that the candidates' mass reaches,
  are exact; a larger top-k or a nucleus wider than the cap falls back to a bisection over the
  threshold (to float precision) on the full vocabulary. Tokens tied with the threshold are
  all kept. A batch without top-k/top-p rows skips the candidate set; an all-greedy batch
  skips everything but the argmax.

Each row carries its own PRNG key and step counter; the key used at a step is
``fold_in(key, step)``, so a request's samples depend only on its own seed and position,
never on which other requests share the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.config import cdiv
from jaxkv.runtime.stored_jit import stored_jit

TOP_K_CAP = 256  # candidates for top-k / top-p thresholds
MAX_BANNED = 16  # token ids a row can ban at one step (its stop ids before min_tokens)
CDF_BLOCK = 512  # vocabulary entries per block of the two-pass inverse CDF
_BISECT_STEPS = 40


# RowSettings' fields: (dtype, the value of a row without a request: greedy, nothing filtered)
IDLE = {"temperature": (np.float32, 0.0), "top_k": (np.int32, 0), "top_p": (np.float32, 1.0),
        "min_p": (np.float32, 0.0)}


@struct.dataclass
class RowSettings:
    """What a request fixes about how its rows sample (the same at every step), one entry per
    row; each field is the `SamplingParams` attribute of its name. These are the input batch's
    columns that every program's sampler reads (the ragged step, the decode loop, the spec
    step and its verification): a new setting is a field here with its `IDLE` value, its use
    in `sample_tokens`, and its field in `SamplingParams`."""

    temperature: jax.Array  # f32[B]  0 means greedy
    top_k: jax.Array  # i32[B]  <= 0 means disabled
    top_p: jax.Array  # f32[B]  1 means disabled
    min_p: jax.Array  # f32[B]  0 means disabled

    @classmethod
    def of(cls, rows: int, params=()) -> RowSettings:
        """Host columns of ``rows`` rows: row i takes the settings of the SamplingParams of
        each (i, params) pair; the others are idle."""
        cols = {name: np.full(rows, idle, dtype) for name, (dtype, idle) in IDLE.items()}
        for i, sp in params:
            for name, col in cols.items():
                col[i] = getattr(sp, name)
        return cls(**cols)


@struct.dataclass
class SamplingArrays:
    settings: RowSettings  # what each row's request fixes
    step: jax.Array  # i32[B]  tokens generated so far by the row's request
    banned: jax.Array  # i32[B, MAX_BANNED]  ids that may not be sampled now (-1: none)

    temperature = property(lambda self: self.settings.temperature)
    top_k = property(lambda self: self.settings.top_k)
    top_p = property(lambda self: self.settings.top_p)
    min_p = property(lambda self: self.settings.min_p)

    @classmethod
    def build(cls, temperature, top_k, top_p, step, rows: int, banned=(),
              min_p=()) -> SamplingArrays:
        """Host builder: pads lists to `rows` entries (padding rows are greedy); ``banned[i]``
        lists row i's banned ids."""
        def pad(values, name):
            dtype, idle = IDLE.get(name, (np.int32, 0))
            out = np.full(rows, idle, dtype)
            out[:len(values)] = values
            return out

        ban = np.full((rows, MAX_BANNED), -1, np.int32)
        for i, ids in enumerate(banned):
            ban[i, :len(ids)] = ids
        settings = RowSettings(pad(temperature, "temperature"), pad(top_k, "top_k"),
                               pad(top_p, "top_p"), pad(min_p, "min_p"))
        return cls(settings, pad(step, "step"), ban)

    @classmethod
    def greedy(cls, rows: int) -> SamplingArrays:
        return cls.build([], [], [], [], rows)


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed (vLLM's seeding) accepts


def check_bannable(sp, eos_token_ids) -> None:
    """Raises ValueError (naming the field) if a request's stop ids cannot all be masked on
    device until its min_tokens are out: at most MAX_BANNED of them."""
    stops = sp.stop_ids(eos_token_ids)
    if sp.min_tokens and len(stops) > MAX_BANNED:
        raise ValueError(f"SamplingParams.stop_token_ids={sp.stop_token_ids!r}: with "
                         f"min_tokens > 0, at most {MAX_BANNED} stop ids (EOS included) can "
                         f"be masked on device; got {len(stops)}")


def request_key(seed: int, sample_index: int = 0) -> np.ndarray:
    """The raw u32[2] base key of sample `sample_index` of a request seeded with `seed`.

    The whole 64-bit seed is the raw key (high word, low word): one key per seed, so
    ``2**32 + 5`` and ``5`` differ; a negative seed is taken modulo 2**64, as torch does.
    Seeds below 2**32 give the same keys as ``jax.random.PRNGKey(seed)`` (that is [0, seed])."""
    lo_, hi_ = SEED_RANGE
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or \
            not lo_ <= seed < hi_:
        raise ValueError(f"seed={seed!r}: must be an int in [-2**63, 2**64)")
    seed = int(seed) % 2**64
    key = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    key = jax.random.fold_in(key, sample_index)
    return np.asarray(jax.random.key_data(key), np.uint32)


def sample_keys(engine_seed: int, sp, index: int) -> list[np.ndarray]:
    """The raw keys of a request's ``sp.n`` samples: as `jaxkv.generate` with ``sp.seed``,
    else from the engine seed and the request's arrival index, so outputs never depend on
    the batch a request lands in."""
    if sp.seed is not None:
        return [request_key(sp.seed, j) for j in range(sp.n)]
    base = request_key(engine_seed, index)  # the whole 64-bit engine seed counts
    return [np.asarray(jax.random.fold_in(base, j), np.uint32) for j in range(sp.n)]


def argmax(x):
    """i32[B]: each row's first largest entry of x [B, V], as ``jnp.argmax`` gives it (for
    rows without NaN: XLA:CPU's vectorized max may drop one). By blocks of CDF_BLOCK: the
    block with the largest maximum, then the entry in it (a last partial block apart, so
    nothing is padded). XLA:CPU's argmax over a whole row is a slow variadic reduction:
    3.3 ms for [32, 49152] on a 2-core VM, against 0.27 ms so."""
    b, v = x.shape
    block = min(CDF_BLOCK, v)
    nb, rest = divmod(v, block)
    whole = x[:, :nb * block].reshape(b, nb, block)
    peaks = jnp.max(whole, axis=-1)
    if rest:
        tail = x[:, nb * block:]
        peaks = jnp.concatenate([peaks, jnp.max(tail, axis=-1, keepdims=True)], axis=-1)
    blk = jnp.argmax(peaks, axis=-1)
    row = jnp.take_along_axis(whole, jnp.minimum(blk, nb - 1)[:, None, None], axis=1)[:, 0]
    idx = blk * block + jnp.argmax(row, axis=-1)
    if rest:
        idx = jnp.where(blk == nb, nb * block + jnp.argmax(tail, axis=-1), idx)
    return idx.astype(jnp.int32)


def inverse_cdf(x, u):
    """Index drawn from softmax(x) per row (x f32[B, V], -inf = excluded; u f32[B] in [0, 1))."""
    b, v = x.shape
    block = min(CDF_BLOCK, v)
    nb = cdiv(v, block)
    m = jnp.max(x, axis=-1, keepdims=True)
    xp = jnp.pad(x, ((0, 0), (0, nb * block - v)), constant_values=-jnp.inf)
    p = jnp.exp(xp - m).reshape(b, nb, block)
    cum_blocks = jnp.cumsum(p.sum(-1), axis=-1)  # [B, nb]
    target = u * cum_blocks[:, -1]
    blk = jnp.minimum(jnp.sum(cum_blocks <= target[:, None], axis=-1), nb - 1)
    before = jnp.where(blk > 0, jnp.take_along_axis(cum_blocks, jnp.maximum(blk - 1, 0)[:, None],
                                                    axis=-1)[:, 0], 0.0)
    row = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]  # [B, block]
    idx = jnp.sum(jnp.cumsum(row, axis=-1) <= (target - before)[:, None], axis=-1)
    # Rounding can put the target past the block's last live entry: take that entry.
    last_live = block - 1 - jnp.argmax(row[:, ::-1] > 0, axis=-1)
    return (blk * block + jnp.minimum(idx, last_live)).astype(jnp.int32)


def _bisect(x, lo, hi, keep_enough):
    """Largest threshold t in [lo, hi] with keep_enough(x >= t) (to float precision)."""
    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = keep_enough(x >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return lo


def keep_threshold(x, top_k, top_p, floor=None):
    """Per-row threshold on scaled logits x f32[B, V] that keeps the tokens at or above
    ``floor`` (f32[B], min-p's; None: all), then top-k of those, then the nucleus of those."""
    b, v = x.shape
    cap = min(TOP_K_CAP, v)
    vals = jax.lax.top_k(x, cap)[0]  # [B, cap], descending
    lo = jnp.min(jnp.where(jnp.isfinite(x), x, jnp.inf), axis=-1)  # masked (-inf) logits
    hi = vals[:, 0]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    thr_k = jnp.take_along_axis(vals, jnp.clip(k - 1, 0, cap - 1)[:, None], axis=-1)[:, 0]
    thr_k = jnp.where(k <= cap, thr_k, lo)
    wide_k = k > cap
    thr_k = jax.lax.cond(jnp.any(wide_k & (k < v)), lambda: jnp.where(
        wide_k, _bisect(x, lo, hi, lambda keep: keep.sum(-1) >= k), thr_k), lambda: thr_k)
    if floor is not None:  # min-p's survivors are the top-ranked tokens: top-k of them
        thr_k = jnp.maximum(thr_k, floor)  # is the higher of the two thresholds

    # Nucleus over the top-k set: keep tokens whose preceding mass is below top_p.
    e = jnp.exp(x - hi[:, None])
    total = jnp.sum(jnp.where(x >= thr_k[:, None], e, 0.0), axis=-1)
    pc = jnp.where(vals >= thr_k[:, None], jnp.exp(vals - hi[:, None]), 0.0) / total[:, None]
    cum = jnp.cumsum(pc, axis=-1)
    kept = jnp.maximum(jnp.sum((cum - pc) < top_p[:, None], axis=-1), 1)
    thr_p = jnp.take_along_axis(vals, (jnp.minimum(kept, cap) - 1)[:, None], axis=-1)[:, 0]
    # Exact when the nucleus closes inside the candidates (or top_p is off).
    inside = (top_p >= 1) | (cum[:, -1] >= top_p)
    mass = lambda keep: jnp.sum(jnp.where(keep & (x >= thr_k[:, None]), e, 0.0), -1)  # noqa: E731
    thr_p = jax.lax.cond(jnp.any(~inside), lambda: jnp.where(
        inside, thr_p, _bisect(x, lo, hi, lambda keep: mass(keep) >= top_p * total)),
        lambda: thr_p)
    return jnp.where(top_p >= 1, thr_k, jnp.maximum(thr_k, thr_p))


def min_p_floor(x, min_p):
    """f32[B]: the scaled logit below which a token is less likely than ``min_p`` (f32[B])
    times the row's most likely one (p >= min_p * p_max is x >= max(x) + log(min_p); min_p 0:
    -inf, nothing dropped)."""
    return jnp.max(x, axis=-1) + jnp.log(min_p)


def sample_tokens(logits, keys, sampling: SamplingArrays):
    """i32[B] next tokens from f32[B, V] logits; ``keys`` are raw u32[B, 2] PRNG keys.

    Banned ids (a row's stop tokens until its ``min_tokens`` are out, as vLLM masks them) get
    -inf logits first, for greedy and sampled rows alike."""
    hot = sampling.temperature > 0
    b, v = logits.shape
    banned = sampling.banned
    logits = logits.at[jnp.arange(b)[:, None], jnp.where(banned >= 0, banned, v)].set(
        -jnp.inf, mode="drop")

    def greedy():
        return argmax(logits)

    def stochastic():
        step_keys = jax.vmap(jax.random.fold_in)(keys, sampling.step)
        u = jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float32))(step_keys)
        x = logits / jnp.maximum(sampling.temperature, 1e-6)[:, None]
        filtered = (sampling.top_k > 0) | (sampling.top_p < 1) | (sampling.min_p > 0)
        thr = jax.lax.cond(jnp.any(filtered & hot),
                           lambda: keep_threshold(x, sampling.top_k, sampling.top_p,
                                                  min_p_floor(x, sampling.min_p)),
                           lambda: jnp.full(x.shape[:1], -jnp.inf))
        x = jnp.where(x >= thr[:, None], x, -jnp.inf)
        drawn = inverse_cdf(x, u)
        # The argmax pass only when some row is greedy.
        return jnp.where(hot, drawn, jax.lax.cond(jnp.all(hot), lambda: drawn, greedy))

    return jax.lax.cond(jnp.any(hot), stochastic, greedy)


sample = stored_jit(sample_tokens)  # the same, as its own program (fork samples, tests)


@functools.partial(stored_jit, static_argnums=(2,))
def token_logprobs(logits, tokens, k: int):
    """Log-probabilities of f32[B, V] logits (fp32 log-softmax): the chosen ``tokens``' (f32[B])
    with their rank (i32[B], 1 = the most likely; ties share the better rank), and the ``k``
    most likely ids (i32[B, k]) with theirs (f32[B, k])."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logits > chosen[:, None], axis=-1).astype(jnp.int32)
    top, ids = jax.lax.top_k(logits, k)
    return chosen - lse, rank, ids.astype(jnp.int32), top - lse[:, None]
