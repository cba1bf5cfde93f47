"""jaxkv: LLM inference in JAX with a paged KV cache.

Quick use::

    import jaxkv
    model = jaxkv.load_default()
    jaxkv.generate(model, ["def fib(n):"], jaxkv.SamplingParams(temperature=0, max_tokens=32))
"""

from jaxkv.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    KVPoolPlan,
    KVSpec,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from jaxkv.disagg import DisaggregatedEngine
from jaxkv.engine.client import EngineClient
from jaxkv.engine.engine import Engine
from jaxkv.engine.generate import generate, generate_no_cache, generate_with_stats
from jaxkv.engine.llm import LLM
from jaxkv.engine.request import CompletionOutput, EngineStats, Logprob, RequestOutput
from jaxkv.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    KVStateError,
    UnsupportedModelError,
)
from jaxkv.kv import PagedKVState, init_state
from jaxkv.model.config import ModelConfig
from jaxkv.model.pretrained import Model, load_default, load_pretrained, quantize, random_model
from jaxkv.sampling_params import RequestOutputKind, SamplingParams
from jaxkv.sharding import make_mesh, shard
from jaxkv.structured import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CacheConfig",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CompletionOutput",
    "DisaggConfig",
    "DisaggregatedEngine",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineStats",
    "KVPoolPlan",
    "KVSpec",
    "KVStateError",
    "Logprob",
    "Model",
    "ModelConfig",
    "PagedKVState",
    "ParallelConfig",
    "RequestOutput",
    "RequestOutputKind",
    "RuntimeConfig",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "UnsupportedModelError",
    "generate",
    "generate_no_cache",
    "generate_with_stats",
    "init_state",
    "load_default",
    "load_pretrained",
    "quantize",
    "make_mesh",
    "random_model",
    "shard",
]
