"""Programs whose compiled executables outlive the process: a later start runs them without
tracing or lowering them again.

jax's persistent compilation cache (`jaxkv.runtime.compile_cache`) skips XLA's compile on a
second start, but finds its entry by tracing the program and lowering it to StableHLO first,
which for a 30-layer model is most of a warm warmup (0.4 to 0.8 s per program on the 2-core
machine, one program at a time under the GIL). `stored_jit` is `jax.jit` that also keeps each
compiled executable in a folder (``jaxkv-programs`` inside the compilation cache's folder,
switched on and off with it) under a key made of everything the program depends on, as vLLM
keys its compile cache by a hash of its code and configuration:

- jaxkv's own code (every ``.py``, ``.cc`` and ``.h`` file of ``jaxkv`` and
  ``pallas_kernels``), jax's and jaxlib's versions, the backend and its devices, the CPU's
  instruction sets, the XLA/JAX/JAXKV environment variables and jax's numeric settings;
- the function and what it closes over (a `functools.partial`'s arguments: the model's graph
  with its config, the attention implementation, the mesh), and the jit options;
- the call's signature: the pytree structure, each leaf's shape, dtype, weak type and sharding
  (with its devices), and the static arguments' values.

Anything whose description is not reproducible across processes (a repr with a memory
address) is not stored: it runs through `jax.jit` as before. A file that fails to load is
removed and the program compiled again. The folder holds executable code: point it only at a
folder you trust (as jax's own cache).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import pickle
import platform
import sys
import threading
import weakref
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

_log = logging.getLogger(__name__)

LOADED_EVENT = "/jaxkv/program_store/loaded"  # a program loaded from the folder (jax.monitoring)
SUBFOLDER = "jaxkv-programs"
MAX_BYTES = 2 * 2**30  # the oldest files go once the folder holds more
_ROOTS = ("jaxkv", "pallas_kernels")

_folder: list[Path | None] = [None]
_write_lock = threading.Lock()


def use_program_store(folder: str | Path | None) -> Path | None:
    """Keeps programs' executables in ``folder`` from now on (None: off); returns it."""
    _folder[0] = None if folder is None else Path(folder)
    if _folder[0] is not None:
        _folder[0].mkdir(parents=True, exist_ok=True)
    return _folder[0]


def program_store() -> Path | None:
    """The folder in use, or None."""
    return _folder[0]


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    digest = hashlib.sha256()
    top = Path(__file__).resolve().parents[2]
    for root in _ROOTS:
        for path in sorted((top / root).rglob("*")):
            if path.suffix in (".py", ".cc", ".h") and "assets" not in path.parts:
                digest.update(str(path.relative_to(top)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


_ENV_PREFIXES = ("XLA_", "JAX_", "JAXKV_", "LIBTPU_", "TPU_", "CUDA_VISIBLE", "NVIDIA_")
_NOT_SEMANTIC = ("CACHE", "LOG", "TRACEBACK", "PROFIL", "PLATFORMS_QUIET")


def _environment() -> str:
    """What a program depends on beyond its own code and signature (read per key: a process
    may change the devices' backend or jax's settings after import)."""
    client = jax.devices()[0].client
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)
                 and not any(word in k for word in _NOT_SEMANTIC))
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items()
                      if not any(word in k.upper() for word in _NOT_SEMANTIC))
    devices = [(d.id, d.device_kind, d.process_index) for d in jax.devices()]
    versions = [jax.__version__, jaxlib.__version__, np.__version__]
    for name in ("flax", "ml_dtypes"):
        module = sys.modules.get(name)
        versions.append(getattr(module, "__version__", None))
    return repr((_code_hash(), versions, client.platform, client.platform_version, devices,
                 _cpu_flags(), env, settings))


@functools.lru_cache(maxsize=256)
def _file_hash(filename: str) -> str:
    try:
        return hashlib.sha256(Path(filename).read_bytes()).hexdigest()
    except OSError:
        return "?"


def _describe_code(code) -> str:
    consts = [_describe_code(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return f"{code.co_firstlineno}:{code.co_code.hex()}:{consts}:{code.co_names}"


_CONTEXT_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision",
                     "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion",
                     "jax_default_prng_impl")


def _settings() -> tuple:
    """jax's settings that a `with` block may change between calls (the in-memory table keys
    on them; a key on disk on all of them)."""
    return tuple(getattr(jax.config, name, None) for name in _CONTEXT_SETTINGS)


def _user_classes(value) -> list[str]:
    """Source hashes of the classes in a flax graph (``value``) defined outside jaxkv, flax
    and jax: a model class of the user's own, whose code the key must cover."""
    out = []
    for node in getattr(value, "nodes", ()) or ():
        cls = getattr(node, "type", None)
        module = getattr(cls, "__module__", "") or ""
        if isinstance(cls, type) and not module.startswith(("jaxkv", "flax", "jax")):
            try:
                out.append(f"{module}.{cls.__qualname__}:{_file_hash(inspect.getfile(cls))}")
            except (TypeError, OSError):
                out.append(f"{module}.{cls.__qualname__}:?")
    return sorted(set(out))


def _binds_arrays(fn) -> bool:
    """Whether a partial's arguments or the function's closure hold an array."""
    bound = []
    while isinstance(fn, functools.partial):
        bound += [fn.args, fn.keywords]
        fn = fn.func
    bound += [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
    return any(isinstance(x, (np.ndarray, jax.Array)) for x in jax.tree.leaves(bound))


def _describe_fn(fn, jit_kwargs: dict) -> str:
    """The function (its file's hash, its bytecode, what its closure holds), what a partial
    binds, and the jit options, as text."""
    parts = []
    while isinstance(fn, functools.partial):
        parts.append(repr((fn.args, sorted(fn.keywords.items()))))
        parts += [c for a in fn.args for c in _user_classes(a)]
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = [c.cell_contents for c in fn.__closure__ or ()]
        parts.append(f"{_file_hash(code.co_filename)}:{_describe_code(code)}:{cells!r}")
    else:  # not a Python function (a jitted one, a ufunc): by name and repr
        parts.append(repr(fn))
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    return f"{name}{parts}{sorted(jit_kwargs.items())}"


class _Traced(Exception):
    """Called inside another program's trace: nothing to store."""


def _on_default_device(x) -> bool:
    """A host array, or a device array on the default device alone: one executable takes both
    (it places host inputs where its inputs live), so a program fed host arrays and one fed the
    previous program's outputs (a decode loop's continuation) share it, where jax.jit compiles
    one for each (it keys on whether an argument is committed)."""
    if not isinstance(x, jax.Array):
        return True
    s = x.sharding
    return isinstance(s, jax.sharding.SingleDeviceSharding) and s.device_set == _default() \
        and s.memory_kind in (None, "device")


@functools.lru_cache(maxsize=1)
def _default() -> set:
    return {jax.devices()[0]}


def _leaf(x):
    """A leaf's part of the call's signature (in memory)."""
    if isinstance(x, jax.core.Tracer):
        raise _Traced
    if isinstance(x, (np.ndarray, np.generic)):
        return x.shape, x.dtype, False
    if isinstance(x, jax.Array):
        if _on_default_device(x):
            return x.shape, x.dtype, x.aval.weak_type
        return x.aval, x.sharding
    return type(x)


def _leaf_text(x) -> str:
    """The same, as reproducible text (devices by id)."""
    if isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array)
                                                     and _on_default_device(x)):
        weak = isinstance(x, jax.Array) and x.aval.weak_type
        return f"{x.shape}{np.dtype(x.dtype).name}~{weak}"
    if isinstance(x, jax.Array):
        s = x.sharding
        mesh = getattr(s, "mesh", None)
        ids = [d.id for d in mesh.devices.flat] if mesh is not None and hasattr(mesh, "devices") \
            else sorted(d.id for d in s.device_set)
        return f"{x.aval.str_short(short_dtypes=False)}~{x.aval.weak_type}@{s!r}{ids}"
    return type(x).__name__


class StoredJit:
    """`jax.jit(fn, **jit_kwargs)` whose executables are kept in the program store (when one is
    in use, see `use_program_store`); otherwise exactly the jitted function. Attributes other
    than calling (``lower``, ``trace``, ...) are the jitted function's."""

    def __init__(self, fn, **jit_kwargs):
        self.jitted = jax.jit(fn, **jit_kwargs)
        static = jit_kwargs.get("static_argnums", ())
        self._static = frozenset((static,) if isinstance(static, int) else static)
        # (a bound array is shortened in a repr: two such programs could share a key)
        self._storable = "static_argnames" not in jit_kwargs and not _binds_arrays(fn)
        self._name = _describe_fn(fn, jit_kwargs)
        self._table: dict = {}  # signature -> Compiled, or None: run through the jitted
        # the last first argument (the params), weakly held, and its part of the signature
        self._memo: tuple = (None, None)
        functools.update_wrapper(self, fn, updated=())

    def __getattr__(self, name):
        return getattr(self.jitted, name)

    def __call__(self, *args, **kwargs):
        if _folder[0] is None or kwargs or not self._storable:
            return self.jitted(*args, **kwargs)
        try:
            compiled = self.executable(*args)
        except _Traced:
            compiled = None
        if compiled is None:
            return self.jitted(*args)
        return compiled(*self._dynamic(args))

    def _dynamic(self, args):
        return [a for i, a in enumerate(args) if i not in self._static] if self._static \
            else args

    def _signature(self, args) -> tuple:
        parts = [_settings()]
        for i, a in enumerate(args):
            if i in self._static:
                parts.append(("static", a))
            elif i == 0 and (memo := self._memo)[0] is not None and memo[0]() is a:
                parts.append(memo[1])
            else:
                leaves, tree = jax.tree.flatten(a)
                part = (tree, tuple(map(_leaf, leaves)))
                if i == 0:
                    try:  # (weakly: old params must not outlive an update)
                        self._memo = (weakref.ref(a), part)
                    except TypeError:
                        self._memo = (None, None)
                parts.append(part)
        return tuple(parts)

    def executable(self, *args):
        """The compiled program for these arguments: from memory, from the store, or compiled
        (and stored). None when the program cannot be stored (then call the jitted)."""
        key = self._signature(args)
        if key in self._table:
            return self._table[key]
        found = self._table[key] = self._load_or_compile(args)
        return found

    def _digest(self, args) -> str | None:
        parts = [_environment(), self._name]
        for i, a in enumerate(args):
            if i in self._static:
                parts.append(f"static {a!r}")
            else:
                leaves, tree = jax.tree.flatten(a)
                parts.append(f"{tree}|{'|'.join(map(_leaf_text, leaves))}")
        text = "\n".join(parts)
        if " at 0x" in text or "object at" in text:
            return None  # not reproducible in another process: jax.jit then
        return hashlib.sha256(text.encode()).hexdigest()

    def _load_or_compile(self, args):
        folder = _folder[0]
        digest = None if folder is None else self._digest(args)
        if digest is None:
            _log.debug("program store: %s has no reproducible key: not stored", self._name[:80])
            return None
        path = folder / f"{digest}.exe"
        if path.is_file():
            try:
                compiled = _read(path)
                with contextlib.suppress(OSError):  # recently used: evicted last
                    os.utime(path)
                jax.monitoring.record_event(LOADED_EVENT)
                return compiled
            except Exception as e:  # noqa: BLE001 - a stale or torn file: compile anew
                _log.warning("program store: %s did not load (%s: %s); compiling it again",
                             path.name, type(e).__name__, e)
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        with _jax_cache_bypassed():  # (one jax loaded from its cache would not store whole)
            compiled = self.jitted.lower(*args).compile()
        try:
            blob = pickle.dumps((*serialize_executable.serialize(compiled), _devices(compiled)))
        except Exception as e:  # noqa: BLE001 - e.g. constants closed over: memory only
            _log.debug("program store: %s not stored (%s)", self._name[:80], e)
            return compiled
        _write(path, blob)
        return compiled


_bypass_lock = threading.Lock()
_bypass: list = [0, True]  # compiles under way that bypass jax's cache; its setting before


@contextlib.contextmanager
def _jax_cache_bypassed():
    """jax's persistent cache neither read nor written meanwhile: an executable XLA:CPU loads
    from a file does not serialize whole (it runs, but its copy fails with "Function ... not
    found"), so a program for the store is always compiled afresh. (Process-wide: another
    thread's compile meanwhile just compiles too.)"""
    with _bypass_lock:
        if _bypass[0] == 0:
            _bypass[1] = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
        _bypass[0] += 1
    try:
        yield
    finally:
        with _bypass_lock:
            _bypass[0] -= 1
            if _bypass[0] == 0:
                jax.config.update("jax_enable_compilation_cache", _bypass[1])
                compilation_cache.reset_cache()


def _devices(compiled) -> list[int]:
    """The ids of the devices a compiled program runs on, in its order (a mesh's, flattened)."""
    shardings = jax.tree.leaves(compiled.input_shardings)
    for s in shardings:
        mesh = getattr(s, "mesh", None)
        if mesh is not None and hasattr(mesh, "devices"):
            return [d.id for d in mesh.devices.flat]
    return sorted(d.id for d in shardings[0].device_set) if shardings else \
        [jax.devices()[0].id]


def _read(path: Path):
    with open(path, "rb") as f:
        blob, in_tree, out_tree, ids = pickle.load(f)
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for i in ids]
    try:
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                         execution_devices=devices)
    except Exception as e:
        if "No FFI handler registered" not in str(e):
            raise
    # It calls jaxkv's CPU kernels, which register their targets with XLA when first traced
    # (and this program was not): register them, then load it.
    from pallas_kernels.cpu_library import library

    library()
    return serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                     execution_devices=devices)


def stored_jit(fn=None, **jit_kwargs):
    """`jax.jit` with the program store: ``stored_jit(f, donate_argnums=(1,))`` or as a
    decorator, ``@stored_jit`` / ``@functools.partial(stored_jit, static_argnums=(2,))``."""
    if fn is None:
        return functools.partial(stored_jit, **jit_kwargs)
    return StoredJit(fn, **jit_kwargs)


def _write(path: Path, blob: bytes) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(blob)
        os.replace(tmp, path)  # whole or absent, whoever else writes the same key
    except OSError as e:
        _log.warning("program store: cannot write %s: %s", path, e)
        tmp.unlink(missing_ok=True)
        return
    with _write_lock:
        _evict(path.parent)


def _evict(folder: Path) -> None:
    """Removes the least recently used files while the folder holds more than MAX_BYTES."""
    try:
        files = [(p.stat().st_mtime, p.stat().st_size, p) for p in folder.glob("*.exe")]
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= MAX_BYTES:
            break
        p.unlink(missing_ok=True)
        total -= size
