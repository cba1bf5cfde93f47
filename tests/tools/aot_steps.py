"""Abstract inputs for compiling jaxkv's real engine steps ahead of time, at real model sizes.

Nothing is allocated: the model comes from ``nnx.eval_shape``, the KV state from
``jax.eval_shape(init_state, ...)`` and the batch from ``padding_batch``, all as
``ShapeDtypeStruct``s, so a 1B or 8B model and a GiB-sized page pool cost no memory here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.cache.memory import PRESETS
from jaxkv.cache.window import WindowSlots, slots_needed
from jaxkv.kv import init_state, kv_specs
from jaxkv.model.config import ModelConfig, RopeScaling
from jaxkv.model.llama import Llama, default_scan_layers
from jaxkv.model.quant import QuantScheme
from jaxkv.runtime.batch import PageTable, WindowTable, padding_batch
from jaxkv.runtime.draft_steps import draft_loop_inputs, make_draft_steps
from jaxkv.runtime.sampling import MAX_BANNED, SamplingArrays
from jaxkv.runtime.steps import make_steps
from pallas_kernels.quant import storage_dtype


@dataclasses.dataclass(frozen=True)
class StepCase:
    """One engine step to compile: a model preset, a pool and a batch shape."""

    model: str  # a preset of jaxkv.cache.memory
    kind: str  # "prefill" or "decode"
    pool_gib: float  # KV pool size
    tokens: int  # T of the batch
    rows: int  # B (max_num_seqs)
    max_model_len: int
    page_size: int = 16
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # "int8" | "fp8_e4m3": quantized pages with scales
    quantization: str | None = None  # weights kept quantized ("int8", "int4-g128", ...)
    scan: bool | None = None  # layers stacked and scanned (None: the GPU/TPU default)
    window_kv: bool = False  # local layers in their own pool of window slots (unrolled)

    @property
    def name(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f" kv={self.kv_cache_dtype}"
        w = "" if self.quantization is None else f" w={self.quantization}"
        scan = "" if self.scan is None else (" scanned" if self.scan else " unrolled")
        window = f" window-KV Q={window_slots(self)}" if self.window_kv else ""
        return f"{self.model} {self.kind} T={self.tokens} B={self.rows}{kv}{w}{scan}{window}"


def _gemma(version: int, layers: int, window: int, **options) -> dict:
    """Gemma 2 (1:1 local:global) or Gemma 3 (5:1) options, as their config.json files set them."""
    period = 2 if version == 2 else 6
    types = tuple("sliding_attention" if (i + 1) % period else "full_attention"
                  for i in range(layers))
    return dict(model_type="gemma2" if version == 2 else "gemma3_text", hidden_act="gelu_tanh",
                gemma_norm=True, scale_embeddings=True, query_pre_attn_scalar=256.0,
                sliding_window=window, layer_types=types, **options)


# Architecture options of the presets that are not Llama-like (the shape comes from PRESETS).
ARCHITECTURES = {
    "gemma-2-2b": _gemma(2, 26, 4096, attn_softcap=50.0, final_softcap=30.0),
    "gemma-3-1b": _gemma(3, 26, 512, rope_theta=1_000_000.0, local_rope_theta=10_000.0),
    "gemma-3-4b": _gemma(3, 34, 1024, rope_theta=1_000_000.0, local_rope_theta=10_000.0,
                         rope_scaling=RopeScaling(rope_type="linear", factor=8.0)),
    # LongRoPE with 48 short and long factors (values stand in for the published ones)
    "phi-3.5-mini": dict(model_type="phi3", sliding_window=262144, rope_scaling=RopeScaling(
        "longrope", factor=32.0, original_max_position_embeddings=4096,
        short_factor=(1.0,) * 48, long_factor=tuple(1.0 + i / 8 for i in range(48)),
        attention_factor=1.19)),
    "mixtral-8x7b": dict(model_type="mixtral", num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", num_experts_per_tok=8),
}


def config_of(preset: str) -> ModelConfig:
    """A ModelConfig with the shape of a memory-planning preset (e.g. "llama-3.2-1b"), and
    for Gemma and MoE presets their architecture options. "name:N" keeps the first N layers
    (a model too large for one chip, compiled as the same program with a shorter scan)."""
    preset, _, layers = preset.partition(":")
    s = PRESETS[preset]
    return ModelConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                       intermediate_size=s.intermediate_size,
                       num_layers=int(layers) if layers else s.num_layers,
                       num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                       tie_word_embeddings=s.tie_word_embeddings,
                       attention_bias=s.attention_bias, qk_norm=s.qk_norm,
                       sandwich_norm=s.sandwich_norm, num_experts=s.num_experts,
                       moe_intermediate_size=s.moe_intermediate_size,
                       max_position_embeddings=131_072,
                       **_trim(ARCHITECTURES.get(preset, {}), int(layers or s.num_layers)))


def _trim(options: dict, layers: int) -> dict:
    """Architecture options for the first ``layers`` layers."""
    if "layer_types" in options:
        return {**options, "layer_types": options["layer_types"][:layers]}
    return options


def attention_kernels(preset: str) -> int:
    """Attention kernels a step of ``preset`` compiles: one per distinct layer window."""
    return len(set(config_of(preset).windows))


@functools.cache
def abstract_model(preset: str, dtype: str, quantization: str | None = None,
                   table_rows: bool = False, scan: bool | None = None):
    """(graphdef, abstract params) of a Llama with ``preset``'s shape, its layers scanned as
    on GPU/TPU by default (``scan``), its weights quantized as ``quantization`` names (None:
    float; ``table_rows``: a quantized embedding kept row by row, as on TPU)."""
    dt = jnp.dtype(dtype)
    scheme = QuantScheme.parse(quantization)
    config = config_of(preset)
    scan = default_scan_layers(config, "tpu") if scan is None else scan
    module = nnx.eval_shape(lambda: Llama(config, dtype=dt, param_dtype=dt,
                                          scan_layers=scan, rngs=nnx.Rngs(0),
                                          quantization=scheme, table_rows=table_rows))
    graphdef, params = nnx.split(module)
    return graphdef, params


def window_slots(case: StepCase) -> int | None:
    """The local layers' slots of a window-KV case: what its rows' windows pin at most (one
    decode step per loop, as on GPU/TPU); None without window-only KV."""
    if not case.window_kv:
        return None
    return slots_needed(config_of(case.model).sliding_window, case.page_size,
                        max_num_seqs=case.rows, max_num_batched_tokens=case.tokens,
                        decode_steps=1)


def num_pages(case: StepCase) -> int:
    """Pages of the pool: all of ``pool_gib``, or what the window slots leave of it."""
    dtype = storage_dtype(case.kv_cache_dtype, case.dtype)
    full, local = kv_specs(config_of(case.model), dtype, case.window_kv)
    pool = int(case.pool_gib * 2**30)
    if case.window_kv:
        pool -= (window_slots(case) + 1) * local.bytes_per_page(case.page_size)
    return pool // full.bytes_per_page(case.page_size)


def _abstract_state(case: StepCase, impl: str | None = None):
    """(graphdef, abstract params, abstract KV state, pages, page-table width) of a case (the
    params in ``impl``'s platform's layout)."""
    graphdef, params = abstract_model(case.model, case.dtype, case.quantization,
                                      impl == "pallas-tpu", case.scan)
    config = config_of(case.model)
    pages = num_pages(case)
    state = jax.eval_shape(lambda: init_state(config, pages, case.page_size,
                                              jnp.dtype(case.dtype), case.kv_cache_dtype,
                                              window_slots(case)))
    return graphdef, params, state, pages, case.max_model_len // case.page_size


def state_of(case: StepCase):
    """The abstract KV state of a case's pool."""
    return _abstract_state(case)[2]


def step_inputs(case: StepCase, impl: str):
    """(jitted program, params, state, *inputs): abstract inputs of one real jaxkv ragged
    ``step`` (T tokens over B slots)."""
    graphdef, params, state, pages, width = _abstract_state(case, impl)
    steps = make_steps(graphdef, impl)
    # "decode" cases: the ragged step with one token per row, what GPU/TPU engines run by
    # default (max_decode_steps=1 there; see jaxkv.engine.Engine).
    batch = padding_batch(case.tokens, PageTable(case.rows, width, pages, case.page_size),
                          _window_table(case, width))
    keys = np.zeros((case.rows, 2), np.uint32)
    return steps.step, params, state, batch, keys, SamplingArrays.greedy(case.rows)


def spec_step_inputs(case: StepCase, impl: str, rows: int, k: int, masked: bool = False):
    """(jitted program, params, state, *inputs): abstract inputs of one real jaxkv spec step
    (`jaxkv.runtime.steps`: ``rows`` decode rows of k + 1 tokens each, verified in the same
    program) over ``case.rows`` slots and ``case.tokens`` = T tokens; ``masked``: with the
    grammar masks of structured outputs at every position."""
    graphdef, params, state, pages, width = _abstract_state(case, impl)
    steps = make_steps(graphdef, impl)
    batch = padding_batch(case.tokens, PageTable(case.rows, width, pages, case.page_size),
                          _window_table(case, width))
    k1 = k + 1
    return (steps.spec_step, params, state, batch, np.zeros((rows, k1), np.int32),
            np.zeros((rows, k), np.int32), np.zeros(rows, np.int32),
            np.zeros((rows, 2), np.uint32), SamplingArrays.greedy(rows),
            np.full((rows, k1, MAX_BANNED), -1, np.int32),
            (np.full((rows, k1, (config_of(case.model).vocab_size + 31) // 32), -1, np.int32),
             np.ones((rows, k1), bool)) if masked else None)


def draft_inputs(case: StepCase, impl: str, rows: int, k: int):
    """(jitted program, params, state, *inputs): abstract inputs of a draft model's proposal
    (`jaxkv.runtime.draft_steps`: a ragged forward of ``case.tokens`` tokens over ``rows``
    rows, then a decode loop of k - 1 steps) over the draft's own pool."""
    graphdef, params, state, pages, width = _abstract_state(case, impl)
    _, propose = make_draft_steps(graphdef, impl, None, k)
    table = PageTable(case.rows, width, pages, case.page_size)  # B = the engine's slots
    loop = draft_loop_inputs(rows, width, k - 1)
    return (propose, params, state, padding_batch(case.tokens, table),
            np.zeros(rows, np.int32), loop)


def _window_table(case: StepCase, width: int) -> WindowTable | None:
    if not case.window_kv:
        return None
    slots = WindowSlots(window_slots(case), config_of(case.model).sliding_window,
                        case.page_size)
    return WindowTable(case.rows, width, slots)


def pool_bytes(state) -> int:
    """Bytes of the pool: pages, and scales when quantized (both pools with window-only KV)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def loop_inputs(case: StepCase, impl: str, max_steps: int = 8):
    """(jitted program, params, state, loop): abstract inputs of one real jaxkv ``decode_loop``
    of up to ``max_steps`` decode steps over ``case.rows`` rows (padding rows, as warmup
    compiles them)."""
    from types import SimpleNamespace

    from jaxkv.engine.warmup import idle_decode_loop

    graphdef, params, state, _, width = _abstract_state(case)
    steps = make_steps(graphdef, impl, None, max_steps)
    table = _window_table(case, width)
    rows = (lambda r: None) if table is None else \
        (lambda r: np.full((r, width), table.slots.null, np.int32))
    loop = idle_decode_loop(SimpleNamespace(max_pages_per_seq=width, window_rows=rows),
                            case.rows)
    return steps.decode_loop, params, state, loop.replace(num_steps=np.int32(max_steps))
