"""Quantized KV pages: int8 or fp8 values with a scale per token and kv head.

Axes: L layers, K kv heads, P pages, S page_size, D head_dim, T tokens.

A quantized pool is two arrays:

* ``kv_pages`` int8 or float8_e4m3fn ``[L, K, P, S, 2D]``: the packed K|V layout of
  ``layout.py``, holding ``round(x / scale)``;
* ``kv_scales`` i32: one 32-bit word per slot, the key's scale in its high 16 bits and the
  value's in its low 16, each a bfloat16, so ``x ~= value * scale``. The words of a page are
  ``[S]``; pages are packed ``G = 128 // S`` to a row of 128 words (`scale_rows_shape`): the
  array is ``[L, K, ceil(P / G), G * S]``, and page p's words are row ``p // G``, columns
  ``(p % G) * S ...``. `scales_by_page` views it as ``[L, K, P', S]`` (a free reshape where
  arrays are row-major: CPU, GPU).

Why one packed word: per token and kv head the scales cost 4 bytes next to 2D bytes of int8
values (3% at D = 64), where two f32 scales would cost 8 (6%, and int8 would fall short of 1.9x
the tokens per byte of bf16 KV). A bfloat16 widens to float32 by a 16-bit shift, so unpacking is
two integer ops and a bitcast on every backend (the Mosaic and Triton compilers included), and
a 32-bit array is one a TPU kernel can DMA a single row of (16-bit ones need 16-row tiles).
Why rows of 128: XLA:TPU tiles the two minor dims of an array by (8, 128); an i32 ``[..., P, S]``
array with S < 128 would pad each page's S words to 128 lanes, so XLA stores it page-minor
instead, from which no kernel DMA can read one page, and every kernel call would copy (relayout)
the whole array. Rows of 128 words lie row-major on TPU, unpadded, one page's words in one row.

The scale is ``amax(|x|) / qmax`` over the D values of the token's key (or value), rounded to
bfloat16; values are ``x / scale`` rounded (int8) or cast (fp8) after clipping to ``qmax``.
The step quantizes K and V as it writes them, once: scales are never recomputed.

Keys are quantized in a rotated basis: the pages hold ``k R`` (`rotate`), R an orthogonal
D x D matrix (`key_rotation`: a Hadamard matrix with fixed sign flips), and attention takes its
queries as ``q R``, so ``(q R) . (k R) = q . k`` exactly in real arithmetic and no kernel
changes. Why: trained models' keys have a few outlier channels (KIVI, KVQuant), several times
the median channel's magnitude, and one absmax scale per token spends the int8 range on them;
R spreads every channel over all D, so a key's largest rotated entry is near its RMS and the
rounding step shrinks (SmolLM2-135M, int8: mean |logit error| 0.069 -> 0.041, teacher-forced
top-1 agreement with f32 KV 98.71% -> 99.17%; per-channel smoothing, mean subtraction and
KIVI's per-page channel scales measured less, docs/BENCHMARKS.md). This is QuaRot's randomized
Hadamard, applied to keys only. R depends on D alone: no data, no weights, so pages stay valid
across `update_params`, prefix sharing, page copies, the host tier and disaggregated transfers.
`quantize_kv` and `dequantize_pages` are the per-token format and know nothing of R: the write
path rotates keys before them, and the caller rotates queries before attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
_STORAGE = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_DTYPE = jnp.int32
NAN_SCALES = 0x7FC07FC0  # both halves a bfloat16 NaN: poisons a slot whatever its values


SCALE_ROW = 128  # words per row of the scale array (a TPU lane tile)


def pages_per_scale_row(page_size: int) -> int:
    """G: pages whose S scale words share one row: 128 / S when S divides 128, else 1."""
    if page_size < SCALE_ROW and SCALE_ROW % page_size == 0:
        return SCALE_ROW // page_size
    return 1


def scale_rows_shape(kv_pages_shape) -> tuple[int, ...]:
    """The scale array's shape for pages ``[..., P, S, 2D]``: ``[..., ceil(P / G), G * S]``."""
    *lead, p, s, _ = kv_pages_shape
    g = pages_per_scale_row(s)
    return (*lead, -(-p // g), g * s)


def to_scale_rows(words):
    """Per-page words ``[..., P, S]`` -> the scale array (pages padded to a multiple of G)."""
    *lead, p, s = words.shape
    g = pages_per_scale_row(s)
    pad = -p % g
    if pad:
        words = jnp.pad(words, [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
    return words.reshape(*lead, (p + pad) // g, g * s)


def scales_by_page(kv_scales, page_size: int):
    """The scale array ``[..., R, G * S]`` viewed per page: ``[..., R * G, S]`` (a reshape)."""
    *lead, r, w = kv_scales.shape
    return kv_scales.reshape(*lead, r * (w // page_size), page_size)


def storage_dtype(kv_cache_dtype: str, compute_dtype):
    """The dtype pages are stored in for ``kv_cache_dtype`` ("auto": the compute dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    return jnp.dtype(compute_dtype if kv_cache_dtype == "auto" else _STORAGE[kv_cache_dtype])


def is_quantized(dtype) -> bool:
    """True for the page dtypes that carry scales (int8, float8_e4m3fn)."""
    return jnp.dtype(dtype) in _QMAX


def qmax(dtype) -> float:
    return _QMAX[jnp.dtype(dtype)]


def _bf16_bits(x_f32):
    """The bfloat16 nearest each f32, as its 16 bits in the low half of an int32."""
    bits = jax.lax.bitcast_convert_type(x_f32.astype(jnp.bfloat16), jnp.uint16)
    return bits.astype(jnp.int32)


def pack_scales(k_scale, v_scale):
    """f32 key and value scales (same shape) -> i32 words (bfloat16 of each, k high)."""
    return (_bf16_bits(k_scale) << 16) | _bf16_bits(v_scale)


def unpack_scales(words):
    """i32 words -> (key scales, value scales), f32 of the same shape."""
    words = words.astype(jnp.int32)
    k = jax.lax.bitcast_convert_type(words & jnp.int32(-65536), jnp.float32)  # 0xFFFF0000
    v = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
    return k, v


def quantize(x, dtype):
    """x f[..., D] -> (values of ``dtype`` [..., D], f32 scales [...] exactly bfloat16).

    The scale maps the largest |x| of each row to the format's largest finite value; an
    all-zero row gets scale 0 and values 0."""
    x = x.astype(jnp.float32)
    top = qmax(dtype)
    scale = (jnp.max(jnp.abs(x), axis=-1) / top).astype(jnp.bfloat16).astype(jnp.float32)
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    y = jnp.clip(x * inv[..., None], -top, top)
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(values, scale):
    """values [..., D] and f32 scales [...] -> f32 [..., D]."""
    return values.astype(jnp.float32) * scale[..., None]


def quantize_kv(k, v, dtype):
    """K and V f[T, K, D] -> packed values [T, K, 2D] of ``dtype`` and scale words i32[T, K]."""
    kq, ks = quantize(k, dtype)
    vq, vs = quantize(v, dtype)
    return jnp.concatenate([kq, vq], axis=-1), pack_scales(ks, vs)


def dequantize_pages(kv_pages, kv_scales):
    """Packed pages [..., S, 2D] and their scale words per page [..., S] (`scales_by_page`) ->
    f32 [..., S, 2D] (the reference for what every kernel computes in its inner loop)."""
    d = kv_pages.shape[-1] // 2
    ks, vs = unpack_scales(kv_scales)
    return jnp.concatenate([dequantize(kv_pages[..., :d], ks),
                            dequantize(kv_pages[..., d:], vs)], axis=-1)


# ---- the key rotation ---------------------------------------------------------------------

def _signs(n: int) -> np.ndarray:
    """A fixed +-1 pattern (the top bit of murmur3's 32-bit finalizer of each index): breaks the
    alignment of structured inputs with Hadamard rows, as QuaRot's random signs do, yet is the
    same on every machine and version (pages written by one process are read by another)."""
    def fmix32(h):
        h = (h ^ h >> 16) * 0x85EBCA6B % 2**32
        h = (h ^ h >> 13) * 0xC2B2AE35 % 2**32
        return h ^ h >> 16

    return np.array([1.0 - 2.0 * (fmix32(i + 1) >> 31) for i in range(n)], np.float32)


@functools.lru_cache(maxsize=16)
def _rotation(d: int) -> np.ndarray:
    r = np.zeros((d, d), np.float64)
    start, rest = 0, d
    while rest:  # block diagonal over D's binary digits, largest first (96 = 64 + 32)
        n = 1 << (rest.bit_length() - 1)
        h = np.ones((1, 1))
        while h.shape[0] < n:  # Sylvester: H_2n = [[H, H], [H, -H]]
            h = np.block([[h, h], [h, -h]])
        r[start:start + n, start:start + n] = h / np.sqrt(n)
        start, rest = start + n, rest - n
    r = (_signs(d)[:, None] * r).astype(np.float32)  # diag(signs) @ H: still orthogonal
    r.flags.writeable = False  # cached: shared by every caller
    return r


def key_rotation(head_dim: int) -> np.ndarray:
    """R f32[D, D], orthogonal (R R^T = I): the basis quantized pages store keys in. A
    sign-flipped Hadamard matrix, every entry +-1/sqrt(D) when D is a power of two (block
    diagonal over D's powers of two otherwise): it depends on D alone."""
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return _rotation(head_dim)


def rotate(x):
    """x f[..., D] -> x R in f32: a key before it is quantized, or a query before attention
    over quantized pages (``(q R) . (k R) = q . k``)."""
    r = jnp.asarray(key_rotation(x.shape[-1]))
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), r,
                      precision=jax.lax.Precision.HIGHEST)


def unrotate(y):
    """y f[..., D] -> y R^T in f32: a rotated key back in the model's basis (tests, tools)."""
    r = jnp.asarray(key_rotation(y.shape[-1]))
    return jnp.einsum("...e,de->...d", y.astype(jnp.float32), r,
                      precision=jax.lax.Precision.HIGHEST)
