"""sm_90 without a GPU: lower a function for CUDA, compile each Pallas Triton kernel in it to PTX
with the CUDA plugin's Triton pipeline, and read registers, spills and shared memory from
``ptxas -v``.

Usage: ``kernel_reports(fn, *abstract_args)`` -> one ``KernelReport`` per Triton kernel.
The process must not have initialized a GPU backend; ``setup()`` (called on import) sets the
environment the plugin needs to load on a machine without CUDA drivers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
from jax._src.lib import triton  # noqa: E402  (the plugin's Triton -> PTX pipeline)
from jax._src.lib.mlir import ir  # noqa: E402

ARCH = "9.0"  # H100 / H200 (sm_90; ptxas targets sm_90a, which adds wgmma)
SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per block on sm_90


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One ``__gpu$xla.gpu.triton`` custom call of a lowered module."""

    name: str
    ir: bytes  # Triton MLIR bytecode
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class KernelReport:
    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_bytes: int
    smem_bytes: int  # dynamic shared memory the Triton pipeline reserved
    seconds: float  # Triton + ptxas compile time

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def problems(self, *, allow_spills: bool = False) -> list[str]:
        """What makes this kernel unfit for sm_90 (empty: fit)."""
        out = []
        if self.smem_bytes > SMEM_LIMIT:
            out.append(f"shared memory {self.smem_bytes} B > {SMEM_LIMIT} B")
        if self.spills and not allow_spills:
            out.append(f"spills {self.spill_stores} B stored / {self.spill_loads} B loaded")
        return out


def ptxas_path() -> Path:
    """ptxas from the nvidia-cuda-nvcc-cu12 wheel (the `aot` extra)."""
    import nvidia.cuda_nvcc

    for base in nvidia.cuda_nvcc.__path__:
        path = Path(base) / "bin" / "ptxas"
        if path.exists():
            return path
    raise FileNotFoundError("ptxas not found: pip install -e '.[aot]'")


def _walk(op, out: list[TritonCall]) -> None:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                if child.operation.name == "stablehlo.custom_call":
                    target = ir.StringAttr(child.attributes["call_target_name"]).value
                    if target == "__gpu$xla.gpu.triton":
                        cfg = ir.DictAttr(child.attributes["mhlo.backend_config"])
                        num = lambda key, cfg=cfg: ir.IntegerAttr(cfg[key]).value  # noqa: E731
                        out.append(TritonCall(
                            name=ir.StringAttr(cfg["name"]).value,
                            ir=ir.StringAttr(cfg["ir"]).value_bytes,
                            num_warps=num("num_warps"), num_stages=num("num_stages"),
                            grid=(num("grid_x"), num("grid_y"), num("grid_z"))))
                _walk(child.operation, out)


def triton_calls(fn, *args, **jit_kwargs) -> list[TritonCall]:
    """The Triton kernels of ``fn(*args)`` lowered for CUDA (args may be ShapeDtypeStructs)."""
    lowered = jax.jit(fn, **jit_kwargs).trace(*args).lower(lowering_platforms=("cuda",))
    calls: list[TritonCall] = []
    _walk(lowered.compiler_ir("stablehlo").operation, calls)
    return calls


_PTXAS_LINE = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> dict:
    """Registers, spill bytes and stack frame from ``ptxas -v`` output (one entry function)."""
    regs = _PTXAS_LINE.search(text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", text)
    if regs is None or frame is None:
        raise RuntimeError(f"unexpected ptxas output:\n{text}")
    return dict(registers=int(regs.group(1)), stack_bytes=int(frame.group(1)),
                spill_stores=int(frame.group(2)), spill_loads=int(frame.group(3)))


def compile_call(call: TritonCall, *, arch: str = ARCH) -> KernelReport:
    """Triton IR -> PTX (the CUDA plugin's pipeline) -> SASS (ptxas) for one kernel."""
    t0 = time.perf_counter()
    result = triton.compile("cuda", call.ir, arch, num_warps=call.num_warps, num_ctas=1,
                            num_stages=call.num_stages)
    sm = "sm_" + arch.replace(".", "") + ("a" if arch == "9.0" else "")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(result.asm)
        proc = subprocess.run([str(ptxas_path()), f"-arch={sm}", "-v", str(ptx), "-o",
                               str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed for {call.name}:\n{proc.stderr}")
    stats = parse_ptxas(proc.stderr + proc.stdout)
    return KernelReport(name=call.name, num_warps=call.num_warps, num_stages=call.num_stages,
                        grid=call.grid, smem_bytes=int(result.smem_bytes),
                        seconds=time.perf_counter() - t0, **stats)


def kernel_reports(fn, *args, **jit_kwargs) -> list[KernelReport]:
    """Every Triton kernel of ``fn(*args)``, compiled for sm_90 and measured by ptxas."""
    calls = triton_calls(fn, *args, **jit_kwargs)
    if not calls:
        raise RuntimeError("no Triton kernel in the lowered function")
    return [compile_call(c) for c in calls]
