"""KV-cache memory planning, in plain Python (no jax).

Each token keeps a key and a value per layer: 2 * layers * kv_heads * head_dim * dtype_bytes,
plus, for quantized KV (int8, fp8), one 4-byte word of scales per layer and kv head (a bfloat16
key scale and value scale, ``pallas_kernels.quant``).
Decode rereads the whole cache from HBM each step (bandwidth-bound), so KV capacity caps batch.
Reserving max_model_len per sequence wastes the unused tail; paging wastes at most one partial page.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from jaxkv.config import KVSpec, cdiv
from jaxkv.model.config import REQUIRED, count_params, read_dims

DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2,
    "int8": 1, "fp8": 1, "fp8_e4m3": 1,
}
QUANTIZED = ("int8", "fp8", "fp8_e4m3")
SCALE_BYTES = 4  # per token, layer and kv head: a bf16 key scale and a bf16 value scale


def dtype_bytes(name: str) -> int:
    """Bytes per element for a dtype name such as "bf16"."""
    try:
        return DTYPE_BYTES[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; accepted: {', '.join(DTYPE_BYTES)}") from None


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that memory depends on."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False

    qk_norm: bool = False
    sandwich_norm: bool = False  # Gemma 2/3's post-attention and post-MLP norms
    num_experts: int = 0  # a mixture of experts (Mixtral, Qwen3-MoE)
    moe_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model with a dense MLP
    sliding_window: int | None = None  # local layers' window (Gemma 2/3)
    local_layers: int = 0  # layers that attend only within the window

    def num_params(self) -> int:
        """Parameter count (the model's own formula, `jaxkv.model.config.count_params`)."""
        return count_params(self)

    @classmethod
    def from_config(cls, config, name: str) -> ModelShape:
        """The shape of a `jaxkv.ModelConfig` (a loaded model's)."""
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)
                  if f.name not in ("name", "local_layers")}
        return cls(name, **fields, local_layers=config.num_local_layers)

    @classmethod
    def from_hf_config(cls, path_or_dict, name: str | None = None) -> ModelShape:
        """Build from a Hugging Face config.json (file, folder holding one, or dict), read
        by the model's own reader (`jaxkv.model.config.read_dims`)."""
        if isinstance(path_or_dict, dict):
            config, source = path_or_dict, "<dict>"
            default_name = config.get("_name_or_path") or config.get("model_type") or "custom"
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"no config.json at {path}")
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
            source, default_name = str(path), path.parent.name or "custom"

        def get(key, default=REQUIRED):
            value = config.get(key)
            if value is None and default is REQUIRED:
                raise ValueError(f"missing required key {key!r} in {source}")
            return default if value is None else value

        dims = read_dims(get)
        # Local layers as `layer_types` lists them (Gemma 2 before it: every other layer)
        types = get("layer_types", None) or (
            ["sliding_attention", "full_attention"] * dims["num_layers"]
            if get("model_type", None) == "gemma2" else [])
        local = sum(t == "sliding_attention" for t in types[:dims["num_layers"]])
        window = get("sliding_window", None) if local else None
        return cls(name=name or str(default_name), **dims, sliding_window=window,
                   local_layers=local if window else 0)


def _preset(name, L, E, F, H, K, D, V, tied=False, bias=False, qk_norm=False,
            sandwich=False, experts=0, expert_width=0, window=None, local=0) -> ModelShape:
    return ModelShape(name, L, E, F, H, K, D, V, tied, bias, qk_norm, sandwich, experts,
                      expert_width, sliding_window=window, local_layers=local)


# Values copied from the published config.json files.
PRESETS: dict[str, ModelShape] = {s.name: s for s in [
    _preset("llama-3.2-1b", 16, 2048, 8192, 32, 8, 64, 128256, tied=True),
    _preset("llama-3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256, tied=True),
    _preset("llama-2-7b", 32, 4096, 11008, 32, 32, 128, 32000),
    _preset("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000),
    _preset("llama-2-70b", 80, 8192, 28672, 64, 8, 128, 32000),
    _preset("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256),
    _preset("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256),
    _preset("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32000),
    _preset("qwen2.5-7b", 28, 3584, 18944, 28, 4, 128, 152064, bias=True),
    # Gemma 2: every other layer local (window 4096); Gemma 3: 5 local to 1 global
    _preset("gemma-2-2b", 26, 2304, 9216, 8, 4, 256, 256000, tied=True, sandwich=True,
            window=4096, local=13),
    _preset("gemma-3-1b", 26, 1152, 6912, 4, 1, 256, 262144, tied=True, qk_norm=True,
            sandwich=True, window=512, local=22),
    _preset("gemma-3-4b", 34, 2560, 10240, 8, 4, 256, 262208, tied=True, qk_norm=True,
            sandwich=True, window=1024, local=29),
    _preset("phi-3.5-mini", 32, 3072, 8192, 32, 32, 96, 32064),
    _preset("mixtral-8x7b", 32, 4096, 14336, 32, 8, 128, 32000, experts=8, expert_width=14336),
    _preset("qwen3-30b-a3b", 48, 2048, 6144, 32, 4, 128, 151936, qk_norm=True, experts=128,
            expert_width=768),
]}


def resolve_model(name_or_path) -> ModelShape:
    """A preset by name, otherwise a config.json file or the folder holding one."""
    key = str(name_or_path)
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]
    if Path(key).exists():
        return ModelShape.from_hf_config(key)
    raise ValueError(
        f"unknown model {key!r}: not a preset and not a path; presets: {', '.join(PRESETS)}")


def kv_bytes_per_token(shape: ModelShape, dtype: str = "bfloat16") -> int:
    """Key + value bytes one token occupies across all layers (scales included when
    ``dtype`` is a quantized KV dtype)."""
    return kv_spec(shape, dtype).bytes_per_token


def kv_spec(shape: ModelShape, dtype: str = "bfloat16") -> KVSpec:
    """The KV bytes of ``shape``'s tokens in pages of the dtype named ``dtype``."""
    scale = SCALE_BYTES if str(dtype).lower() in QUANTIZED else 0
    return KVSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_bytes(dtype),
                  scale)


def kv_bytes(shape: ModelShape, num_tokens: int, batch: int = 1, dtype: str = "bfloat16") -> int:
    """KV bytes for `batch` sequences of `num_tokens` tokens each."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    return kv_bytes_per_token(shape, dtype) * num_tokens * batch


def window_kv_bytes(shape: ModelShape, context: int, dtype: str = "bfloat16",
                    page_size: int = 16) -> int:
    """KV bytes of one sequence of ``context`` tokens with window-only KV
    (`jaxkv.cache.window`): full-attention layers keep every token, local layers the pages
    their window spans (``cdiv(window - 1, page_size) + 1``); `kv_bytes` without a window."""
    per_layer = kv_bytes_per_token(shape, dtype) // shape.num_layers
    if not shape.sliding_window or not shape.local_layers:
        return per_layer * shape.num_layers * context
    kept = min(context, (cdiv(shape.sliding_window - 1, page_size) + 1) * page_size)
    full = shape.num_layers - shape.local_layers
    return per_layer * (full * context + shape.local_layers * kept)


def weight_bytes(shape: ModelShape, dtype: str = "bfloat16") -> int:
    """Bytes of the model weights stored in `dtype`."""
    return shape.num_params() * dtype_bytes(dtype)


def format_bytes(n: int | float) -> str:
    """Decimal and binary sizes together, e.g. "1.34 GB (1.25 GiB)"."""
    n = float(n)
    if abs(n) < 1000:
        return f"{n:.0f} B"
    units = ["KB", "MB", "GB", "TB", "PB"]
    level = min(int(math.log(abs(n), 1000)), len(units))
    unit = units[level - 1]
    return f"{n / 1000 ** level:.2f} {unit} ({n / 1024 ** level:.2f} {unit[0]}iB)"


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """How many sequences fit in the KV budget, contiguous versus paged."""

    model: str
    dtype: str
    hbm_bytes: int
    weight_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    max_model_len: int
    avg_seq_len: int
    page_size: int
    contiguous_seqs: int
    paged_seqs: int
    paged_waste_fraction: float
    contiguous_waste_fraction: float
    kv_dtype: str = ""  # the KV pages' dtype when it differs from the weights'

    def table(self) -> str:
        """A small aligned text table of the plan."""
        rows = [
            ("model", f"{self.model} ({self.dtype}"
                      + (f", KV {self.kv_dtype})" if self.kv_dtype != self.dtype else ")")),
            ("HBM", format_bytes(self.hbm_bytes)),
            ("weights", format_bytes(self.weight_bytes)),
            ("KV budget", format_bytes(self.kv_budget_bytes)),
            ("KV per token", f"{self.kv_bytes_per_token:,} bytes"),
            ("max_model_len", f"{self.max_model_len:,}"),
            ("avg_seq_len", f"{self.avg_seq_len:,}"),
            ("page_size", f"{self.page_size}"),
            ("contiguous seqs", f"{self.contiguous_seqs:,}"
             f"  (waste {self.contiguous_waste_fraction:.1%})"),
            ("paged seqs", f"{self.paged_seqs:,}  (waste {self.paged_waste_fraction:.1%})"),
        ]
        if self.kv_budget_bytes == 0:
            rows.append(("note", "weights exceed usable HBM; no room for KV cache"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plan_capacity(shape: ModelShape, hbm_bytes: int, *, dtype: str = "bfloat16",
                  max_model_len: int, avg_seq_len: int, page_size: int = 16,
                  gpu_memory_utilization: float = 0.9, kv_dtype: str | None = None
                  ) -> CapacityPlan:
    """Compare contiguous max-length reservation with paging for one device; weights in
    ``dtype``, KV in ``kv_dtype`` (default: ``dtype``)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    checks = [
        ("hbm_bytes", hbm_bytes, hbm_bytes > 0),
        ("max_model_len", max_model_len, max_model_len > 0),
        ("avg_seq_len", avg_seq_len, avg_seq_len > 0),
        ("page_size", page_size, page_size > 0 and page_size & (page_size - 1) == 0),
        ("gpu_memory_utilization", gpu_memory_utilization, 0 < gpu_memory_utilization <= 1),
    ]
    for field, value, ok in checks:
        if not ok:
            raise ValueError(f"invalid {field}: {value!r}")
    if avg_seq_len > max_model_len:
        raise ValueError(
            f"invalid avg_seq_len: {avg_seq_len} exceeds max_model_len {max_model_len}")
    per_token = kv_bytes_per_token(shape, kv_dtype)
    weights = weight_bytes(shape, dtype)
    budget = max(0, int(hbm_bytes * gpu_memory_utilization) - weights)
    pages = cdiv(avg_seq_len, page_size)
    paged_tokens = pages * page_size
    return CapacityPlan(
        model=shape.name, dtype=dtype, hbm_bytes=int(hbm_bytes), weight_bytes=weights,
        kv_budget_bytes=budget, kv_bytes_per_token=per_token,
        max_model_len=max_model_len, avg_seq_len=avg_seq_len, page_size=page_size,
        contiguous_seqs=budget // (max_model_len * per_token),
        paged_seqs=budget // (paged_tokens * per_token),
        paged_waste_fraction=(paged_tokens - avg_seq_len) / paged_tokens,
        contiguous_waste_fraction=(max_model_len - avg_seq_len) / max_model_len,
        kv_dtype=kv_dtype,
    )


@dataclasses.dataclass(frozen=True)
class ShardedPlan:
    """One device's share of a model split ``tp`` ways by head (see `jaxkv.sharding`)."""

    model: str
    tp: int
    kv_replication: int  # copies of each kv head (tp / num_kv_heads when that is > 1)
    weight_bytes: int  # per device
    kv_bytes_per_token: int  # per device, replication included
    kv_tokens: int  # KV tokens that fit per device (so in the whole cache)
    seqs: int  # concurrent sequences of avg_seq_len tokens (paged)
    step_floor_s: float  # decode step lower bound: read weights + a full cache once
    weights_floor_s: float  # ... with an empty cache (batch 1, short context)


def plan_sharded(shape: ModelShape, tp: int, *, hbm_bytes: int, bandwidth: float,
                 dtype: str = "bfloat16", avg_seq_len: int = 2048, page_size: int = 16,
                 utilization: float = 0.9, kv_dtype: str | None = None) -> ShardedPlan:
    """Bytes per device, KV capacity and a bandwidth floor for a ``tp``-way split.

    Attention and MLP weights, embeddings and lm_head split ``tp`` ways; norm scales are
    replicated. KV heads split ``tp`` ways, replicated ``tp / num_kv_heads`` times when tp
    exceeds them. Decode reads every weight and every cached KV byte once per step, so
    bytes / ``bandwidth`` (per device, bytes/s) bounds the step time from below.
    """
    if tp < 1 or shape.num_heads % tp or (shape.num_kv_heads % tp and tp % shape.num_kv_heads):
        raise ValueError(f"invalid tp: {tp} does not split {shape.num_heads} heads and "
                         f"{shape.num_kv_heads} kv heads")
    b = dtype_bytes(dtype)
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * b
    weights = (weight_bytes(shape, dtype) - norms) // tp + norms
    rep = max(1, tp // shape.num_kv_heads)
    per_token = kv_spec(shape, dtype if kv_dtype is None else kv_dtype).per_shard(tp)
    budget = max(0, int(hbm_bytes * utilization) - weights)
    tokens = budget // per_token // page_size * page_size
    seqs = tokens // (cdiv(avg_seq_len, page_size) * page_size)
    return ShardedPlan(shape.name, tp, rep, weights, per_token, tokens, seqs,
                       (weights + tokens * per_token) / bandwidth, weights / bandwidth)
