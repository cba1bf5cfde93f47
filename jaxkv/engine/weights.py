"""Weight updates mid-serving (`Engine.update_params`): new params checked against the ones the
engine compiled its programs for, and the weight versions that key the prefix cache.

The programs take the params as an argument (`jaxkv.runtime.steps`), so new weights with the
same tree, shapes, dtypes and shardings run in them as they are: nothing compiles.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv.model.config import ModelConfig
from jaxkv.model.pretrained import Model, quantize

IN_FLIGHT = ("restart", "keep")  # what update_params does with requests already running


def param_specs(params):
    """The shape and dtype of every leaf: what new params must match."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def source_params(params, config: ModelConfig, specs, quantization=None):
    """The params pytree of ``params`` (a `Model` or a pytree) after checking it against the
    model the engine was built from (its ``config``, its params' ``specs`` and its
    ``quantization``: a float `Model` is quantized the same way, as a trainer holds float
    weights). Raises ValueError naming ``params`` and the offending config field or leaf
    path."""
    if isinstance(params, Model):
        if quantization is not None and params.quantization is None:
            params = quantize(params, quantization)
        if params.config != config:
            fields = [f.name for f in dataclasses.fields(config)
                      if getattr(params.config, f.name) != getattr(config, f.name)]
            raise ValueError(f"params: the Model's config differs from the engine's in "
                             f"{', '.join(fields)}")
        params = params.params
    got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs)[0]}
    missing = [p for p in want if p not in got]
    if missing:
        raise ValueError(f"params{missing[0]} is missing ({len(missing)} leaves missing): pass "
                         "a jaxkv.Model or a pytree with the structure of its Model.params")
    extra = [p for p in got if p not in want]
    if extra:
        raise ValueError(f"params{extra[0]} is not a leaf of the engine's model params "
                         f"({len(extra)} unexpected leaves)")
    if jax.tree.structure(params) != jax.tree.structure(specs):
        raise ValueError("params: the same leaf paths in other containers than the engine's "
                         "model params (pass a pytree with the structure of Model.params)")
    for path, spec in want.items():
        x = got[path]
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"params{path} must be an array, got {type(x).__name__}")
        if tuple(x.shape) != spec.shape:
            raise ValueError(f"params{path} has shape {tuple(x.shape)}; the engine's model has "
                             f"{spec.shape}")
        if np.dtype(x.dtype) != spec.dtype:
            raise ValueError(f"params{path} has dtype {np.dtype(x.dtype).name}; the engine's "
                             f"model has {spec.dtype.name}")
    return params


def check_in_flight(in_flight) -> None:
    if not isinstance(in_flight, str) or in_flight not in IN_FLIGHT:
        raise ValueError(f"in_flight must be one of {', '.join(map(repr, IN_FLIGHT))}, got "
                         f"{in_flight!r}")


def next_version(current, version, served=()):
    """The version new weights serve under: ``version`` (an int or a str), or by default the
    current one + 1. ``served``: every version served so far, which none may take again (the
    prefix cache keys KV by version, so a reused one would serve KV of other weights)."""
    if version is None:
        if isinstance(current, bool) or not isinstance(current, int):
            raise ValueError(f"version: the current weight version {current!r} is not an int, "
                             "so it has no successor; pass version explicitly")
        version = current + 1
        while version in served:
            version += 1
        return version
    if isinstance(version, bool) or not isinstance(version, (int, str)):
        raise ValueError(f"version must be None, an int or a str, got {version!r}")
    if version == current or version in served:
        which = "the current one" if version == current else "one served before"
        raise ValueError(f"version={version!r} is {which}: a version names one set of weights "
                         "and the prefix cache keys KV by it, so new weights need a version "
                         "not used yet")
    return version
