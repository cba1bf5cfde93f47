"""TPU without a TPU: compile for v5e / v6e against libtpu's compile-only topology.

``compile_for(chip, fn, *args)`` runs the real XLA:TPU + Mosaic compile of ``fn`` for one chip
of a ``chip:2x2`` topology (inputs: ``ShapeDtypeStruct``s, given that chip's sharding by
``abstract``) and returns a ``TpuReport``: XLA's memory analysis, the VMEM each Mosaic kernel
reserves, and every ``copy`` XLA inserted, with its size. Import this module in a process of
its own: libtpu must not load into a process that also runs CPU computations as its default.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the topology needs no TPU backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

CHIPS = ("v5e", "v6e")


@dataclasses.dataclass(frozen=True)
class Copy:
    shape: str  # e.g. "bf16[16,8,2048,16,128]"
    nbytes: int


@dataclasses.dataclass(frozen=True)
class TpuReport:
    chip: str
    device_kind: str
    temp_bytes: int  # XLA temporaries (a copy of an operand shows up here)
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse donated inputs
    vmem_bytes: tuple[int, ...]  # scoped VMEM each Mosaic kernel reserves
    copies: tuple[Copy, ...]  # copy instructions in the optimized HLO
    seconds: float

    def largest_copy(self) -> int:
        return max((c.nbytes for c in self.copies), default=0)


@functools.cache
def device(chip: str):
    """One device of a compile-only ``chip:2x2`` topology."""
    if chip not in CHIPS:
        raise ValueError(f"chip must be one of {CHIPS}, got {chip!r}")
    topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{chip}:2x2")
    return topo.devices[0]


def abstract(chip: str, shape, dtype) -> jax.ShapeDtypeStruct:
    """An input of ``shape`` and ``dtype`` placed on ``chip``'s device."""
    sharding = NamedSharding(Mesh([device(chip)], ("x",)), P())
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def on_chip(chip: str, tree):
    """Every array (or ShapeDtypeStruct) leaf of ``tree`` as an abstract input on ``chip``."""
    return jax.tree.map(lambda x: abstract(chip, x.shape, x.dtype), tree)


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8}
_COPY = re.compile(r"= ((\w+)\[([\d,]*)\])\{[^}]*\} copy\(")
_SCOPED = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')
_VMEM_SIZE = re.compile(r'"memory_space":"1","offset":"\d+","size":"(\d+)"')


def _copies(hlo: str) -> tuple[Copy, ...]:
    out = []
    for m in _COPY.finditer(hlo):
        dims = [int(x) for x in m.group(3).split(",") if x]
        out.append(Copy(m.group(1), int(np.prod(dims, dtype=np.int64))
                        * _DTYPE_BYTES.get(m.group(2), 4)))
    return tuple(out)


def _kernel_vmem(hlo: str) -> tuple[int, ...]:
    """Scoped VMEM (memory space 1) reserved by each Mosaic kernel (tpu_custom_call)."""
    out = []
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            m = _SCOPED.search(line)
            out.append(sum(int(x) for x in _VMEM_SIZE.findall(m.group(1))) if m else 0)
    return tuple(out)


def compile_for(chip: str, fn, *args, **jit_kwargs) -> TpuReport:
    """Compiles ``fn`` (a jitted function as it is, so its donations hold, or else
    ``jax.jit(fn, **jit_kwargs)``) for one ``chip`` and reports what it found."""
    dev = device(chip)
    jitted = fn if hasattr(fn, "trace") and not jit_kwargs else jax.jit(fn, **jit_kwargs)
    t0 = time.perf_counter()
    with jax.default_device(dev):
        compiled = jitted.trace(*args).lower().compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    return TpuReport(
        chip=chip, device_kind=dev.device_kind, temp_bytes=mem.temp_size_in_bytes,
        argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes,
        vmem_bytes=_kernel_vmem(hlo), copies=_copies(hlo),
        seconds=seconds)
