"""The TPU weight-only quantized matmul, run on CPU by the Pallas TPU interpreter, against
``quantized_matmul_reference``.

Axes: T tokens, I inputs, O outputs, G groups. Shapes are small (I = 1024, O = 384) but the
knobs give several steps along every grid axis (the accumulator carried across I blocks, zero
rows padding T, a partial last O block), as the real shapes do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_quant_block_sizes as sizes
from pallas_kernels.quant_matmul import quantized_matmul_reference
from pallas_kernels.tpu_quant_matmul import quantized_matmul_tpu

TOL = {jnp.float32: dict(atol=1e-4, rtol=1e-4), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
I, O = 1024, 384


def make_weight(bits: int, group: int | None, *, seed: int = 0, scale_dtype=jnp.float32,
                offset: bool | None = None, inputs: int = I, outputs: int = O):
    """Random integers with scales sized so that outputs are O(1) for unit-normal x."""
    rng = np.random.default_rng(seed)
    groups = 1 if group is None else inputs // group
    top = 127 if bits == 8 else 8
    scale = rng.uniform(0.5, 1.5, (groups, outputs)) / (top * np.sqrt(inputs))
    if bits == 8:
        q = rng.integers(-127, 128, (inputs, outputs)).astype(np.int8)
    else:
        q = rng.integers(0, 256, (inputs // 2, outputs)).astype(np.uint8)
    with_offset = bits == 4 if offset is None else offset
    off = -8 * scale * rng.uniform(0.8, 1.2, scale.shape) if with_offset else None
    return (jnp.asarray(q), jnp.asarray(scale, scale_dtype),
            None if off is None else jnp.asarray(off, scale_dtype))


def make_x(t: int, dtype, *, seed: int = 1, inputs: int = I):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(t, inputs)), dtype)


def run_interpreted(*args, **kwargs):
    with pltpu.force_tpu_interpret_mode():
        return jax.block_until_ready(quantized_matmul_tpu(*args, **kwargs))


def assert_matches_reference(x, q, scale, offset, *, bits, **knobs):
    out = run_interpreted(x, q, scale, offset, bits=bits, **knobs)
    want = quantized_matmul_reference(x, q, scale, offset, bits=bits)
    assert out.shape == want.shape and out.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               **TOL[x.dtype.type])


# (bits, group, knobs): each scheme with block_i below I, so the accumulator spans I blocks.
SCHEMES = {
    "int8": (8, None, dict(block_i=256)),
    "int8-g32": (8, 32, dict(block_i=256)),
    "int4-g32": (4, 32, dict(block_i=256)),
    "int4-g64": (4, 64, dict(block_i=512)),
    "int4-g128": (4, 128, {}),  # 8 groups: one block of all I (the legal default)
}


def _cases():
    """Every scheme at every T in CI, the dtype alternating so that each scheme and each T meet
    both; the other dtype of each under -m slow."""
    out = []
    for n, (scheme, t) in enumerate((s, t) for s in SCHEMES for t in (1, 8, 40)):
        for k, (dtype, name) in enumerate(((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))):
            marks = [] if (n + k) % 2 == 0 else [pytest.mark.slow]
            out.append(pytest.param(scheme, t, dtype, id=f"{scheme}-{t}-{name}", marks=marks))
    return out


@pytest.mark.parametrize("scheme, t, dtype", _cases())
def test_matches_reference(scheme, t, dtype):
    bits, group, knobs = SCHEMES[scheme]
    q, scale, offset = make_weight(bits, group)
    assert_matches_reference(make_x(t, dtype), q, scale, offset, bits=bits, **knobs)


@pytest.mark.parametrize("bits, group", [(8, None), (4, 32)])
def test_o_not_a_multiple_of_block_o(bits, group):
    """An LM head: O = 384 in blocks of 256, so the last block reads past the weight's end."""
    q, scale, offset = make_weight(bits, group, seed=2)
    assert_matches_reference(make_x(8, jnp.bfloat16), q, scale, offset, bits=bits,
                             block_o=256, block_i=512)


def test_t_blocks_pad_with_zero_rows():
    """T = 40 in blocks of 16: three T blocks, the last one padded."""
    q, scale, offset = make_weight(4, 64, seed=3)
    assert_matches_reference(make_x(40, jnp.bfloat16), q, scale, offset, bits=4, block_t=16,
                             block_i=512, block_o=128)


@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float16])
def test_scales_of_any_float_dtype(scale_dtype):
    q, scale, offset = make_weight(4, 32, seed=4, scale_dtype=scale_dtype)
    assert_matches_reference(make_x(8, jnp.float32), q, scale, offset, bits=4, block_i=256)


def test_int8_with_offset_per_channel_and_grouped():
    for group in (None, 64):
        q, scale, offset = make_weight(8, group, seed=5, offset=True)
        assert_matches_reference(make_x(8, jnp.float32), q, scale, offset, bits=8,
                                 block_i=512)


def test_out_dtype_and_interpret_flag():
    """``interpret=True`` runs the TPU interpreter without the context manager."""
    q, scale, offset = make_weight(4, 128, seed=6)
    x = make_x(8, jnp.bfloat16)
    out = quantized_matmul_tpu(x, q, scale, offset, bits=4, interpret=True,
                               out_dtype=jnp.float32)
    want = quantized_matmul_reference(x, q, scale, offset, bits=4, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-2, rtol=2e-2)


def test_the_weight_enters_the_kernel_as_integers():
    """No float copy of the weight outside the kernel: q is an operand of the pallas_call
    as it is, and nothing else in the program reads it."""
    q, scale, offset = make_weight(4, 32, seed=7)
    jaxpr = jax.make_jaxpr(lambda x, q, s, o: quantized_matmul_tpu(x, q, s, o, bits=4))(
        make_x(8, jnp.bfloat16), q, scale, offset)
    (inner,) = [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    body = inner.params["jaxpr"].jaxpr
    q_var = body.invars[1]
    readers = [e.primitive.name for e in body.eqns if q_var in e.invars]
    assert readers == ["pallas_call"], readers


@pytest.mark.parametrize("kwargs, name", [
    (dict(block_o=200), "block_o"),
    (dict(block_i=384), "block_i"),  # does not divide I = 1024
    (dict(block_i=128), "block_i"),  # 4 groups of 32: under the 8 rows of a scale block
    (dict(block_t=12), "block_t"),  # not a multiple of bf16's 16-row tile
    (dict(bits=6), "bits"),
])
def test_bad_knobs_name_the_argument(kwargs, name):
    q, scale, offset = make_weight(4, 32)
    with pytest.raises(ValueError, match=name):
        quantized_matmul_tpu(make_x(40, jnp.bfloat16), q, scale, offset,
                             **{"bits": 4, **kwargs})


def test_bad_inputs_name_the_argument():
    q, scale, offset = make_weight(4, 32)
    x = make_x(8, jnp.bfloat16)
    cases = [
        ((x.astype(jnp.int32), q, scale, offset), "x"),
        ((make_x(8, jnp.bfloat16, inputs=512), q, scale, offset), "x must be"),
        ((x, q.astype(jnp.int8), scale, offset), "q must be"),
        ((x, q, scale.astype(jnp.int32), offset), "scale"),
        ((x, q, scale, None), "offset"),
        ((x, q, scale[:, :256], offset), "scale"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            quantized_matmul_tpu(*args, bits=4)
    q16, s16, o16 = make_weight(4, 16)  # groups of 16 inputs: 8 byte rows, under any tile
    with pytest.raises(ValueError, match="scale"):
        quantized_matmul_tpu(x, q16, s16, o16, bits=4)


def test_default_blocks_fit_the_vmem_budget():
    """The defaults at real shapes: decode and prefill, the awkward I = 11008 (86 groups of
    128: no 8-group block divides it, so the block is all of I and narrower in O)."""
    for t, i, o, bits, group in [(1, 4096, 14336, 8, None), (512, 14336, 4096, 4, 128),
                                 (16, 11008, 4096, 4, 128), (2048, 4096, 128256, 4, 32)]:
        groups = 1 if group is None else i // group
        kw = dict(bits=bits, group=group or i, groups=groups, x_dtype=jnp.bfloat16,
                  scale_dtype=jnp.float32, out_dtype=jnp.bfloat16, has_offset=bits == 4)
        blocks = sizes.quant_blocks(t, i, o, **kw)
        assert sizes.block_i_error(blocks.block_i, i, group or i, groups) is None, blocks
        assert blocks.block_o % 128 == 0 and blocks.block_t <= max(t, 128), blocks
        assert sizes.vmem_bytes(blocks, **kw) <= sizes.VMEM_BUDGET, blocks
