"""Hugging Face AWQ and GPTQ int4 checkpoints, kept quantized: their integers are repacked on
the host (numpy, one linear layer at a time) into jaxkv's int4 layout (`jaxkv.model.quant`),
never dequantized.

A quantized linear layer ``P`` (a Linear of ``I`` inputs, ``O`` outputs, groups of ``g``
inputs, ``G = I / g``) is stored as ``P.qweight``, ``P.qzeros``, ``P.scales`` (and, GPTQ only,
``P.g_idx``) instead of ``P.weight``, and means ``w[i, o] = (q[i, o] - z[i // g, o]) *
s[i // g, o]``, so it is jaxkv's ``q * scale + offset`` with ``scale = s``, ``offset = -z * s``
(exact in float32: z has 4 bits, s 11). int32 words hold 8 nibbles, nibble k in bits 4k..4k+3.

- **AutoAWQ GEMM** (``quant_method: awq``, ``version: gemm``, ``zero_point: true``; AutoAWQ
  ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``, ``awq/utils/packing_utils.py``):
  qweight i32[I, O/8] packed along O, nibble k of word c holding output ``8c + [0, 2, 4, 6, 1,
  3, 5, 7][k]``; qzeros i32[G, O/8] in the same order; scales f16[G, O].
- **GPTQ** (``quant_method: gptq``; GPTQModel ``gptqmodel/nn_modules/qlinear/__init__.py``
  ``pack_block``, vLLM ``quantization/gptq.py``): qweight i32[I/8, O] packed along I (nibble k
  of row r is input ``8r + k``); qzeros i32[G, O/8] packed along O in order; scales f16[G, O];
  g_idx i32[I], the group of each input. ``checkpoint_format: gptq`` (v1) stores every zero
  minus one, subtracted from the whole word (``0x11111111``, GPTQModel
  ``gptqmodel/utils/model.py`` ``convert_gptq_v2_to_v1_format_module``), so a zero of 0
  borrows from the next nibble; it is undone the same way, on the word. ``gptq_v2`` stores the
  zeros as they are.

GPTQ's qweight bytes are already jaxkv's layout: byte b of row r holds inputs ``8r + 2b`` (low
nibble) and ``8r + 2b + 1`` (high), i.e. jaxkv byte row ``4r + b``.

Refused, with an error naming the field: bits other than 4, group sizes other than 32, 64, 128
or -1 (one group per output channel), AWQ without zero points or in another kernel layout
(gemv, gemv_fast, exllama, marlin, ipex), GPTQ formats other than gptq/gptq_v2 (marlin,
bitblas, gptq_p, ...) or pack dtypes other than int32, per-module overrides (``dynamic``), a
quantized LM head, and a ``g_idx`` that is not ``i // group_size`` (``desc_act`` act-order):
jaxkv's groups are contiguous rows, and permuting the rows into contiguous groups would also
need the activations permuted per layer, which the model does not do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxkv.errors import CheckpointError
from jaxkv.model.loading import tensor_files
from jaxkv.model.quant import CHUNK, QuantizedWeight, QuantScheme, pack_int4

GROUP_SIZES = (32, 64, 128, -1)
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # output j of a word sits in its nibble [j]
GPTQ_V1_ZERO_BIAS = np.uint32(0x11111111)  # one per nibble, added back to every qzeros word
_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
_FLOAT_LINEAR = re.compile(r"model\.layers\.\d+\..*_proj\.weight")


@dataclasses.dataclass(frozen=True)
class Int4Format:
    """How an AWQ/GPTQ checkpoint packs its int4 linear layers (read from its config)."""

    method: str  # "awq" or "gptq"
    group_size: int | None  # None: one group per output channel (HF's -1)
    zeros_minus_one: bool  # GPTQ v1: each stored zero is the zero - 1 (word-wise)
    folder: str

    def scheme(self, requested: str | QuantScheme | None) -> QuantScheme:
        """The model's `QuantScheme`: the checkpoint's int4 groups (embedding float as stored),
        or with an explicit ``"int4"``/``"int4-g<its group>"`` that scheme (embedding int8);
        any other ``quantization`` is an error naming it."""
        own = QuantScheme(4, self.group_size, embedding=False)
        if requested is None:
            return own
        if requested == "int4":  # any group: "the checkpoint's int4"
            return dataclasses.replace(own, embedding=True)
        asked = QuantScheme.parse(requested)
        if asked.bits == 4 and asked.group_size == self.group_size and not asked.gguf:
            return asked
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        keep = "'int4'" + ("" if self.group_size is None else f" or 'int4-g{self.group_size}'")
        raise ValueError(f"quantization={asked.name!r}: {self.folder!r} is a {self.method} int4 "
                         f"checkpoint ({group}), kept as stored; pass quantization=None or "
                         f"{keep}")

    def hf_tensors(self):
        """(HF tensor name, loader) for `jaxkv.model.loading.load_tensors`: each quantized
        layer ``P`` as ``P.weight`` whose loader returns a `QuantizedWeight` (jaxkv [in, out]
        layout), every other tensor as stored."""
        with contextlib.ExitStack() as stack:
            where = {}
            for path in tensor_files(Path(self.folder)):
                f = stack.enter_context(safe_open(str(path), framework="np"))
                where.update({key: f for key in f.keys()})
            layers = {k.removesuffix(".qweight") for k in where if k.endswith(".qweight")}
            for key in where:
                part = next((p for p in _PARTS if key.endswith(p)), None)
                prefix = key.removesuffix(part) if part else None
                if prefix in layers:
                    if part == ".qweight":
                        if not prefix.startswith("model.layers."):
                            raise CheckpointError(f"{self.folder!r}: {prefix} is quantized "
                                                  "(lm_head); jaxkv keeps only the decoder "
                                                  "layers' linear weights in int4")
                        yield prefix + ".weight", lambda p=prefix: self._weight(p, where)
                    continue
                if _FLOAT_LINEAR.fullmatch(key):
                    raise CheckpointError(
                        f"{self.folder!r}: {key} is stored unquantized in a {self.method} "
                        "checkpoint (modules_to_not_convert / dynamic); jaxkv needs every "
                        "decoder linear layer in the checkpoint's int4 format")
                yield key, lambda k=key: where[k].get_tensor(k)

    def _weight(self, prefix: str, where) -> QuantizedWeight:
        def get(part, dtypes=(np.int32,)):
            if prefix + part not in where:
                raise CheckpointError(f"{self.folder!r}: {prefix}.qweight has no {prefix}{part}")
            t = where[prefix + part].get_tensor(prefix + part)
            if t.dtype not in dtypes:
                raise CheckpointError(f"{prefix}{part}: dtype must be "
                                      f"{'/'.join(np.dtype(d).name for d in dtypes)}, got "
                                      f"{t.dtype}")
            return t

        qweight = get(".qweight")
        if qweight.ndim != 2:
            raise CheckpointError(f"{prefix}.qweight: expected 2 dimensions, got {qweight.shape}")
        awq = self.method == "awq"
        rows, cols = qweight.shape
        inputs, outputs = (rows, cols * 8) if awq else (rows * 8, cols)
        group = inputs if self.group_size is None else self.group_size
        if inputs % group:
            raise CheckpointError(f"{prefix}.qweight: {inputs} inputs are not a multiple of "
                                  f"group_size {group}")
        groups = inputs // group
        scales = get(".scales", (np.float16, np.float32)).astype(np.float32)
        qzeros = get(".qzeros")
        for part, t, want in ((".scales", scales, (groups, outputs)),
                              (".qzeros", qzeros, (groups, outputs // 8))):
            if t.shape != want:
                raise CheckpointError(f"{prefix}{part}: expected {want} for a weight of {inputs}"
                                      f" inputs, {outputs} outputs and group_size "
                                      f"{self.group_size or -1}, got {t.shape}")
        if not awq and prefix + ".g_idx" in where:
            g_idx = get(".g_idx")
            if g_idx.shape != (inputs,) or not np.array_equal(g_idx,
                                                               np.arange(inputs) // group):
                raise CheckpointError(
                    f"{prefix}.g_idx is not i // group_size: desc_act (act-order) checkpoints "
                    "are not supported (jaxkv's groups are contiguous rows and its layers do "
                    "not permute activations); quantize with desc_act=False")
        words = np.ascontiguousarray(qzeros, "<i4").view("<u4")
        if self.zeros_minus_one:
            words = words + GPTQ_V1_ZERO_BIAS  # wraps like the int32 words it undoes
        zeros = _nibbles(words)  # [G, O]
        if awq:
            zeros = _awq_columns(zeros)
            q = np.empty((inputs // 2, outputs), np.uint8)
            step = max(2, CHUNK // outputs // 2 * 2)  # bounds the unpacked nibbles' temporaries
            for r in range(0, inputs, step):
                q[r // 2:(r + step) // 2] = pack_int4(_awq_columns(_nibbles(qweight[r:r + step])))
        else:  # [I/8, O] words -> [I/8, O, 4] bytes -> [I/8, 4, O] = jaxkv's [I/2, O]
            data = np.ascontiguousarray(qweight, "<i4").view(np.uint8).reshape(rows, cols, 4)
            q = np.ascontiguousarray(data.transpose(0, 2, 1)).reshape(inputs // 2, outputs)
        offset = zeros.astype(np.float32) * -scales
        return QuantizedWeight(q, scales, offset, 4)


def _nibbles(words: np.ndarray) -> np.ndarray:
    """u8[..., 8n]: the nibbles of [..., n] 32-bit words, nibble k of word j at 8j + k."""
    data = np.ascontiguousarray(words).astype("<u4", copy=False).view(np.uint8)
    return np.stack([data & 15, data >> 4], axis=-1).reshape(*words.shape[:-1], -1)


def _awq_columns(nibbles: np.ndarray) -> np.ndarray:
    """AWQ's interleaved nibbles [..., O] -> values in output order."""
    *lead, cols = nibbles.shape
    return nibbles.reshape(*lead, cols // 8, 8)[..., AWQ_REVERSE_ORDER].reshape(*lead, cols)


def _config(folder: Path) -> dict | None:
    """The quantization config: config.json's ``quantization_config``, else AutoGPTQ/AutoAWQ's
    separate ``quantize_config.json`` / ``quant_config.json``."""
    hf = json.loads((folder / "config.json").read_text())
    if hf.get("quantization_config"):
        return dict(hf["quantization_config"])
    for name in ("quantize_config.json", "quant_config.json"):
        if (folder / name).is_file():
            cfg = json.loads((folder / name).read_text())
            cfg.setdefault("quant_method", "awq" if name == "quant_config.json" else "gptq")
            return cfg
    return None


def read_int4_format(folder: str | Path) -> Int4Format | None:
    """The `Int4Format` of an AWQ/GPTQ int4 checkpoint folder, None for an unquantized one; a
    quantized checkpoint jaxkv cannot keep as stored is a `CheckpointError` naming the field."""
    folder = Path(folder)
    cfg = _config(folder)
    if cfg is None:
        return None
    where = f"{str(folder)!r}: quantization_config"
    method = str(cfg.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise CheckpointError(f"{where}.quant_method={cfg.get('quant_method')!r}: jaxkv loads "
                              "'awq' (AutoAWQ GEMM) and 'gptq' int4 checkpoints")
    bits = cfg.get("bits", cfg.get("w_bit"))
    if bits != 4:
        raise CheckpointError(f"{where}.bits={bits!r}: only 4-bit {method} checkpoints are "
                              "supported")
    group = cfg.get("group_size", cfg.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise CheckpointError(f"{where}.group_size={group!r}: must be one of {GROUP_SIZES}")

    def refuse_unless(key, value, allowed, why):
        if value not in allowed:
            raise CheckpointError(f"{where}.{key}={cfg.get(key)!r}: {why}")

    if method == "awq":
        refuse_unless("version", str(cfg.get("version", "gemm")).lower(), ("gemm",),
                      "only AutoAWQ's GEMM packing is supported (not gemv, gemv_fast, "
                      "exllama, marlin or ipex)")
        refuse_unless("zero_point", cfg.get("zero_point", True), (True,),
                      "AWQ GEMM checkpoints carry zero points; this one has none")
        refuse_unless("backend", str(cfg.get("backend", "autoawq")).lower(), ("autoawq",),
                      "only AutoAWQ's packing is supported (not llm-awq's)")
        v1 = False
    else:
        fmt = str(cfg.get("checkpoint_format", cfg.get("format", "gptq"))).lower()
        refuse_unless("checkpoint_format", fmt, ("gptq", "gptq_v2"),
                      "only the 'gptq' (v1) and 'gptq_v2' layouts are supported (not marlin, "
                      "bitblas, gptq_p, ...)")
        refuse_unless("is_marlin_format", bool(cfg.get("is_marlin_format")), (False,),
                      "marlin-packed GPTQ checkpoints are not supported")
        refuse_unless("pack_dtype", str(cfg.get("pack_dtype", "int32")).removeprefix("torch."),
                      ("int32",), "only int32 packing words are supported")
        refuse_unless("lm_head", bool(cfg.get("lm_head")), (False,),
                      "a quantized LM head is not supported")
        refuse_unless("dynamic", bool(cfg.get("dynamic")), (False,),
                      "per-module overrides are not supported")
        v1 = fmt == "gptq"
    return Int4Format(method, None if group == -1 else group, v1, str(folder))
