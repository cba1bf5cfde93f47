"""`jaxkv.Model`: a config, an NNX graphdef, a params pytree and an optional tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxkv.errors import CheckpointNotFoundError
from jaxkv.model.config import ModelConfig
from jaxkv.model.llama import Llama
from jaxkv.model.loading import load_params

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-llama"
_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16}


@dataclasses.dataclass
class Model:
    """What the runtime needs: ``params`` is a plain pytree, so new weights need no reload."""

    config: ModelConfig
    graphdef: Any  # nnx.GraphDef of Llama
    params: Any  # nnx.State of Llama's Params
    tokenizer: Any | None = None
    path: str | None = None

    @classmethod
    def from_module(cls, module: Llama, tokenizer=None, path=None) -> Model:
        graphdef, params = nnx.split(module)
        return cls(module.config, graphdef, params, tokenizer, path)

    @property
    def dtype(self):
        return nnx.merge(self.graphdef, self.params).dtype

    def module(self) -> Llama:
        return nnx.merge(self.graphdef, self.params)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of strings")
        return list(self.tokenizer.encode(text))

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _dtype(name):
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def load_pretrained(path: str | Path, *, dtype: str = "float32", param_dtype: str | None = None,
                    scan_layers: bool | None = None, on_host: bool = False) -> Model:
    """Loads an HF checkpoint folder (config.json + safetensors [+ tokenizer]).

    ``scan_layers`` (default: True except on CPU) picks the layer layout; see DecoderLayers.
    ``on_host`` leaves the weights in host memory for `jaxkv.shard` to split over devices (a
    model that does not fit one device never lands whole on one).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointNotFoundError(
            f"load_pretrained: checkpoint folder {str(folder)!r} not found")
    config = ModelConfig.from_hf(folder)
    compute = _dtype(dtype)
    module = load_params(folder, config, dtype=compute,
                         param_dtype=_dtype(param_dtype) if param_dtype else compute,
                         scan_layers=scan_layers, on_host=on_host)
    tokenizer = None
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return Model.from_module(module, tokenizer, str(folder))


def load_default(*, dtype: str = "float32") -> Model:
    """The embedded tiny model shipped inside the package (see its model card)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded model is missing from {DEFAULT_MODEL_DIR}; run scripts/train_tiny.py"
        )
    return load_pretrained(DEFAULT_MODEL_DIR, dtype=dtype)


def random_model(config: ModelConfig, *, seed: int = 0, dtype: str = "float32",
                 scan_layers: bool | None = None) -> Model:
    """A randomly initialized model (tests, benchmarks)."""
    compute = _dtype(dtype)
    module = Llama(config, dtype=compute, param_dtype=compute, scan_layers=scan_layers,
                   rngs=nnx.Rngs(seed))
    return Model.from_module(module)
