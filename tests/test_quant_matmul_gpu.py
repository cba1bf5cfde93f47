"""The GPU weight-only quantized matmul (Pallas/Triton) in interpret mode on CPU, against
``quantized_matmul_reference``: int8 per channel and g32, int4 g32/g64/g128, decode (padded to
16 rows, split-K) and prefill (masked rows) sizes of T, f32 and bf16 activations.

Weights are random integers with scales near ``1 / (8 sqrt(I))``, so outputs are O(1) and one
tolerance per dtype fits every case: f32 runs exact f32 dots in interpret mode; bf16 rounds the
dequantized grouped tile and the output to bf16.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_quant_matmul import quantized_matmul_gpu
from pallas_kernels.quant_matmul import quantized_matmul_reference

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# On a GPU the same tests can run the compiled kernel (as tests/test_kernels_gpu.py does).
INTERPRET = os.environ.get("JAXKV_KERNELS_ON_DEVICE") != "1"
I, O = 256, 256
SCHEMES = {"int8": (8, None), "int8-g32": (8, 32), "int4-g32": (4, 32), "int4-g64": (4, 64),
           "int4-g128": (4, 128)}


def _weight(rng, inputs, outputs, bits, group, *, offset=None, dtype=jnp.float32):
    """Random (q, scale, offset) in the quant_matmul layout; int4 always has an offset."""
    groups = 1 if group is None else inputs // group
    if bits == 8:
        q = jnp.asarray(rng.integers(-127, 128, (inputs, outputs)), jnp.int8)
        levels = 127
    else:
        q = jnp.asarray(rng.integers(0, 256, (inputs // 2, outputs)), jnp.uint8)
        levels = 8
    scale = rng.uniform(0.5, 1.5, (groups, outputs)) / (levels * np.sqrt(inputs))
    off = None
    if offset or (offset is None and bits == 4):
        off = jnp.asarray(-levels * scale * rng.uniform(0.8, 1.2, (groups, outputs)), dtype)
    return q, jnp.asarray(scale, dtype), off


def _check(x, q, scale, offset, bits, **knobs):
    got = quantized_matmul_gpu(x, q, scale, offset, bits=bits, interpret=INTERPRET, **knobs)
    want = quantized_matmul_reference(x, q, scale, offset, bits=bits)
    assert got.shape == want.shape and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOL[x.dtype.type])


CASES = [(scheme, tokens) for scheme in SCHEMES for tokens in (1, 3, 16, 40)]


# Every scheme at every T; the dtype alternates so that each scheme and each T meet both.
@pytest.mark.parametrize("scheme, tokens, dtype", [
    (scheme, t, (jnp.float32, jnp.bfloat16)[n % 2]) for n, (scheme, t) in enumerate(CASES)])
def test_matches_reference(scheme, tokens, dtype):
    rng = np.random.default_rng(tokens)
    bits, group = SCHEMES[scheme]
    q, scale, offset = _weight(rng, I, O, bits, group)
    x = jnp.asarray(rng.standard_normal((tokens, I)), dtype)
    _check(x, q, scale, offset, bits)


@pytest.mark.parametrize("bits, group, tokens, knobs", [
    (4, 32, 3, {}),  # decode, split-K, the last 128-column block 72 wide
    (8, None, 40, dict(block_o=64)),  # prefill, masked rows and columns
])
def test_outputs_not_a_multiple_of_the_block(bits, group, tokens, knobs):
    rng = np.random.default_rng(1)
    q, scale, offset = _weight(rng, I, 200, bits, group)
    x = jnp.asarray(rng.standard_normal((tokens, I)), jnp.float32)
    _check(x, q, scale, offset, bits, **knobs)


@pytest.mark.parametrize("bits, tokens", [(8, 3), (4, 40)])
def test_per_channel_with_offset(bits, tokens):
    """G = 1 with an offset: ``sum(x) * offset`` is added once, not once per split."""
    rng = np.random.default_rng(2)
    q, scale, offset = _weight(rng, I, O, bits, None, offset=True)
    x = jnp.asarray(rng.standard_normal((tokens, I)), jnp.float32)
    _check(x, q, scale, offset, bits, num_splits=2)


def test_16bit_scales_and_f16_x():
    rng = np.random.default_rng(3)
    q, scale, offset = _weight(rng, I, O, 4, 64, dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((5, I)), jnp.float16)
    got = quantized_matmul_gpu(x, q, scale, offset, bits=4, interpret=INTERPRET)
    want = quantized_matmul_reference(x, q, scale, offset, bits=4)
    assert got.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=1e-2, rtol=1e-2)


def test_explicit_knobs():
    rng = np.random.default_rng(4)
    q, scale, offset = _weight(rng, I, O, 8, 32)
    x = jnp.asarray(rng.standard_normal((40, I)), jnp.float32)
    _check(x, q, scale, offset, 8, block_t=16, block_o=64, block_i=128, num_splits=2,
           num_warps=8, num_stages=2)


def test_no_float_weight_outside_the_kernel():
    """The compiled (non-interpret) program passes the integer weight to the kernel as is: no
    op outside the pallas_call makes an [I, O]-sized array."""
    rng = np.random.default_rng(5)
    q, scale, offset = _weight(rng, I, O, 4, 32)
    x = jnp.ones((1, I), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda *a: quantized_matmul_gpu(*a, bits=4))(x, q, scale, offset)
    eqns = jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns  # inside the jit
    assert [e.primitive.name for e in eqns].count("pallas_call") == 1
    for e in eqns:
        if e.primitive.name != "pallas_call":
            assert all(np.prod(v.aval.shape) < I * O // 2 for v in e.outvars), e


@pytest.mark.parametrize("change, match", [
    (dict(x=jnp.ones((2, I), jnp.int32)), "x dtype"),
    (dict(x=jnp.ones((2, I + 2), jnp.float32)), "x must be"),
    (dict(q=jnp.ones((I, O), jnp.uint8)), "q must be"),
    (dict(scale=jnp.ones((2, O), jnp.int32)), "scale must be a float"),
    (dict(scale=jnp.ones((3, O), jnp.float32)), "scale must be"),
    (dict(offset=jnp.ones((1, O), jnp.float32)), "offset must match"),
    (dict(bits=3), "bits must be"),
    (dict(block_i=96), "block_i must be a power of two"),
    (dict(block_i=512), "block_i must be >= 16 and divide"),
    (dict(block_t=8), "block_t and block_o"),
    (dict(num_warps=0), "num_warps must be a positive int"),
    (dict(num_splits=3), "num_splits=3 must divide"),
    (dict(precision="fast"), "precision must be one of"),
])
def test_bad_inputs_name_the_argument(change, match):
    args = dict(x=jnp.ones((2, I), jnp.float32), q=jnp.ones((I, O), jnp.int8),
                scale=jnp.ones((2, O), jnp.float32), offset=None, bits=8, interpret=True)
    with pytest.raises(ValueError, match=match):
        quantized_matmul_gpu(**{**args, **change})


def test_group_sizes_a_kernel_cannot_tile():
    x = jnp.ones((1, I), jnp.float32)
    q4, scale = jnp.ones((I // 2, O), jnp.uint8), jnp.ones((I // 16, O), jnp.float32)
    with pytest.raises(ValueError, match="block_i"):  # int4 g16: 8 byte rows, under tl.dot's 16
        quantized_matmul_gpu(x, q4, scale, scale, bits=4, interpret=True)
    x, q8, scale = jnp.ones((1, 384), jnp.float32), jnp.ones((384, O), jnp.int8), jnp.ones(
        (4, O), jnp.float32)
    with pytest.raises(ValueError, match="power-of-two group size"):  # groups of 96
        quantized_matmul_gpu(x, q8, scale, bits=8, interpret=True)
