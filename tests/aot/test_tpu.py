"""TPU v5e and v6e: every kernel and the real engine steps compile with libtpu (XLA:TPU and
Mosaic, no TPU needed), within VMEM and SMEM, and no program copies the KV pool (nor, with
quantized pages, their scales).

    JAXKV_AOT=1 python -m pytest tests/aot/test_tpu.py [-m slow]    (``make test-aot``)
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from tools import aot_kernels, aot_quant_tpu, aot_steps, aot_tpu

from pallas_kernels import tpu_block_sizes
from pallas_kernels.tpu_ragged_kernel import table_window
from pallas_kernels.tpu_ragged_paged_attention import scale_rows_shape

MiB = 2**20
SCOPED_VMEM = {"v5e": 16 * MiB, "v6e": 32 * MiB}  # XLA's default scoped VMEM limit per kernel
KERNEL_COLUMNS = ["chip", "kernel", "pool MiB", "temp B", "largest copy B", "VMEM KiB",
                  "SMEM KiB (est.)", "compile s"]
STEP_COLUMNS = ["chip", "step", "pool MiB", "temp MiB", "temp / pool", "largest copy MiB",
                "aliased MiB", "compile s"]


def _cases(full_sweep):
    sample = aot_kernels.sweep(full=False)
    out = [pytest.param(c, id=c.name) for c in sample]
    out += [pytest.param(c, id=c.name, marks=pytest.mark.slow)
            for c in full_sweep if c not in sample]
    return out


def _smem_estimate(rows: int, width: int) -> int:
    rows_w, cols_w = table_window(rows, width)
    return tpu_block_sizes.smem_bytes(rows, rows_w * cols_w)


def _pool_bytes(case: aot_kernels.KernelCase) -> int:
    pages = case.shapes()[1]
    return pages.size * jnp.dtype(pages.dtype).itemsize


def _tpu_shapes(case: aot_kernels.KernelCase, scales_as_rows: bool = True):
    """The case's inputs: quantized pages' scale words in ``scale_rows_shape`` (the pool's
    layout, what ``case.all_shapes()`` has), or per page [..., P, S] (``scales_as_rows=False``,
    which XLA:TPU stores page-minor: see test_scales_per_slot_are_relaid_out)."""
    shapes = case.all_shapes()
    if case.kv_dtype:
        pages = case.shapes()[1].shape
        shape = scale_rows_shape(pages) if scales_as_rows else pages[:-1]
        shapes[-1] = jax.ShapeDtypeStruct(shape, jnp.int32)
    return shapes


def _row(chip, case, r, name=None):
    return [chip, name or case.name, _pool_bytes(case) // MiB, r.temp_bytes, r.largest_copy(),
            "/".join(str(v // 1024) for v in r.vmem_bytes),
            _smem_estimate(case.batch, case.width) // 1024, f"{r.seconds:.1f}"]


@pytest.mark.parametrize("chip", aot_tpu.CHIPS)
@pytest.mark.parametrize("case", _cases(aot_kernels.sweep(full=True) + aot_kernels.EDGES))
def test_kernel_compiles_without_copying_the_pool(chip, case, table):
    shapes = _tpu_shapes(case)
    args = [aot_tpu.abstract(chip, s.shape, s.dtype) for s in shapes]
    r = aot_tpu.compile_for(chip, case.fn("tpu"), *args)
    pool = _pool_bytes(case)
    table("TPU kernels (libtpu compile-only topology)", KERNEL_COLUMNS, _row(chip, case, r))
    assert r.vmem_bytes, "no Mosaic kernel in the compiled program"
    assert max(r.vmem_bytes) <= SCOPED_VMEM[chip]
    assert r.temp_bytes < 0.1 * pool and r.largest_copy() < 0.1 * pool
    if case.kv_dtype:  # nor of the scales (3% of an int8 pool at D = 64: below the bound above)
        scales = shapes[-1].size * 4
        i32_copies = [c for c in r.copies if c.shape.startswith("s32[")]
        assert all(c.nbytes < 0.1 * scales for c in i32_copies), i32_copies


@pytest.mark.parametrize("chip", aot_tpu.CHIPS)
def test_scales_per_slot_are_relaid_out(chip, table):
    """Why the TPU kernel takes its scales as ``scale_rows_shape``: given i32[L, K, P, S] with
    S = 32 (``quant.py``'s shape), XLA:TPU stores the array page-minor (rows of 32 words would
    fill a quarter of each 128-lane tile row) and copies all of it into the row-major layout the
    kernel needs, on every call. The same words as [L, K, P / 4, 128] are read in place."""
    case = next(c for c in aot_kernels.QUANTIZED if c.layers and c.kernel == "decode")
    args = [aot_tpu.abstract(chip, s.shape, s.dtype)
            for s in _tpu_shapes(case, scales_as_rows=False)]
    r = aot_tpu.compile_for(chip, case.fn("tpu"), *args)
    table("TPU kernels (libtpu compile-only topology)", KERNEL_COLUMNS,
          _row(chip, case, r, case.name + " (scales [L, K, P, S])"))
    assert r.largest_copy() == args[-1].size * 4  # the whole scale array, nothing else


@pytest.mark.parametrize("rows, width", [(256, 2048), (1024, 8192)])
def test_page_table_does_not_live_in_smem(rows, width, table):
    """A 256 x 2048 table (2 MiB) failed this compile with RESOURCE_EXHAUSTED on the 1 MiB SMEM
    while the whole table was scalar-prefetched; 1024 x 8192 is 128K-token context at page 16
    for 1024 sequences. The compile succeeding is the check."""
    case = aot_kernels.KernelCase("decode", "bfloat16", 128, 16, 4, batch=rows, layers=4,
                                  width=width, pages=512)
    args = [aot_tpu.abstract("v5e", s.shape, s.dtype) for s in case.all_shapes()]
    r = aot_tpu.compile_for("v5e", case.fn("tpu"), *args)
    table("TPU kernels (libtpu compile-only topology)", KERNEL_COLUMNS, _row("v5e", case, r))
    assert len(r.vmem_bytes) == 1  # the Mosaic kernel is in the program


def test_compile_is_real_oversized_vmem_fails():
    """A kernel whose VMEM scratch exceeds the chip fails this compile: it is not a dry run."""
    def kernel(x_ref, o_ref, scratch):
        scratch[0] = x_ref[...]
        o_ref[...] = scratch[0]

    def f(x, scratch_rows):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              scratch_shapes=[pltpu.VMEM((scratch_rows, 1024, 128),
                                                         jnp.float32)])(x)

    x = aot_tpu.abstract("v5e", (1024, 128), jnp.float32)
    fits = aot_tpu.compile_for("v5e", lambda x: f(x, 2), x)  # 1 MiB of scratch
    assert max(fits.vmem_bytes) >= 1 * MiB
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        aot_tpu.compile_for("v5e", lambda x: f(x, 1024), x)  # 512 MiB > v5e's 128 MiB



@pytest.mark.parametrize("chip, case", [
    pytest.param(chip, case, id=f"{chip}-quant-{case.name}",
                 marks=() if in_ci else (pytest.mark.slow,))
    for chip, case, in_ci in aot_quant_tpu.chip_cases(aot_tpu.CHIPS)])
def test_quant_matmul_reads_the_weight_as_integers(chip, case, table):
    """The weight-only quantized matmul (tpu_quant_matmul.py) at Llama-3-8B shapes: one Mosaic
    kernel within scoped VMEM, and no float weight in HBM: no copy of the integer weight, and
    no temporary as large as it. The one copy XLA makes is x's (int4: columns reordered
    [even | odd] per block), which bounds the temporaries."""
    args = [None if s is None else aot_tpu.abstract(chip, s.shape, s.dtype)
            for s in case.shapes()]
    r = aot_tpu.compile_for(chip, case.fn(), *args)
    table("Weight-only quantized matmul on TPU (tpu_quant_matmul)", aot_quant_tpu.COLUMNS,
          aot_quant_tpu.row(chip, case, r))
    weight = case.weight_bytes()
    assert len(r.vmem_bytes) == 1 and max(r.vmem_bytes) <= SCOPED_VMEM[chip]
    assert r.temp_bytes < weight and r.largest_copy() < weight, r.copies
    assert r.temp_bytes <= case.x_bytes() + MiB and r.largest_copy() <= case.x_bytes()
    assert not [c for c in r.copies if c.shape.startswith(("s8[", "u8["))], r.copies

def _compile_step(chip, case, table, per: int | None = None):
    """(compile report, abstract state, pool bytes) of one real jaxkv step for ``chip``, its
    row added to the steps table (temporaries per ``per`` bytes, default the pool's)."""
    step, params, state, *inputs = aot_steps.step_inputs(case, "pallas-tpu")
    r = aot_tpu.compile_for(chip, step, *aot_tpu.on_chip(chip, (params, state, *inputs)))
    pool = aot_steps.pool_bytes(state)
    table("Engine steps on TPU (jaxkv.runtime.steps, attention_impl='pallas-tpu')", STEP_COLUMNS,
          [chip, case.name + f" W={case.max_model_len // case.page_size}", pool // MiB,
           f"{r.temp_bytes / MiB:.1f}", f"{r.temp_bytes / (per or pool):.4f}",
           f"{r.largest_copy() / MiB:.1f}", r.alias_bytes // MiB, f"{r.seconds:.1f}"])
    return r, state, pool


STEPS = [
    # head_dim 64 (Llama-3.2-1B shape) and head_dim 128 (Llama-3.2-3B), 1 GiB of bf16 KV.
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "prefill", 1.0, 512, 16, 4096)),
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "decode", 1.0, 64, 64, 4096)),
    ("v5e", aot_steps.StepCase("llama-3.2-3b", "prefill", 1.0, 512, 16, 4096)),
    ("v5e", aot_steps.StepCase("llama-3.2-3b", "decode", 1.0, 64, 64, 4096)),
    # The engine's default width: max_model_len = 128K tokens -> 8,192 pages per row.
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "decode", 2.0, 256, 256, 131072)),
    ("v6e", aot_steps.StepCase("llama-3-8b", "decode", 2.0, 128, 128, 8192)),
    # int8 pages and their scale rows, written and read in place: head_dim 64, pages of 64/128.
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "decode", 1.0, 64, 64, 4096, page_size=64,
                               kv_cache_dtype="int8")),
    ("v6e", aot_steps.StepCase("llama-3.2-1b", "prefill", 1.0, 512, 16, 4096, page_size=128,
                               kv_cache_dtype="int8")),
    # Gemma: head_dim 256, local and global layers (two kernels, one per window, switched by
    # the scanned layer's index), Gemma 2's attention soft cap, Gemma 3's q/k norms. (Served
    # unrolled by default, with window-only KV: WINDOW_STEPS.)
    ("v5e", aot_steps.StepCase("gemma-2-2b", "prefill", 1.0, 512, 16, 8192, scan=True)),
    ("v6e", aot_steps.StepCase("gemma-3-1b", "decode", 1.0, 64, 64, 8192, scan=True)),
    # Phi-3.5-mini: head_dim 96 (the GPU kernels need a power of two), LongRoPE.
    ("v5e", aot_steps.StepCase("phi-3.5-mini", "decode", 1.0, 64, 64, 8192)),
]


@pytest.mark.parametrize("chip, case", [pytest.param(c, s, id=f"{c}-{s.name}".replace(" ", "-"))
                                        for c, s in STEPS])
def test_engine_step_updates_the_pool_in_place(chip, case, table):
    """The real jitted step (scanned layers, bf16, the TPU kernel): the donated pool is
    aliased to the output and XLA makes no copy of it (temporaries < 10% of the pool)."""
    r, state, pool = _compile_step(chip, case, table)
    # one Mosaic kernel in the layer scan (per distinct window: Gemma), not the reference
    assert len(r.vmem_bytes) == aot_steps.attention_kernels(case.model)
    # The step samples on device: its [B, V] f32 temporaries (logits, scaled, exp, masks;
    # 33-131 MB each at a 128K vocabulary) come on top, and are no copy of the pool.
    sampler = 12 * case.rows * aot_steps.config_of(case.model).vocab_size * 4
    assert r.temp_bytes < 0.1 * pool + sampler
    assert r.largest_copy() < 0.1 * pool
    assert r.alias_bytes >= pool  # the output pool reuses the donated input buffer
    if state.kv_scales is not None:  # nor the scales (3% of an int8 pool: below the bound above)
        scales = state.kv_scales.size * 4
        i32_copies = [c for c in r.copies if c.shape.startswith("s32[")]
        assert all(c.nbytes < 0.1 * scales for c in i32_copies), i32_copies


# Speculative decoding's spec step: 8 decode rows of k + 1 = 8 tokens (a draft of 7 each),
# logits at those 64 positions only, verification and the plain rows' sampling in the same
# program (jaxkv.runtime.steps._spec_step).
# The "masked" case: structured outputs' grammar masks (packed i32 [R, K + 1, V / 32]) at every
# position.
SPEC_STEPS = [
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "spec", 1.0, 64, 64, 4096), False),
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "spec", 1.0, 64, 64, 4096), True),
    ("v6e", aot_steps.StepCase("llama-3-8b", "spec", 2.0, 64, 128, 8192), False),
]


@pytest.mark.parametrize("chip, case, masked", [
    pytest.param(c, s, m, id=f"{c}-{s.name}{'-masked' if m else ''}".replace(" ", "-"))
    for c, s, m in SPEC_STEPS])
def test_spec_step_updates_the_pool_in_place(chip, case, masked, table):
    """The pool donated and aliased to the output, and no copy of it: verification's
    temporaries are [R(K + 1), V] f32 arrays (logits, probabilities, the residual)."""
    rows, k = 8, 7
    step, params, state, *inputs = aot_steps.spec_step_inputs(case, "pallas-tpu", rows, k,
                                                              masked)
    r = aot_tpu.compile_for(chip, step, *aot_tpu.on_chip(chip, (params, state, *inputs)))
    pool = aot_steps.pool_bytes(state)
    name = case.name + f" R={rows} k={k}" + (" masked" if masked else "")
    table("Engine steps on TPU (jaxkv.runtime.steps, attention_impl='pallas-tpu')", STEP_COLUMNS,
          [chip, name, pool // MiB, f"{r.temp_bytes / MiB:.1f}",
           f"{r.temp_bytes / pool:.4f}", f"{r.largest_copy() / MiB:.1f}", r.alias_bytes // MiB,
           f"{r.seconds:.1f}"])
    verifier = 16 * rows * (k + 1) * aot_steps.config_of(case.model).vocab_size * 4
    assert len(r.vmem_bytes) == aot_steps.attention_kernels(case.model)
    assert r.alias_bytes >= pool
    assert r.temp_bytes < 0.1 * pool + verifier
    assert r.largest_copy() < 0.1 * pool


# Speculative decoding's draft model: Llama-3.2-1B (int4, group 128) drafting k = 4 tokens for
# 8 rows of a Llama-3-8B target (same vocabulary): one ragged forward of the rows' unseen
# tokens (T = 64), then a decode loop of 3 steps, over the draft's own pool
# (jaxkv.runtime.draft_steps).
DRAFT_STEPS = [
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "draft", 0.5, 64, 64, 8192,
                               quantization="int4-g128")),
    ("v6e", aot_steps.StepCase("llama-3.2-1b", "draft", 0.5, 64, 64, 8192,
                               quantization="int4-g128")),
]


@pytest.mark.parametrize("chip, case", [pytest.param(c, s, id=f"{c}-{s.name}".replace(" ", "-"))
                                        for c, s in DRAFT_STEPS])
def test_draft_proposal_updates_its_pool_in_place(chip, case, table):
    """The draft's pool donated and aliased to the output through the forward and the loop,
    and no copy of it. (The largest copies are of weights: XLA:TPU lays the int4 embedding
    and stacked layer weights out anew for the decode loop, as in the engine's decode_loop:
    measured, in docs/AOT.md.)"""
    rows, k = 8, 4
    step, params, state, *inputs = aot_steps.draft_inputs(case, "pallas-tpu", rows, k)
    r = aot_tpu.compile_for(chip, step, *aot_tpu.on_chip(chip, (params, state, *inputs)))
    pool = aot_steps.pool_bytes(state)
    table("Engine steps on TPU (jaxkv.runtime.steps, attention_impl='pallas-tpu')", STEP_COLUMNS,
          [chip, case.name + f" R={rows} k={k}", pool // MiB, f"{r.temp_bytes / MiB:.1f}",
           f"{r.temp_bytes / pool:.4f}", f"{r.largest_copy() / MiB:.1f}", r.alias_bytes // MiB,
           f"{r.seconds:.1f}"])
    logits = 12 * 64 * aot_steps.config_of(case.model).vocab_size * 4
    assert r.alias_bytes >= pool
    assert r.temp_bytes < 0.1 * pool + logits
    layers, kv_heads = state.kv_pages.shape[:2]  # no copy of the pool or a slice of it
    assert not [c for c in r.copies if c.shape.startswith(f"bf16[{layers},{kv_heads},")
                or c.nbytes >= pool]


# Window-only KV (jaxkv.cache.window): Gemma 3's 22 local layers keep their pages in a pool of
# window slots (what the rows' 512-token windows pin), its 4 global layers in pages; the layers
# unrolled, each writing and reading its own pool.
WINDOW_STEPS = [
    ("v5e", aot_steps.StepCase("gemma-3-1b", "decode", 1.0, 64, 64, 32768, scan=False,
                               window_kv=True)),
    ("v6e", aot_steps.StepCase("gemma-3-1b", "prefill", 1.0, 512, 16, 32768, scan=False,
                               window_kv=True)),
]


@pytest.mark.parametrize("chip, case", [pytest.param(c, s, id=f"{c}-{s.name}".replace(" ", "-"))
                                        for c, s in WINDOW_STEPS])
def test_window_kv_step_updates_both_pools_in_place(chip, case, table):
    """Both pools donated and aliased to the output, and no copy of either (no copy a tenth
    of the smaller pool, but the sampler's [B, V] f32 logits)."""
    r, state, pool = _compile_step(chip, case, table)
    window = aot_steps.pool_bytes((state.window_pages, state.window_scales))
    smaller = min(window, pool - window)
    logits = case.rows * aot_steps.config_of(case.model).vocab_size * 4
    sampler = 12 * logits
    assert r.alias_bytes >= pool
    assert r.temp_bytes < 0.1 * smaller + sampler
    big = [c for c in r.copies if c.nbytes >= 0.1 * smaller and c.nbytes != logits]
    assert not big, big


# Mixtures of experts: a grouped matmul (ragged_dot) over the tokens sorted by expert, the
# layers unrolled (`default_scan_layers`). Neither model fits one chip whole (61 and 93 GB of
# bf16 weights): "name:N" compiles the same program for its first N layers.
MOE_STEPS = [
    ("v6e", aot_steps.StepCase("qwen3-30b-a3b:12", "prefill", 1.0, 512, 16, 8192)),
    ("v6e", aot_steps.StepCase("mixtral-8x7b:4", "decode", 1.0, 64, 64, 8192)),
]


def _expert_slice_bytes(case) -> int:
    c = aot_steps.config_of(case.model)
    return c.num_experts * c.hidden_size * c.moe_intermediate_size * 2  # one bf16 [X, E, F]


@pytest.mark.parametrize("chip, case", [pytest.param(c, s, id=f"{c}-{s.name}".replace(" ", "-"))
                                        for c, s in MOE_STEPS])
def test_moe_step_reads_expert_weights_in_place(chip, case, table):
    """A MoE step: the pool updated in place, and no temporary the size of one layer's expert
    weights (ragged_dot reads each unrolled layer's experts where they are)."""
    r, state, pool = _compile_step(chip, case, table)
    sampler = 12 * case.rows * aot_steps.config_of(case.model).vocab_size * 4
    assert r.alias_bytes >= pool
    assert r.temp_bytes < 0.1 * pool + sampler
    assert r.temp_bytes < _expert_slice_bytes(case)


def test_scanned_moe_layers_copy_their_experts(table):
    """Why MoE layers are unrolled (a known limit, `default_scan_layers`): scanned, XLA:TPU
    copies each layer's slice of the stacked expert weights before ragged_dot, a temporary the
    size of the layer's gate and up experts. This test fails once the scan stops copying: then
    scan MoE layers too."""
    case = aot_steps.StepCase("qwen3-30b-a3b:4", "decode", 1.0, 64, 64, 8192, scan=True)
    r, _, _ = _compile_step("v6e", case, table)
    assert r.temp_bytes >= 2 * _expert_slice_bytes(case)


QUANT_STEPS = [
    # Weights kept quantized: each linear of the layer scan through the Mosaic weight-only
    # kernel (the 8B's untied head too); a tied LM head contracts against the embedding kept
    # row by row (`QuantizedTable`: a lookup gathers rows, no relayout of the table) with
    # XLA's dot, reading the int8 values in place.
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "decode", 1.0, 64, 64, 4096,
                               quantization="int4-g128")),
    ("v5e", aot_steps.StepCase("llama-3.2-1b", "prefill", 1.0, 512, 16, 4096,
                               quantization="int4-g32")),
    ("v6e", aot_steps.StepCase("llama-3-8b", "decode", 2.0, 128, 128, 8192,
                               quantization="int8")),
]


@pytest.mark.parametrize("chip, case", [pytest.param(c, s, id=f"{c}-{s.name}".replace(" ", "-"))
                                        for c, s in QUANT_STEPS])
def test_quantized_engine_step_reads_integer_weights(chip, case, table):
    """The real step with quantized weights: one Mosaic kernel per linear (and the attention
    kernel), no copy of a packed weight, the pool still updated in place."""
    r, state, pool = _compile_step(chip, case, table)
    tied = aot_steps.config_of(case.model).tie_word_embeddings
    assert len(r.vmem_bytes) == 1 + 7 + (0 if tied else 1)
    assert r.alias_bytes >= pool
    # No weight-sized temporary: the same step with float weights needs as much. (The HLO's
    # u8/s8 `copy`s are a relayout fused into each layer's slice, read into VMEM per layer.)
    float_case = dataclasses.replace(case, quantization=None)
    step, params, state, *inputs = aot_steps.step_inputs(float_case, "pallas-tpu")
    f = aot_tpu.compile_for(chip, step, *aot_tpu.on_chip(chip, (params, state, *inputs)))
    assert r.temp_bytes <= f.temp_bytes + MiB, (r.temp_bytes, f.temp_bytes)


def test_int8_step_on_tpu_copies_the_pool_to_write_it(table):
    """What the real compiler does with an int8 pool at head_dim 128 today (a known limit,
    docs/AOT.md): the step compiles, with one Mosaic kernel that reads the int8 pages and their
    scale rows in place, but XLA:TPU writes a token's 256-byte K|V row into the int8 pool by
    relaying the whole pool out and back (an s8 scatter of single rows into (32, 128)-tiled,
    4-rows-to-a-word data), measured as s8 copies the size of the pool. At head_dim 64 (a
    128-byte row, STEPS above) and in bf16 the same scatter runs in place. This test fails once
    the write stops copying: then move the case to STEPS."""
    case = aot_steps.StepCase("llama-3.2-3b", "prefill", 1.0, 512, 16, 4096, page_size=64,
                              kv_cache_dtype="int8")
    pages = aot_steps.state_of(case).kv_pages.size  # int8: one byte each
    r, state, _ = _compile_step("v5e", case, table, per=pages)
    assert len(r.vmem_bytes) == 1  # the quantized kernel, not the reference
    assert r.alias_bytes >= pages
    pool_copies = [c for c in r.copies if c.shape.startswith("s8[") and c.nbytes == pages]
    assert pool_copies, r.copies


LOOP_COLUMNS = ["chip", "decode loop", "pool MiB", "temp MiB", "aliased MiB", "copies > 1 MiB",
                "compile s"]


@pytest.mark.parametrize("chip", aot_tpu.CHIPS)
def test_decode_loop_keeps_the_pool_in_place(chip, table):
    """The on-device decode loop (8 steps of 64 rows, scanned layers, the TPU kernel): the
    donated pool is aliased and never copied. What it does copy is recorded: XLA lays the
    stacked q/k/v projections out anew for the loop (once per loop, not per step), which is
    why GPU/TPU engines default to max_decode_steps=1."""
    case = aot_steps.StepCase("llama-3.2-1b", "decode", 1.0, 64, 64, 4096)
    fn, params, state, loop = aot_steps.loop_inputs(case, "pallas-tpu", 8)
    r = aot_tpu.compile_for(chip, fn, *aot_tpu.on_chip(chip, (params, state, loop)))
    pool = aot_steps.pool_bytes(state)
    big = sorted((c for c in r.copies if c.nbytes > MiB), key=lambda c: -c.nbytes)
    table("Decode loop on TPU (jaxkv.runtime.steps.decode_loop, 8 steps)", LOOP_COLUMNS,
          [chip, case.name, pool // MiB, f"{r.temp_bytes / MiB:.1f}", r.alias_bytes // MiB,
           ", ".join(c.shape for c in big), f"{r.seconds:.1f}"])
    assert len(r.vmem_bytes) == 1
    assert r.alias_bytes >= pool
    assert r.largest_copy() < 0.2 * pool  # weights and sampler rows, never the pool


TRANSFER_COLUMNS = ["chip", "pool", "program", "pages moved", "pool MiB", "temp MiB",
                    "largest copy MiB", "aliased MiB", "compile s"]


def _transfer_programs(model, page_size, kv, table):
    """Compiles the gather (prefill side) and the scatter (decode side) of 64 pages of a
    1 GiB pool for v5e; records both in the table."""
    from jaxkv.disagg import kv_transfer

    case = aot_steps.StepCase(model, "decode", 1.0, 1, 1, 4096, page_size=page_size,
                              kv_cache_dtype=kv)
    state = aot_tpu.on_chip("v5e", aot_steps.state_of(case))
    ids = aot_tpu.abstract("v5e", (64,), jnp.int32)
    pool = aot_steps.pool_bytes(state)
    export = aot_tpu.compile_for("v5e", kv_transfer.export_pages, state, ids, None)
    payload = aot_tpu.on_chip("v5e", jax.eval_shape(kv_transfer.export_pages, state, ids, None))
    scatter = aot_tpu.compile_for("v5e", kv_transfer.import_pages, state, ids, *payload, None)
    for name, r in (("export_pages", export), ("import_pages", scatter)):
        table("KV transfer programs on TPU (jaxkv.disagg.kv_transfer)", TRANSFER_COLUMNS,
              ["v5e", f"{model} S={page_size} {kv}", name, 64, pool // MiB,
               f"{r.temp_bytes / MiB:.1f}", f"{r.largest_copy() / MiB:.1f}",
               r.alias_bytes // MiB, f"{r.seconds:.1f}"])
    return state, pool, export, scatter


@pytest.mark.parametrize("model, page_size", [("llama-3.2-1b", 16), ("llama-3.2-3b", 64)])
def test_kv_transfer_programs_leave_the_pool_in_place(model, page_size, table):
    """Prefill/decode disaggregation's programs (jaxkv.disagg.kv_transfer) on a bf16 pool:
    the gather of a request's pages copies no pool (a gather along the page axis relaid the
    whole pool out at head_dim 128: `gather_pages` reads page by page), and the scatter into
    the decode pool updates the donated pool in place."""
    _, pool, export, scatter = _transfer_programs(model, page_size, "auto", table)
    for r in (export, scatter):
        assert r.largest_copy() < 0.1 * pool, r.copies
        assert r.temp_bytes < 0.1 * pool
    assert scatter.alias_bytes >= pool


@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.2-3b"])
def test_int8_kv_transfer_on_tpu_copies_the_pool(model, table):
    """A known limit (docs/AOT.md), like the int8 step write at head_dim 128: with int8 pages
    XLA:TPU relays the whole s8 pool out to read 64 pages of it (head_dim 64 and 128), and to
    write them at head_dim 128. It compiles; this test fails once the copy goes."""
    state, _, export, scatter = _transfer_programs(model, 64, "int8", table)
    pages = state.kv_pages.size  # int8: one byte each
    assert any(c.shape.startswith("s8[") and c.nbytes >= pages for c in export.copies)
    assert scatter.alias_bytes >= pages


@pytest.mark.parametrize("model, page_size", [("llama-3.2-1b", 16), ("llama-3.2-3b", 64)])
def test_page_copies_leave_a_bf16_pool_in_place(model, page_size, table):
    """copy_pages (copy-on-write, a partly matched prefix page) and fill_pages (NaN poisoning)
    of 8 pages: in place, no copy of the pool (copy_pages' gather along the page axis relaid
    the whole pool out at head_dim 128 before it read page by page)."""
    from jaxkv.runtime.page_copy import copy_pages, fill_pages

    case = aot_steps.StepCase(model, "decode", 1.0, 1, 1, 4096, page_size=page_size)
    state = aot_tpu.on_chip("v5e", aot_steps.state_of(case))
    ids = aot_tpu.abstract("v5e", (8,), jnp.int32)
    pool = aot_steps.pool_bytes(state)
    for name, r in (
            ("copy_pages", aot_tpu.compile_for("v5e", copy_pages, state, ids, ids)),
            ("fill_pages", aot_tpu.compile_for("v5e", fill_pages, state, ids,
                                               aot_tpu.abstract("v5e", (), jnp.float32)))):
        table("KV transfer programs on TPU (jaxkv.disagg.kv_transfer)", TRANSFER_COLUMNS,
              ["v5e", f"{model} S={page_size} auto", name, 8, pool // MiB,
               f"{r.temp_bytes / MiB:.1f}", f"{r.largest_copy() / MiB:.1f}",
               r.alias_bytes // MiB, f"{r.seconds:.1f}"])
        assert r.largest_copy() < 0.1 * pool and r.temp_bytes < 0.1 * pool, name
        assert r.alias_bytes >= pool


SAMPLE_COLUMNS = ["chip", "program", "rows x vocab", "mask KiB", "temp MiB", "largest copy MiB",
                  "compile s"]


@pytest.mark.parametrize("chip", aot_tpu.CHIPS)
def test_masked_sampling_compiles(chip, table):
    """The sampling program of rows with logits processors or a grammar (structured outputs:
    a packed int32 [R, V / 32] mask unpacked on device), at 64 rows of Llama-3's 128,256-token
    vocabulary: it compiles, and its temporaries stay a few [R, V] f32 buffers (the logits'
    size is 32 MiB)."""
    import numpy as np

    from jaxkv import SamplingParams
    from jaxkv.runtime.processors import build_processors, sample_processed
    from jaxkv.runtime.sampling import SamplingArrays

    class Grammars:  # every row constrained; the mask's values do not matter to a compile
        vocab_size = 128256

        def fill(self, rows, bitmask):
            bitmask[:] = -1

    rows, v = 64, Grammars.vocab_size
    procs = build_processors([(i, [1], 1, SamplingParams(), [], object()) for i in range(rows)],
                             rows, Grammars())
    args = aot_tpu.on_chip(chip, (jax.ShapeDtypeStruct((rows, v), jnp.float32),
                                  np.zeros((rows, 2), np.uint32), SamplingArrays.greedy(rows),
                                  procs, np.zeros(rows, np.int32)))
    r = aot_tpu.compile_for(chip, sample_processed, *args)
    logits = rows * v * 4
    table("Masked sampling on TPU (jaxkv.runtime.processors.sample_processed)", SAMPLE_COLUMNS,
          [chip, "sample_processed", f"{rows} x {v}", procs.mask.nbytes // 1024,
           f"{r.temp_bytes / MiB:.1f}", f"{r.largest_copy() / MiB:.1f}", f"{r.seconds:.1f}"])
    assert procs.mask.shape == (rows, (v + 31) // 32)
    assert r.temp_bytes < 8 * logits
