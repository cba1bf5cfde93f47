"""The CPU kernels' shared library: every ``csrc/*.cc`` (C++ XLA FFI handlers, with the
``csrc/*.h`` they share) compiled into one ``.so`` on first use and its targets registered
with XLA.

It is built with the system C++ compiler (``$CXX``, else ``g++``) against jaxlib's FFI headers
(``jax.ffi.include_dir()``) into a cache folder (``$JAXKV_CACHE_DIR``, default
``~/.cache/jaxkv``), named by a hash of the sources and headers, jaxlib's include path and
jax's version, and renamed into place when complete (concurrent processes are safe). Where it
cannot be built (no compiler), `library` returns None and callers use XLA instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cc"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # included by the sources
# FFI target name -> the handler symbol the library exports.
TARGETS = {"jaxkv_quantized_matmul": "JaxkvQuantizedMatmul",
           "jaxkv_paged_decode_attention": "JaxkvPagedDecodeAttention"}


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXKV_CACHE_DIR") or Path.home() / ".cache" / "jaxkv")


def _compile() -> Path:
    """The shared library for these sources, compiled once per source hash and jaxlib."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)
                            + jax.ffi.include_dir().encode() + jax.__version__.encode())
    out = _cache_dir() / f"jaxkv_cpu-{digest.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++ or $CXX) to build jaxkv's CPU kernels")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # atomic: rename when complete
        built = Path(tmp) / out.name
        subprocess.run([compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-w",
                        f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(built)],
                       check=True, capture_output=True, text=True)
        os.replace(built, out)
    return out


@functools.cache
def library():
    """The loaded library with its FFI targets registered, or None where it cannot be built."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_compile()))
    except (OSError, subprocess.CalledProcessError):
        return None
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return lib
