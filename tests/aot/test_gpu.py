"""sm_90 (H100/H200): every kernel and the Triton kernels of the real engine steps compile
through Triton -> PTX -> ptxas with no GPU, within shared memory, and with no register spills
in bf16 and in f32 at the default TF32 precision.

    JAXKV_AOT=1 python -m pytest tests/aot/test_gpu.py [-m slow]    (``make test-aot``)
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from tools import aot_gpu, aot_kernels, aot_steps

from pallas_kernels.gpu_quant_matmul import quantized_matmul_gpu

COLUMNS = ["kernel", "precision", "warps", "grid", "registers", "spill B (st/ld)",
           "shared KiB", "compile s"]


def _row(name, precision, r: aot_gpu.KernelReport):
    return [name, precision, r.num_warps, "x".join(map(str, r.grid)), r.registers,
            f"{r.spill_stores}/{r.spill_loads}", f"{r.smem_bytes / 1024:.0f}",
            f"{r.seconds:.1f}"]


def _cases(precisions):
    sample = aot_kernels.sweep(full=False)
    out = []
    for case in aot_kernels.sweep(full=True) + aot_kernels.EDGES:
        for p in (precisions if case.dtype == "float32" else (None,)):
            slow = case not in sample or p not in (None, "tf32")
            out.append(pytest.param(case, p, id=f"{case.name}-{p or 'native'}",
                                    marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("case, precision", _cases(("tf32", "tf32x3", "bf16x3", "ieee")))
def test_kernel_fits_sm90(case, precision, table):
    knobs = {"precision": precision} if precision else {}
    [r] = aot_gpu.kernel_reports(case.fn("gpu", **knobs), *case.all_shapes())
    table("GPU kernels, sm_90 (Triton -> PTX -> ptxas -v)", COLUMNS,
          _row(case.name, precision or case.dtype, r))
    # The 3-pass modes and exact f32 trade registers for accuracy: they are allowed to spill.
    assert not r.problems(allow_spills=precision in ("tf32x3", "bf16x3", "ieee"))


STEPS = [
    aot_steps.StepCase("llama-3.2-1b", "prefill", 1.0, 512, 16, 4096),
    aot_steps.StepCase("llama-3.2-1b", "decode", 1.0, 64, 64, 4096),
    aot_steps.StepCase("llama-3.2-3b", "prefill", 1.0, 512, 16, 4096),
    aot_steps.StepCase("llama-3.2-3b", "decode", 1.0, 64, 64, 4096),
    aot_steps.StepCase("llama-3-8b", "decode", 2.0, 128, 128, 8192),
    aot_steps.StepCase("llama-3.2-1b", "prefill", 1.0, 512, 16, 4096, kv_cache_dtype="int8"),
    # Gemma: head_dim 256, local and global layers (two kernels, one per window, switched by
    # the scanned layer's index), Gemma 2's attention soft cap.
    aot_steps.StepCase("gemma-2-2b", "prefill", 1.0, 512, 16, 8192, scan=True),
    aot_steps.StepCase("gemma-3-1b", "decode", 1.0, 64, 64, 8192, scan=True),
    # Window-only KV: the unrolled local layers read a pool of window slots.
    aot_steps.StepCase("gemma-3-1b", "decode", 1.0, 64, 64, 32768, scan=False, window_kv=True),
]


@pytest.mark.parametrize("case", [pytest.param(s, id=s.name.replace(" ", "-")) for s in [
    aot_steps.StepCase("llama-3.2-1b", "spec", 1.0, 64, 64, 4096)]])
def test_spec_step_kernels_fit_sm90(case, table):
    """Speculative decoding's spec step (8 rows of k + 1 = 8 tokens) lowered for CUDA: the
    ragged step's attention kernels, through ptxas."""
    step, params, state, *inputs = aot_steps.spec_step_inputs(case, "pallas-gpu", 8, 7)
    reports = [aot_gpu.compile_call(c) for c in aot_gpu.triton_calls(step, params, state, *inputs)]
    assert len(reports) == aot_steps.attention_kernels(case.model)
    for r in reports:
        table("Triton kernels of the engine steps, sm_90 (attention_impl='pallas-gpu')",
              ["step"] + COLUMNS, [case.name + " R=8 k=7"] + _row(r.name, case.dtype, r))
        assert not r.problems()


def test_draft_proposal_kernels_fit_sm90(table):
    """A draft model's proposal (Llama-3.2-1B int4, 8 rows, k = 4: a ragged forward, then a
    decode loop) lowered for CUDA: its attention kernels through ptxas."""
    case = aot_steps.StepCase("llama-3.2-1b", "draft", 0.5, 64, 64, 8192,
                              quantization="int4-g128")
    step, params, state, *inputs = aot_steps.draft_inputs(case, "pallas-gpu", 8, 4)
    reports = [aot_gpu.compile_call(c) for c in aot_gpu.triton_calls(step, params, state, *inputs)]
    assert reports
    for r in reports:
        table("Triton kernels of the engine steps, sm_90 (attention_impl='pallas-gpu')",
              ["step"] + COLUMNS, [case.name + " R=8 k=4"] + _row(r.name, case.dtype, r))
        assert not r.problems()


@pytest.mark.parametrize("case", [pytest.param(s, id=s.name.replace(" ", "-")) for s in STEPS])
def test_engine_step_kernels_fit_sm90(case, table):
    """The real jitted step lowered for CUDA: its Triton kernels through ptxas."""
    step, params, state, *inputs = aot_steps.step_inputs(case, "pallas-gpu")
    reports = [aot_gpu.compile_call(c) for c in aot_gpu.triton_calls(step, params, state, *inputs)]
    # one attention kernel inside the layer scan (per distinct window: Gemma's local/global)
    assert len(reports) == aot_steps.attention_kernels(case.model)
    for r in reports:
        table("Triton kernels of the engine steps, sm_90 (attention_impl='pallas-gpu')",
              ["step"] + COLUMNS, [case.name] + _row(r.name, case.dtype, r))
        assert not r.problems()


MOE_STEPS = [
    aot_steps.StepCase("qwen3-30b-a3b:12", "prefill", 1.0, 512, 16, 8192),
    aot_steps.StepCase("mixtral-8x7b:4", "decode", 1.0, 64, 64, 8192),
]


@pytest.mark.parametrize("case", [pytest.param(s, id=s.name.replace(" ", "-"))
                                  for s in MOE_STEPS])
def test_moe_step_is_grouped_on_sm90(case, table):
    """A MoE step lowered for CUDA: the attention kernel (one distinct kernel for the unrolled
    layers) through ptxas, and no ragged_dot, which XLA:GPU would pad into a dense dot over
    every expert (the experts run `grouped_matmul_tiles`: jaxkv.model.moe)."""
    step, params, state, *inputs = aot_steps.step_inputs(case, "pallas-gpu")
    reports = [aot_gpu.compile_call(c) for c in aot_gpu.triton_calls(step, params, state, *inputs)]
    assert [r.name for r in reports] == ["ragged_paged_attention_gpu"]
    text = jax.jit(step).trace(params, state, *inputs).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "ragged_dot" not in text
    for r in reports:
        table("Triton kernels of the engine steps, sm_90 (attention_impl='pallas-gpu')",
              ["step"] + COLUMNS, [case.name] + _row(r.name, case.dtype, r))
        assert not r.problems()


QUANT_STEPS = [
    aot_steps.StepCase("llama-3.2-1b", "decode", 1.0, 64, 64, 4096, quantization="int4-g128"),
    aot_steps.StepCase("llama-3.2-1b", "prefill", 1.0, 512, 16, 4096, quantization="int4-g32"),
    aot_steps.StepCase("llama-3-8b", "decode", 2.0, 128, 128, 8192, quantization="int8"),
]


@pytest.mark.parametrize("case", [pytest.param(s, id=s.name.replace(" ", "-"))
                                  for s in QUANT_STEPS])
def test_quantized_engine_step_kernels_fit_sm90(case, table):
    """The real step with quantized weights: the attention kernel and one weight-only matmul
    kernel per linear and the LM head, each through ptxas with no spills."""
    step, params, state, *inputs = aot_steps.step_inputs(case, "pallas-gpu")
    reports = [aot_gpu.compile_call(c) for c in aot_gpu.triton_calls(step, params, state, *inputs)]
    c = aot_steps.config_of(case.model)
    e, f, hd, kd = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, \
        c.num_kv_heads * c.head_dim
    # the LM head too, tied or not: a quantized table is kept in its [E, V] layout on GPU
    shapes = {(e, hd), (e, kd), (hd, e), (e, f), (f, e), (e, c.vocab_size)}
    # The lowering keeps one copy of each distinct kernel: one per distinct (I, O) of a linear.
    names = [r.name for r in reports]
    assert names.count("quantized_matmul_gpu") == len(shapes), names
    assert len(names) == len(shapes) + 1  # and the attention kernel
    for r in reports:
        table("Triton kernels of the engine steps, sm_90 (attention_impl='pallas-gpu')",
              ["step"] + COLUMNS, [case.name] + _row(r.name, case.dtype, r))
        assert not r.problems()


# Weight-only quantized matmul (pallas_kernels/gpu_quant_matmul.py) at Llama-3-8B shapes
# (I, O): gate/up, down, the LM head, and a vocabulary that is not a multiple of the 128-column
# tile (masked loads and stores); decode T = 1 and 16 (split-K), prefill T = 512; bf16 x.
QUANT_SHAPES = {"gate-up": (4096, 14336), "down": (14336, 4096), "lm-head": (4096, 128256)}
QUANT_SCHEMES = {"int8": (8, None), "int4-g128": (4, 128), "int4-g32": (4, 32)}
QUANT_CASES = [(shape, scheme, t) for shape in QUANT_SHAPES for scheme in QUANT_SCHEMES
               for t in (1, 16, 512)] + [("vocab-50257", "int4-g128", 1)]


@pytest.mark.parametrize("shape, scheme, tokens", [
    pytest.param(*c, id=f"quant-{c[0]}-{c[1]}-T{c[2]}") for c in QUANT_CASES])
def test_quantized_matmul_fits_sm90(shape, scheme, tokens, table):
    i, o = QUANT_SHAPES.get(shape, (4096, 50257))
    bits, group = QUANT_SCHEMES[scheme]
    groups = 1 if group is None else i // group
    q = jax.ShapeDtypeStruct((i * bits // 8, o), jnp.int8 if bits == 8 else jnp.uint8)
    scale = jax.ShapeDtypeStruct((groups, o), jnp.float32)
    args = [jax.ShapeDtypeStruct((tokens, i), jnp.bfloat16), q, scale]
    [r] = aot_gpu.kernel_reports(lambda *a: quantized_matmul_gpu(*a, bits=bits),
                                 *args, *([scale] if bits == 4 else []))
    table("Weight-only quantized matmul, sm_90 (Triton -> PTX -> ptxas -v)",
          ["case", "I x O"] + COLUMNS, [f"{scheme} T={tokens} {shape}", f"{i} x {o}"]
          + _row(r.name, "bfloat16", r))
    assert not r.problems()


def test_ptxas_check_sees_spills():
    """A tile too large for one warp's registers (a [16, 32, 32] f32 product: 512 values per
    thread) must be reported as spilling, or the zero-spill assertions above prove nothing."""
    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.sum(a_ref[...][:, None, :] * b_ref[...][None, :, :], axis=-1)

    def f(a, b):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 32), jnp.float32),
                              compiler_params=plgpu.CompilerParams(num_warps=1))(a, b)

    [r] = aot_gpu.kernel_reports(f, jax.ShapeDtypeStruct((16, 32), jnp.float32),
                                 jax.ShapeDtypeStruct((32, 32), jnp.float32))
    assert r.spills > 0
    assert r.problems()


def test_parse_ptxas():
    text = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
            "ptxas info    : Function properties for k\n"
            "    16 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert aot_gpu.parse_ptxas(text) == dict(registers=255, stack_bytes=16, spill_stores=24,
                                             spill_loads=28)
    with pytest.raises(RuntimeError, match="unexpected ptxas output"):
        aot_gpu.parse_ptxas("ptxas fatal")
