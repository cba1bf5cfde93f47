"""jax's persistent compilation cache, on by default: a second start of the same model and
settings loads its programs from disk instead of compiling them (a server restart, a script
run again, a test run).

The cache is jax's own (`jax.experimental.compilation_cache`): one file per program, keyed by
the program, the jax/XLA version and the device, so a change of any of them just compiles
anew. ``RuntimeConfig.compilation_cache_dir`` picks the folder: "auto" is
``$JAXKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxkv/xla``, else ``~/.cache/jaxkv/xla``; "none"
turns it off. A folder set through jax itself (``jax_compilation_cache_dir``, or
``JAX_COMPILATION_CACHE_DIR``) wins over "auto", so a user who configured jax keeps their
setting.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

OFF = ("none", "")
MAX_BYTES = 4 * 2**30  # the folder is an LRU of at most this many bytes (jax evicts)


def default_dir() -> Path:
    """Where "auto" puts the cache."""
    if os.environ.get("JAXKV_CACHE_DIR"):
        return Path(os.environ["JAXKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxkv" / "xla"


def use_compile_cache(setting: str) -> str | None:
    """Points jax's persistent compilation cache at the folder ``setting`` names ("auto", a
    path, or "none"); returns the folder in use (None: off). Idempotent; programs compiled
    before the first call are not saved, later ones are (every size, not only slow ones)."""
    if setting in OFF:
        return None
    current = jax.config.jax_compilation_cache_dir
    if setting == "auto":
        if current:  # the user configured jax: theirs
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
    # Engine programs on CPU compile in 0.1 to 10 s each: keep them all, not only those over
    # jax's default second; bound the folder (jax's default is unbounded).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    compilation_cache.reset_cache()  # jax decides once whether a cache is in use: ask again
    return folder
