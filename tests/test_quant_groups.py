"""Group sizes: a weight whose inputs the scheme's group does not divide takes the largest
smaller group that does (SmolLM2's 576 hidden inputs under int4's 128), and the matmul kernels
refuse scales implying a group other than the one they are told (issue 43: a shard's scales
meant for other rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quant_oracle import numpy_dequantize

from jaxkv.model.quant import QuantScheme, group_for, placeholder_weight, qdot, quantize
from pallas_kernels import cpu_quant_matmul as cpu
from pallas_kernels.quant_matmul import (
    check_quantized_weight,
    kernel_takes,
    quantized_matmul,
    quantized_matmul_reference,
)

pytestmark = pytest.mark.host  # no engine: `make test-fast`

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("rows, spec, group", [
    (576, "int4", 64), (960, "int4", 64), (896, "int4", 128), (96, "int4-g64", 32),
    (576, "int8-g32", 32), (576, "int8", 576), (8960, "int4", 128),
])
def test_a_group_that_does_not_divide_the_inputs_falls_to_the_largest_that_does(rows, spec,
                                                                                  group):
    scheme = QuantScheme.parse(spec)
    assert group_for(rows, scheme) == group
    w = RNG.standard_normal((rows, 32)).astype(np.float32)
    qw = quantize(w, scheme)
    assert qw.group_size == group and qw.scale.shape == (rows // group, 32)
    assert placeholder_weight((rows, 32), scheme).scale.shape == qw.scale.shape
    step = np.repeat(np.asarray(qw.scale, np.float32), group, axis=0)
    assert np.all(np.abs(numpy_dequantize(qw) - w) <= step / 2 + 1e-6)


def test_inputs_no_group_divides_are_refused_naming_the_rule():
    with pytest.raises(ValueError, match=r"int4.*input size 40 is not a multiple of the group "
                                         r"size 128 or of a smaller one of \(32, 64, 128\)"):
        quantize(np.ones((40, 16), np.float32), QuantScheme(4, 128))


def operands(i=256, o=32, group=64):
    w = quantize(RNG.standard_normal((i, o)).astype(np.float32), QuantScheme(4, group))
    x = RNG.standard_normal((3, i)).astype(np.float32)
    return jnp.asarray(x), *(jnp.asarray(a) for a in (w.q, w.scale, w.offset))


def test_a_scale_implying_another_group_is_refused_by_every_entry_point():
    x, q, scale, offset = operands()  # 4 groups of 64
    assert check_quantized_weight(x.shape, q, scale, offset, 4, group_size=64)[2] == 64
    match = r"scale \[4, 32\] implies groups of 64 .* group_size=128"
    with pytest.raises(ValueError, match=match):
        check_quantized_weight(x.shape, q, scale, offset, 4, group_size=128)
    with pytest.raises(ValueError, match=match):
        quantized_matmul_reference(x, q, scale, offset, bits=4, group_size=128)
    with pytest.raises(ValueError, match=match):
        quantized_matmul(x, q, scale, offset, bits=4, group_size=128)
    for backend in ("reference", "cpu"):  # not a shape the kernel cannot tile: an error
        with pytest.raises(ValueError, match=match):
            kernel_takes(backend, x, q, scale, offset, bits=4, group_size=128)
    assert kernel_takes("reference", x, q, scale, offset, bits=4, group_size=64)
    want = quantized_matmul_reference(x, q, scale, offset, bits=4)
    got = quantized_matmul_reference(x, q, scale, offset, bits=4, group_size=64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=0)


@pytest.mark.skipif(not cpu.available(), reason="needs a C++ compiler")
def test_the_cpu_kernel_refuses_a_group_it_was_not_given():
    x, q, scale, offset = operands()
    with pytest.raises(ValueError, match="group_size=32"):
        cpu.quantized_matmul_cpu(x, q, scale, offset, bits=4, group_size=32)
    with pytest.raises(ValueError, match="group_size=32"):
        quantized_matmul(x, q, scale, offset, bits=4, backend="cpu", group_size=32)
    got = quantized_matmul(x, q, scale, offset, bits=4, backend="cpu", group_size=64)
    want = quantized_matmul_reference(x, q, scale, offset, bits=4)
    # the kernel rounds x to int8 per 32 inputs (Q8_0): ~1% of the output's size
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=0.05 * float(jnp.abs(want).max()))


def test_int4_on_a_576_wide_weight_multiplies_like_its_dequantized_form():
    """SmolLM2's hidden size under "int4": groups of 64, through the platform kernel."""
    w = quantize(RNG.standard_normal((576, 64)).astype(np.float32), QuantScheme.parse("int4"))
    w = jax.tree.map(jnp.asarray, w)
    x = RNG.integers(-127, 128, (2, 576)).astype(np.float32)
    x[:, ::32] = 127.0  # Q8_0 rounds these exactly: any kernel matches to float32 rounding
    want = x.astype(np.float64) @ numpy_dequantize(w).astype(np.float64)
    for kernel in ("cpu", "xla"):
        got = np.asarray(qdot(jnp.asarray(x), w, jnp.float32, kernel=kernel), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
