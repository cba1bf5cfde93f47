"""Shared pieces of the GPU (Pallas/Triton) paged-attention kernels: validation, page-pool
flattening and the online-softmax loop over a range of pages.

Axes: B sequences, T query tokens (flat), H query heads, K kv heads, G = H // K query heads per
kv head, R rows of one query block (G padded, times query tokens), D head_dim, L layers,
P pages per (layer, kv head), S page_size, W pages per page-table row, N = ppb * S keys per tile
(ppb = pages per block), F = L * K * P page rows of the flattened pool.

Pages are packed (``layout.py``): ``[..., S, 2D]`` with the key in ``[:D]`` and the value in
``[D:]`` of each slot; a tile loads the two halves of the same page rows.

Why a flattened pool: ``[L, K, P, S, 2D]`` (or ``[K, P, S, 2D]``) is reshaped to ``[F, S, 2D]``,
a bitcast that copies nothing, and the layer is folded into the page table as ``layer * K * P``.
The kernel then needs one gather index per page (``table + kv_head * P``), the same code serves
the 4-D and 5-D forms, and a traced ``layer`` inside a ``lax.scan`` never slices the pool.
Triton switches to 64-bit pointer offsets by itself once the pool exceeds 4 GiB.

Quantized pages (int8, float8_e4m3fn; ``quant.py``) come with ``kv_scales`` i32 ``[..., S]``,
one word per slot, flattened like the pages to ``[F, S]``: a tile gathers the scale words of
the same page rows as its K|V rows, unpacks them with two integer ops and a bitcast, and
applies them to tiles that are already f32: the key scale (times sm_scale) to the score columns
(``q . (s k) = s (q . k)``), the value scale to the probability columns (``sum_j p_j s_j v_j``),
[R, N] multiplies where scaling the K and V tiles would take 2 N D (R <= 16 in decode, ~64 in
prefill). The int8/fp8 tile itself is only converted, exactly (|int8| <= 127 and e4m3's 3-bit
mantissa fit bf16), to the compute dtype, so ``tl.dot`` keeps its native bf16 (or TF32) MMA.
Slots past a sequence's length get scale words of 0, so NaN-poisoned stale scales never reach
the accumulator. The pool is never dequantized outside the kernel.

Why Triton shapes show up here: every tensor a Triton kernel touches must have a power-of-two
size, and ``tl.dot`` needs M, N, K >= 16. The static checks below enforce those rules even in
interpret mode, so CPU CI rejects tile configurations a GPU would fail to compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.quant import is_quantized, scale_rows_shape, scales_by_page

MASKED = -1e30  # finite: a fully masked row keeps m finite and yields zeros, never NaN
MMA_MIN = 16  # Triton's tl.dot minimum for M, N and K
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# How float32 tiles go through tl.dot (16-bit tiles always use their native MMA; the decode
# kernel's broadcast path, group <= 4, has no dot and computes in f32 whatever this says):
#   "tf32"    TF32 tensor cores, f32 accumulation: XLA's own default for f32 matmuls on GPU;
#   "tf32x3"  three TF32 passes (split mantissas): close to f32, about 3x the MMA work;
#   "bf16x3"  three bf16 passes: close to f32 (a little less than tf32x3), bf16 tensor cores;
#   "ieee"    exact f32 built from FMAs: slowest, register-heavy, long to compile.
F32_PRECISIONS = ("tf32", "tf32x3", "bf16x3", "ieee")
_FROM_CONFIG = {"highest": "ieee", "float32": "ieee", "F32_F32_F32": "ieee",
                "high": "tf32x3", "TF32_TF32_F32_X3": "tf32x3", "BF16_BF16_F32_X3": "bf16x3"}
_DOT_PRECISION = {"tf32": lax.Precision.DEFAULT, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                  "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
                  "ieee": lax.Precision.HIGHEST}


def resolve_f32_precision(precision: str | None, *, interpret: bool = False) -> str:
    """The f32 dot mode: ``precision`` itself, or (None) what jax_default_matmul_precision asks
    for ("highest"/"float32" -> "ieee", "high" -> "tf32x3", "BF16_BF16_F32_X3" -> "bf16x3",
    anything else -> "tf32"). In interpret mode the dots run on the CPU, which computes f32
    exactly and knows no TF32: "ieee" (after the name is validated)."""
    if precision is None:
        precision = _FROM_CONFIG.get(jax.config.jax_default_matmul_precision or "", "tf32")
    if precision not in F32_PRECISIONS:
        raise ValueError(f"precision must be one of {F32_PRECISIONS} or None, got {precision!r}")
    return "ieee" if interpret else precision


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_knob(name: str, value, *, pow2: bool = False) -> None:
    """A tuning knob must be None or a positive int (a power of two where it shapes a tile)."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if pow2 and not is_pow2(value):
        raise ValueError(f"{name} must be a power of two (Triton tile), got {value}")


def check_scales(kv_pages, kv_scales) -> None:
    """Quantized pages need i32 scale words, as the pool's scale array
    (``quant.scale_rows_shape``) or per page (``kv_pages.shape[:-1]``); others take none."""
    quantized = is_quantized(kv_pages.dtype)
    if quantized and kv_scales is None:
        raise ValueError(f"kv_scales is required with {kv_pages.dtype} (quantized) kv_pages: "
                         f"i32{list(kv_pages.shape[:-1])}, one word per page slot")
    if not quantized and kv_scales is not None:
        raise ValueError(f"kv_scales is only for quantized (int8, float8_e4m3fn) kv_pages, got "
                         f"{kv_pages.dtype} pages")
    shapes = (tuple(kv_pages.shape[:-1]), scale_rows_shape(kv_pages.shape))
    if kv_scales is not None and (tuple(kv_scales.shape) not in shapes
                                  or kv_scales.dtype != jnp.int32):
        raise ValueError(f"kv_scales must be i32{list(shapes[1])} (quant.scale_rows_shape) or "
                         f"i32{list(shapes[0])} (one word per page slot), got "
                         f"{kv_scales.dtype}{list(kv_scales.shape)}")


def check_common(q, kv_pages, page_table, layer, *, sm_scale, soft_cap, sliding_window,
                 kv_scales=None) -> tuple[int, int, int, int, int]:
    """Static checks shared by both kernels; returns (L, K, P, S, D) with L = 1 for 4-D pages."""
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D, got shape {q.shape}")
    if kv_pages.ndim not in (4, 5):
        raise ValueError(f"kv_pages must be [K, P, S, 2D] or [L, K, P, S, 2D], got "
                         f"{kv_pages.shape}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q dtype must be one of float32/bfloat16/float16, got {q.dtype}")
    if kv_pages.dtype != q.dtype and not is_quantized(kv_pages.dtype):
        raise ValueError(f"kv_pages dtype {kv_pages.dtype} must equal q dtype {q.dtype} (or be "
                         "int8 / float8_e4m3fn, with kv_scales)")
    check_scales(kv_pages, kv_scales)
    if kv_pages.ndim == 5 and layer is None:
        raise ValueError("layer is required with 5-D [L, K, P, S, 2D] pages")
    if kv_pages.ndim == 4 and layer is not None:
        raise ValueError("layer is only meaningful with 5-D [L, K, P, S, 2D] pages")
    if layer is not None and not isinstance(layer, int):
        if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
            raise ValueError(f"layer must be an int or an integer scalar, got {layer!r}")
    n_layers = kv_pages.shape[0] if kv_pages.ndim == 5 else 1
    k, p, s, d2 = kv_pages.shape[-4:]
    d = d2 // 2
    if isinstance(layer, int) and not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range for {n_layers} layers")
    h = q.shape[1]
    if h % k:
        raise ValueError(f"q heads ({h}) must be a multiple of kv_pages kv heads ({k})")
    if d2 != 2 * q.shape[2]:
        raise ValueError(f"kv_pages last dim ({d2}) must be 2 * q head_dim ({q.shape[2]}): keys "
                         "and values side by side")
    if not is_pow2(d) or d < MMA_MIN:
        raise ValueError(f"head_dim must be a power of two >= {MMA_MIN}, got {d}")
    if not is_pow2(s):
        raise ValueError(f"kv_pages page_size must be a power of two, got {s}")
    if page_table.ndim != 2 or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be i32[B, W], got {page_table.dtype}{page_table.shape}")
    if not isinstance(sm_scale, (int, float)):
        raise ValueError(f"sm_scale must be a Python float, got {sm_scale!r}")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive float, got {soft_cap!r}")
    check_knob("sliding_window", sliding_window)
    return n_layers, k, p, s, d


def check_lengths(name: str, x, n: int) -> None:
    if x.shape != (n,) or x.dtype != jnp.int32:
        raise ValueError(f"{name} must be i32[{n}], got {x.dtype}{x.shape}")


def flatten_pool(kv_pages, page_table, layer, *, pad_cols: int):
    """Pages as ``[F, S, 2D]`` rows and the page table as absolute rows of the (layer, head 0).

    Table entries are clamped to ``[0, P)`` so that stale or garbage ids in unused slots can never
    address memory outside the pool; their keys are masked by length anyway. ``pad_cols`` zero
    columns let a tile starting at any valid page read ``ppb`` ids without running off the row.
    """
    *_, k, p, s, d2 = kv_pages.shape
    table = jnp.clip(page_table, 0, p - 1)
    if layer is not None:
        n_layers = kv_pages.shape[0]
        table = table + jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1) * (k * p)
    table = jnp.pad(table, ((0, 0), (0, pad_cols)))
    return kv_pages.reshape(-1, s, d2), table


def flatten_scales(kv_scales, kv_pages):
    """Scale words as ``[F, S]`` rows, matching ``flatten_pool``'s pages. The pool's scale
    array is viewed per page by a free reshape; only when P is not a multiple of the pages per
    scale row does the view need a slice (a copy of the scales: engines size pools to avoid it).
    """
    *lead, p, s, _ = kv_pages.shape
    if tuple(kv_scales.shape) != (*lead, p, s):
        kv_scales = scales_by_page(kv_scales, s)[..., :p, :]
    return kv_scales.reshape(-1, s)


def unpack_scales(words):
    """i32 scale words -> (key scales, value scales) f32: each a bfloat16 in 16 of the bits,
    widened by masking or shifting (``quant.unpack_scales``, in ops Triton lowers)."""
    k = lax.bitcast_convert_type(words & jnp.int32(-65536), jnp.float32)  # 0xFFFF0000
    v = lax.bitcast_convert_type(lax.shift_left(words, jnp.int32(16)), jnp.float32)
    return k, v


def whole(shape):
    """A BlockSpec that hands every program the whole array (a pointer on GPU, no copy)."""
    zeros = (0,) * len(shape)
    return pl.BlockSpec(tuple(shape), lambda *_: zeros)


def attend_pages(q_rd, q_pos_r, row_ok_r, kv_len, lo_page, hi_page, page_rows, kv_ref, *,
                 page_size: int, pages_per_block: int, sm_scale: float, soft_cap,
                 sliding_window, mma: bool, precision: str, scale_ref=None):
    """Online softmax of ``q_rd`` over pages ``[lo_page, hi_page)`` -> (acc f32[R, D], m, l).

    ``page_rows(p0)`` returns the pool rows (``[ppb]`` ints) of logical pages ``p0..p0+ppb``;
    ``row_ok_r`` (None: all rows) masks query rows that belong to no query of this program.
    ``scale_ref`` (``[F, S]`` i32, quantized pages only) holds the scale words of the pool rows.
    The result is unnormalized: out = acc / l where l > 0, else 0 (the row saw no key).
    """
    rows, d = q_rd.shape
    n = pages_per_block * page_size
    f32 = jnp.float32
    prec = _DOT_PRECISION[precision] if q_rd.dtype == f32 else lax.Precision.DEFAULT
    # hi_page also stops a tile that overhangs its split from counting the next split's keys.
    key_hi = jnp.minimum(kv_len, hi_page * page_size)
    lowest_key = None
    if sliding_window is not None:
        lowest_key = q_pos_r - (sliding_window - 1)

    quantized = scale_ref is not None
    tile_dtype = q_rd.dtype if mma else f32  # what an int8/fp8 tile is converted to, exactly

    def body(i, carry):
        acc, m, l = carry
        p0 = lo_page + i * pages_per_block
        ids = page_rows(p0)
        k_nd = kv_ref[ids, :, pl.ds(0, d)].reshape(n, d)
        v_nd = kv_ref[ids, :, pl.ds(d, d)].reshape(n, d)
        k_pos = p0 * page_size + lax.iota(jnp.int32, n)
        key_ok = k_pos < key_hi
        mask = key_ok[None, :] & (k_pos[None, :] <= q_pos_r[:, None])
        if row_ok_r is not None:
            mask &= row_ok_r[:, None]
        if lowest_key is not None:
            mask &= k_pos[None, :] >= lowest_key[:, None]
        if quantized:  # scales per key column, of the same pool rows (module docstring)
            # Stale slots may hold NaN scale words: past the length both scales are an exact 0
            # (the key columns are masked below; a value column must not turn 0 into NaN).
            # Selecting the word, not the unpacked value scale, saves sm_90 a register.
            words = jnp.where(key_ok, scale_ref[ids, :].reshape(n), 0)
            k_scale, v_scale = unpack_scales(words)
            k_nd, v_nd = k_nd.astype(tile_dtype), v_nd.astype(tile_dtype)
        # Keys past the length may come from freed pages (possibly NaN-poisoned): zero them so
        # that 0 * NaN never reaches the accumulator. (An int8 value is never NaN.)
        if not (quantized and jnp.issubdtype(kv_ref.dtype, jnp.integer)):
            v_nd = jnp.where(key_ok[:, None], v_nd, jnp.zeros_like(v_nd))
        if mma:
            s = lax.dot_general(q_rd, k_nd, (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=f32)
        else:  # a few rows: a broadcast multiply-reduce avoids padding G up to the MMA tile
            s = jnp.sum(q_rd.astype(f32)[:, None, :] * k_nd.astype(f32)[None, :, :], axis=-1)
        s = s * (k_scale * sm_scale)[None, :] if quantized else s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        # The where matters while a row has seen only masked keys: then m_new == MASKED too.
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        p_v = p * v_scale[None, :] if quantized else p
        if mma:
            pv = lax.dot_general(p_v.astype(v_nd.dtype), v_nd, (((1,), (0,)), ((), ())),
                                 precision=prec, preferred_element_type=f32)
        else:
            pv = jnp.sum(p_v[:, :, None] * v_nd.astype(f32)[None, :, :], axis=1)
        return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=-1)

    n_iter = (jnp.maximum(hi_page - lo_page, 0) + pages_per_block - 1) // pages_per_block
    init = (jnp.zeros((rows, d), f32), jnp.full((rows,), MASKED, f32), jnp.zeros((rows,), f32))
    return lax.fori_loop(0, n_iter, body, init)


def pad_groups(x, k: int, g: int, rows: int):
    """``[N, K*G, D]`` -> ``[N, K, rows, D]`` with zero query heads appended to each group."""
    y = x.reshape(x.shape[0], k, g, x.shape[-1])
    return y if rows == g else jnp.pad(y, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
