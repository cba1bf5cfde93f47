"""The CPU quantized-matmul kernel (C++ XLA FFI) against a numpy model of its arithmetic and
against the float reference, on both of its code paths (AVX-512 VNNI and portable)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_quant_matmul as cpu
from pallas_kernels.quant_matmul import dequantize_reference, quantized_matmul_reference

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs a C++ compiler")

RNG = np.random.default_rng(0)


def weight(bits, i, o, group, scale_dtype=np.float32):
    """Random packed weight, scales and offsets (None for int8) as numpy arrays."""
    g = i // group
    if bits == 4:
        q = RNG.integers(0, 256, (i // 2, o)).astype(np.uint8)
        offset = (RNG.standard_normal((g, o)) * 0.02).astype(scale_dtype)
    else:
        q = RNG.integers(-127, 128, (i, o)).astype(np.int8)
        offset = None
    scale = (RNG.random((g, o)) * 0.01 + 0.002).astype(scale_dtype)
    return q, scale, offset


def numpy_model(x, q, scale, offset, bits):
    """The kernel's arithmetic, written out: x rounded to int8 per token and per 32 inputs
    (absmax, ties to even), exact integer sums per block, float scaling, and the offset times
    the float sum of x over each group."""
    t, i = x.shape
    values = (np.stack([q & 15, q >> 4], 1).reshape(i, -1) if bits == 4 else q).astype(np.int64)
    groups = scale.shape[0]
    amax = np.abs(x.reshape(t, i // 32, 32)).max(-1)
    xs = amax / 127
    inv = np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0)
    xq = np.clip(np.rint(x.reshape(t, i // 32, 32) * inv[..., None]), -127, 127).astype(np.int64)
    block_sums = np.einsum("tbk,bko->tbo", xq, values.reshape(i // 32, 32, -1))  # exact ints
    per_group = (block_sums * xs[..., None]).reshape(t, groups, -1, block_sums.shape[-1]).sum(2)
    y = np.einsum("tgo,go->to", per_group, scale.astype(np.float64))
    if offset is not None:
        xsum = x.reshape(t, groups, -1).sum(-1)
        y = y + np.einsum("tg,go->to", xsum, offset.astype(np.float64))
    return y, xs


CASES = [  # bits, I, O, group, T
    (4, 128, 48, 32, 1), (4, 256, 80, 64, 3), (4, 256, 96, 128, 5), (4, 576, 1536, 32, 2),
    (8, 128, 48, 128, 1), (8, 256, 80, 32, 4), (8, 576, 208, 576, 9), (4, 64, 1040, 32, 6),
]


@pytest.mark.parametrize("bits, i, o, group, t", CASES)
def test_kernel_equals_its_integer_arithmetic(bits, i, o, group, t):
    q, scale, offset = weight(bits, i, o, group)
    x = RNG.standard_normal((t, i)).astype(np.float32)
    got = np.asarray(cpu.quantized_matmul_cpu(x, q, scale, offset, bits=bits))
    want, _ = numpy_model(x, q, scale, offset, bits)
    # Integer sums are exact; what is left is float32 summation order.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bits, i, o, group, t", CASES[:4] + CASES[5:7])
def test_kernel_is_within_the_activation_rounding_bound_of_the_reference(bits, i, o, group, t):
    """|kernel - x @ w| <= sum_i |w[i, o]| * xs[t, block(i)] / 2: rounding x to int8 moves each
    x[t, i] by at most half its block's step, and nothing else is approximate."""
    q, scale, offset = weight(bits, i, o, group)
    x = RNG.standard_normal((t, i)).astype(np.float32)
    got = np.asarray(cpu.quantized_matmul_cpu(x, q, scale, offset, bits=bits))
    ref = np.asarray(quantized_matmul_reference(x, q, scale, offset, bits=bits))
    w = np.asarray(dequantize_reference(q, scale, offset, bits=bits))
    _, xs = numpy_model(x, q, scale, offset, bits)
    bound = np.einsum("tb,bo->to", xs / 2, np.abs(w).reshape(i // 32, 32, -1).sum(1))
    err = np.abs(got - ref)
    assert np.all(err <= bound * (1 + 1e-4) + 1e-5), float((err - bound).max())
    assert err.max() > 0  # x really is rounded: the bound is not vacuous for this test


def test_half_scales_read_as_stored():
    q, scale, offset = weight(4, 256, 64, 32, np.float16)
    x = RNG.standard_normal((2, 256)).astype(np.float32)
    got = np.asarray(cpu.quantized_matmul_cpu(x, q, scale, offset, bits=4))
    want, _ = numpy_model(x, q, scale.astype(np.float32), offset.astype(np.float32), 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_portable_path_equals_the_vector_path(tmp_path):
    """The same integer sums in the portable loop (forced by JAXKV_CPU_PORTABLE, in a fresh
    process: the choice is made once per process)."""
    args = {}
    shapes = {"a": (4, 256, 80, 64, 5), "b": (8, 128, 48, 32, 3)}
    for name, (bits, i, o, group, t) in shapes.items():
        q, scale, offset = weight(bits, i, o, group)
        x = RNG.standard_normal((t, i)).astype(np.float32)
        args[name] = (x, q, scale, offset, bits)
        np.savez(tmp_path / f"{name}.npz", x=x, q=q, scale=scale,
                 offset=np.zeros(0) if offset is None else offset)
    script = (
        "import sys, numpy as np\n"
        "from pallas_kernels import cpu_quant_matmul as cpu\n"
        "assert not cpu.has_vnni()\n"
        "for name, bits in (('a', 4), ('b', 8)):\n"
        "    d = np.load(sys.argv[1] + '/' + name + '.npz')\n"
        "    off = d['offset'] if d['offset'].size else None\n"
        "    y = cpu.quantized_matmul_cpu(d['x'], d['q'], d['scale'], off, bits=bits)\n"
        "    np.save(sys.argv[1] + '/' + name + '_out.npy', np.asarray(y))\n")
    env = dict(os.environ, JAXKV_CPU_PORTABLE="1", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(__file__)))
    for name, (x, q, scale, offset, bits) in args.items():
        portable = np.load(tmp_path / f"{name}_out.npy")
        vector = np.asarray(cpu.quantized_matmul_cpu(x, q, scale, offset, bits=bits))
        np.testing.assert_allclose(portable, vector, rtol=1e-5, atol=1e-5 * np.abs(vector).max())


def test_unsupported_shapes_are_refused_by_name():
    q, scale, offset = weight(4, 128, 40, 32)  # O = 40: not a multiple of 16
    x = np.ones((1, 128), np.float32)
    assert not cpu.supports(x.shape, q, scale, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.quantized_matmul_cpu(x, q, scale, offset, bits=4)
    with pytest.raises(ValueError, match="x must be"):
        cpu.quantized_matmul_cpu(np.ones((1, 64), np.float32), q, scale, offset, bits=4)


def test_jitted_program_has_the_call_and_no_float_weight():
    """Inside jit the weight stays integer: the program's only [I, O]-sized arrays are the
    packed weight itself (no convert or multiply producing a float copy)."""
    q, scale, offset = weight(4, 512, 1024, 32)
    x = jnp.ones((1, 512), jnp.float32)
    hlo = jax.jit(lambda x, q, s, m: cpu.quantized_matmul_cpu(x, q, s, m, bits=4)).lower(
        x, q, scale, offset).compile().as_text()
    assert cpu.TARGET in hlo
    assert "f32[512,1024]" not in hlo and "f32[256,1024]" not in hlo
