"""jax's persistent compilation cache, on by default: a second start of the same model and
settings loads its programs from disk instead of compiling them (a server restart, a script
run again, a test run).

The cache is jax's own (`jax.experimental.compilation_cache`): one file per program, keyed by
the program, the jax/XLA version and the device, so a change of any of them just compiles
anew. ``RuntimeConfig.compilation_cache_dir`` picks the folder: "auto" is
``$JAXKV_COMPILATION_CACHE_DIR`` when set (a folder, or none), else a folder set through jax
itself (``jax_compilation_cache_dir``, or ``JAX_COMPILATION_CACHE_DIR``: a user who configured
jax keeps their setting and their thresholds), else `default_dir` (``~/.cache/jaxkv/xla``);
"none" turns it off (jaxkv's program store too; a folder the user gave jax stays jax's).

jax's cache is one per process: turning it on (by building an `LLM`) also caches the other
programs the process compiles from then on, a trainer's included, which is what a training
loop that samples with jaxkv wants; "none" turns off a folder jaxkv turned on (one the user
gave jax stays). The folder holds executable code: point it only at a folder you trust.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxkv.runtime.stored_jit import SUBFOLDER, use_program_store

OFF = ("none", "")
MAX_BYTES = 4 * 2**30  # the folder is an LRU of at most this many bytes (jax evicts)


def default_dir() -> Path:
    """Where "auto" puts the cache: ``xla`` in jaxkv's cache folder (``$JAXKV_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/jaxkv`` or ``~/.cache/jaxkv``, where the CPU kernels' library is
    built too)."""
    if os.environ.get("JAXKV_CACHE_DIR"):
        return Path(os.environ["JAXKV_CACHE_DIR"]) / "xla"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxkv" / "xla"


_ours: list[str] = []  # the folder jaxkv set in jax, if it set one (jax's config is global)


def use_compile_cache(setting: str) -> str | None:
    """Points jax's persistent compilation cache at the folder ``setting`` names ("auto", a
    path, or "none"); returns the folder in use (None: off). Idempotent; programs compiled
    before the first call are not saved, later ones are (every size, not only slow ones).
    jaxkv's own programs are kept whole beside it, in its ``jaxkv-programs`` folder
    (`jaxkv.runtime.stored_jit`): a later start neither traces nor lowers them."""
    named = os.environ.get("JAXKV_COMPILATION_CACHE_DIR")
    if setting == "auto" and named and named != "auto":
        setting = named  # the setting's environment default
    folder = _use_jax_cache(setting)
    use_program_store(None if folder is None or setting in OFF else Path(folder) / SUBFOLDER)
    return folder


def _use_jax_cache(setting: str) -> str | None:
    current = jax.config.jax_compilation_cache_dir
    if setting in OFF:
        if current and current in _ours:  # off again; a folder the user set stays
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()
            return None
        return current or None
    if setting == "auto":
        if current:  # the user (or an earlier LLM) configured jax: that folder
            return current
        folder = str(default_dir())
    else:
        folder = str(Path(setting).expanduser())
    if current == folder:
        return folder
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache_dir={setting!r}: cannot create {folder}: {e}") \
            from None
    jax.config.update("jax_compilation_cache_dir", folder)
    _ours.append(folder)
    # Engine programs on CPU compile in 0.1 to 10 s each: keep them all, not only those over
    # jax's default second; bound the folder (jax's default is unbounded).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    compilation_cache.reset_cache()  # jax decides once whether a cache is in use: ask again
    return folder
