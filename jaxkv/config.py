"""Engine settings: one frozen, documented dataclass per concern, composed into `EngineConfig`.

Each setting is one field with its default and, right under it, a docstring that is also the
`jaxkv serve` flag's help (`jaxkv.cli_settings`). `EngineConfig.from_kwargs` maps the flat
keywords of `LLM(...)` and `Engine(...)` (``page_size=32``) onto the fields; an unknown keyword
is an error naming it and the nearest field. Each config validates itself once, in
``__post_init__``, with an error naming the field.

Imports no jax: the host side (memory planning, the CLI) uses these too.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import numbers

from jaxkv.config_checks import (  # noqa: F401 - the constants are part of this module's API
    ATTENTION_IMPLS,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    QUANTIZATIONS,
    nearest_name,
    power_of_two,
)
from jaxkv.config_checks import one_of as _one_of
from jaxkv.config_checks import positive as _positive
from jaxkv.config_speculative import SPECULATIVE_METHODS, SpeculativeConfig  # noqa: F401


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV page pool and the prefix cache behind it."""

    page_size: int = 16
    """Tokens per KV page (every kernel reads whole pages; 16 fits every backend)."""
    num_pages: int | None = None
    """KV pages in the pool (per replica); default: sized from memory (kv_cache_memory_*)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV pool per replica, when num_pages is not given (default: a fraction of
    the device's free memory, kv_cache_memory_fraction)."""
    kv_cache_memory_fraction: float = 0.9
    """Fraction of the device memory left after the weights and activations that the KV pool
    takes (on CPU: of the available RAM, at most 2 GiB)."""
    kv_cache_dtype: str = dataclasses.field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    """KV pages' dtype: auto (the compute dtype), int8 or fp8_e4m3 (quantized pages with a
    scale per token and kv head: about half the bytes of bf16)."""
    enable_prefix_caching: bool = True
    """Keep finished prompts' KV in a radix prefix cache and reuse it for shared prefixes."""
    host_kv_cache_bytes: int = 0
    """Host memory (per replica) for prefix-cache pages the device pool evicts; a later hit
    copies them back instead of recomputing them (0: no host tier)."""
    debug_nan_freed_pages: bool = False
    """Fill every freed page with NaN before the next step (a read of a stale page shows)."""
    window_kv: bool = True
    """Local (sliding-window) layers keep only the KV their window can still read, in a pool
    of their own (Gemma 2/3, Mistral; with unrolled layers and no host tier); off: every layer
    keeps every token."""
    num_window_slots: int | None = None
    """Page slots of the local layers' pool with window_kv (default: what max_num_seqs
    windows need, plus the memory num_pages leaves)."""

    def __post_init__(self):
        name = type(self).__name__
        _positive(name, "page_size", self.page_size)
        power_of_two(f"{name}.page_size", self.page_size,
                     " (every attention kernel reads whole pages of 2^k tokens)")
        _positive(name, "num_pages", self.num_pages, optional=True)
        _positive(name, "kv_cache_memory_bytes", self.kv_cache_memory_bytes, optional=True)
        f = self.kv_cache_memory_fraction
        if not isinstance(f, numbers.Real) or isinstance(f, bool) or not 0 < f <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {f!r}")
        _one_of(name, "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _positive(name, "num_window_slots", self.num_window_slots, optional=True)
        if not isinstance(self.window_kv, bool):
            raise ValueError(f"{name}.window_kv must be a bool, got {self.window_kv!r}")
        h = self.host_kv_cache_bytes
        if not isinstance(h, numbers.Integral) or isinstance(h, bool) or h < 0:
            raise ValueError(f"{name}.host_kv_cache_bytes must be an int >= 0, got {h!r}")
        if h and not self.enable_prefix_caching:
            raise ValueError(f"{name}.host_kv_cache_bytes needs enable_prefix_caching=True (the "
                             "host tier keeps prefix-cache entries)")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: how many sequences and tokens one step holds."""

    max_num_seqs: int = 32
    """Running sequences at most (each sample of an n > 1 request counts); the rows of every
    step."""
    max_num_batched_tokens: int = 512
    """Tokens of one step at most (decodes + prefill chunks): the largest token bucket."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); default: the model's context, or what the pool
    holds if less."""
    max_decode_steps: int | None = None
    """Decode steps one decode loop runs on device between two host reads while nothing
    waits (1: every step goes back to the host; default 8 on CPU, 1 on GPU/TPU)."""
    async_scheduling: bool = True
    """Dispatch the next decode loop before reading the current one, so host bookkeeping
    overlaps device work."""
    speculative_config: SpeculativeConfig | None = dataclasses.field(
        default=None, metadata={"cli": "json"})
    """Speculative decoding: a SpeculativeConfig or a dict of its fields (on the CLI: JSON,
    e.g. '{"method": "ngram", "num_speculative_tokens": 4}'); None: off."""

    def __post_init__(self):
        name = type(self).__name__
        for field in ("max_num_seqs", "max_num_batched_tokens"):
            _positive(name, field, getattr(self, field))
        for field in ("max_model_len", "max_decode_steps"):
            _positive(name, field, getattr(self, field), optional=True)
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"{name}.async_scheduling must be a bool, got "
                             f"{self.async_scheduling!r}")
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.of(self.speculative_config))


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How many devices one engine spans and how many engines serve behind one front."""

    tensor_parallel_size: int = 1
    """Devices one engine's model and KV pages are split over, by head."""
    data_parallel_size: int = 1
    """Engine replicas behind one front (each request routed by cached prefix, else load)."""
    enable_expert_parallel: bool = False
    """A mixture of experts split by expert over the tensor-parallel devices (each holds
    num_experts / tensor_parallel_size whole experts) instead of every expert by width."""

    def __post_init__(self):
        for field in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got "
                             f"{self.enable_expert_parallel!r}")


@dataclasses.dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation: prompts on one set of devices, decoding on another."""

    prefill_devices: tuple | None = dataclasses.field(default=None,
                                                      metadata={"cli": "devices"})
    """Devices of the prefill engine (with decode_devices; on the CLI: indices, e.g. 0,1)."""
    decode_devices: tuple | None = dataclasses.field(default=None, metadata={"cli": "devices"})
    """Devices of the decode engine (on the CLI: indices, e.g. 2,3)."""
    prefill_tensor_parallel_size: int | None = None
    """Tensor-parallel size of the prefill engine (default: the number of prefill_devices)."""
    decode_tensor_parallel_size: int | None = None
    """Tensor-parallel size of the decode engine (default: the number of decode_devices)."""

    def __post_init__(self):
        for field in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        for field in ("prefill_devices", "decode_devices"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, field, tuple(value))  # a list given: frozen as a tuple

    @property
    def enabled(self) -> bool:
        return self.prefill_devices is not None or self.decode_devices is not None


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """The compiled programs: attention kernels, compute dtype, sampling seed, warmup."""

    attention_impl: str = dataclasses.field(default="auto",
                                            metadata={"choices": ATTENTION_IMPLS})
    """Attention backend: auto (Pallas on GPU/TPU, the jnp reference on CPU), reference,
    pallas, interpret (the GPU kernel in Pallas interpret mode, on CPU), interpret-tpu, or a
    backend's kernel by name (pallas-gpu, pallas-tpu)."""
    dtype: str = dataclasses.field(default="auto", metadata={"choices": MODEL_DTYPES})
    """Compute dtype of a model loaded from a path: auto (float32 on CPU, the checkpoint's
    bf16/fp32 on GPU/TPU), float32 or bfloat16."""
    quantization: str = dataclasses.field(default="none", metadata={"choices": QUANTIZATIONS})
    """Weights of a model loaded from a path (or a float `jaxkv.Model`) quantized and kept
    quantized on the device: int8 (per output channel), int4 (groups of 128, or the largest
    of 64/32 that divides a weight's inputs), -g32/-g64 groups, gguf (a GGUF file's blocks as
    stored); none keeps float weights. See `jaxkv.model.quant`."""
    seed: int = 0
    """Engine seed: the sampling keys of requests without their own SamplingParams.seed."""
    warmup: bool = True
    """Compile every program serving can run when the LLM is built (as vLLM does before it
    serves), so no request waits on a compile; --no-warmup for quick scripts."""
    background_warmup: bool = False
    """Be ready as soon as every request can run (the smallest step and the samplers compiled)
    and compile the larger token buckets and the decode loops on a background thread, each step
    meanwhile capped at the largest token bucket compiled: a first start serves in seconds, at
    a reduced throughput until the rest is ready (`LLM.stats().programs_compiling`). Needs the
    program store (a compilation_cache_dir) and no tensor or data parallelism, disaggregation
    or speculation; else every program compiles first. On for `jaxkv serve`
    (--no-background-warmup: off)."""
    compilation_cache_dir: str = "auto"
    """Folder where compiled programs persist between runs (jax's persistent compilation
    cache), so the next start of the same model and settings loads them instead of compiling:
    auto ($JAXKV_COMPILATION_CACHE_DIR if set, else a folder set in jax's
    jax_compilation_cache_dir, else ~/.cache/jaxkv/xla), a path, or none (off). An LLM sets it
    for the whole process (jax has one cache); a bare Engine leaves jax as it is."""

    def __post_init__(self):
        name = type(self).__name__
        _one_of(name, "attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _one_of(name, "dtype", self.dtype, MODEL_DTYPES)
        _one_of(name, "quantization", self.quantization, QUANTIZATIONS)
        if not isinstance(self.compilation_cache_dir, str):
            raise ValueError(f"{name}.compilation_cache_dir must be a folder, 'auto' or 'none', "
                             f"got {self.compilation_cache_dir!r}")
        s = self.seed
        if not isinstance(s, numbers.Integral) or isinstance(s, bool) or not 0 <= s < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {s!r}")


_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
             "disagg": DisaggConfig, "runtime": RuntimeConfig}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, by concern. Build from flat keywords with `from_kwargs`."""

    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    disagg: DisaggConfig = dataclasses.field(default_factory=DisaggConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    @classmethod
    def from_kwargs(cls, base: EngineConfig | None = None, /, **settings) -> EngineConfig:
        """``base`` (default: all defaults) with the flat ``settings`` (``page_size=32``)
        applied. Raises ValueError naming an unknown setting and the nearest known one."""
        base = cls() if base is None else base
        per: dict[str, dict] = {}
        for key, value in settings.items():
            section = field_sections().get(key)
            if section is None:
                raise ValueError(unknown_setting(key))
            per.setdefault(section, {})[key] = value
        return dataclasses.replace(base, **{
            s: dataclasses.replace(getattr(base, s), **kw) for s, kw in per.items()})

    def flat(self) -> dict:
        """Every setting by its flat name (the inverse of `from_kwargs`)."""
        return {f.name: getattr(getattr(self, s), f.name)
                for s, c in _SECTIONS.items() for f in dataclasses.fields(c)}


@functools.cache
def field_sections() -> dict[str, str]:
    """Flat setting name -> the EngineConfig section holding it."""
    return {f.name: s for s, c in _SECTIONS.items() for f in dataclasses.fields(c)}


def unknown_setting(key: str, known=None) -> str:
    """The error for an unknown setting: its name and the nearest known one."""
    return nearest_name(key, field_sections() if known is None else known)


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a config dataclass (its documentation and its CLI
    help), read from the class source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for prev, node in zip(body, body[1:], strict=False):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = inspect.cleandoc(node.value.value)
    return docs


def config_fields():
    """(section class, dataclass field, docstring) of every setting, in declaration order."""
    for cls in _SECTIONS.values():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            yield cls, f, docs.get(f.name, "")


def cdiv(a: int, b: int) -> int:
    """Ceil division of non-negative ints: pages holding ``a`` tokens at ``b`` per page."""
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """The bytes of KV one token and one page take: the one formula behind the memory
    calculator, the pool planner and the stats.

    Per token, layer and kv head: a key and a value of ``head_dim`` elements of
    ``dtype_bytes`` each, plus (quantized pages) ``scale_bytes``: a bf16 key scale and a bf16
    value scale."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    scale_bytes: int = 0  # 4 for int8/fp8 pages, 0 otherwise

    @property
    def bytes_per_token(self) -> int:
        """All layers and kv heads of one token, scales included."""
        return self.num_layers * self.num_kv_heads * (2 * self.head_dim * self.dtype_bytes
                                                     + self.scale_bytes)

    def bytes_per_page(self, page_size: int) -> int:
        return self.bytes_per_token * page_size

    def replicated(self, tensor_parallel_size: int) -> int:
        """Bytes per token over all ``tensor_parallel_size`` devices that split the kv heads,
        heads replicated when there are fewer heads than devices counted as stored."""
        return self.bytes_per_token * max(1, tensor_parallel_size // self.num_kv_heads)

    def per_shard(self, tensor_parallel_size: int) -> int:
        """Bytes per token on each of ``tensor_parallel_size`` devices."""
        return self.replicated(tensor_parallel_size) // tensor_parallel_size


@dataclasses.dataclass(frozen=True)
class KVPoolPlan:
    """The KV pool one engine gets (`jaxkv.LLM` sizes it; logged at INFO, kept in
    ``LLM.kv_pool``)."""

    pages: int  # pages in the pool (per replica)
    page_size: int
    kv_cache_dtype: str
    bytes_per_token: int  # per replica: kv heads replicated for tensor parallelism count
    max_model_len: int
    source: str  # what sized it: num_pages, kv_cache_memory_bytes, device memory, host RAM
    # Window-only KV: the local layers' slots (0: none, every layer in the pages above; with
    # it, bytes_per_token counts the full-attention layers only) and the bytes of one slot.
    window_slots: int = 0
    window_slot_bytes: int = 0

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def bytes(self) -> int:
        """Both pools (the local layers' with its zero slot)."""
        window = (self.window_slots + 1) * self.window_slot_bytes if self.window_slots else 0
        return self.tokens * self.bytes_per_token + window

    @property
    def full_sequences(self) -> int:
        """Sequences of max_model_len tokens the pool holds at once."""
        return self.tokens // self.max_model_len
