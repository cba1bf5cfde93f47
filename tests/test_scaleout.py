"""Runs tests/multidevice (tensor and data parallelism on 8 virtual CPU devices) in a separate
process, so that this process keeps its single device."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _multidevice(*args):
    env = dict(os.environ, JAXKV_MULTIDEVICE="1", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *args, str(HERE / "multidevice")], env=env, capture_output=True,
                         text=True, cwd=HERE.parent, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_multidevice_suite_passes():
    _multidevice()  # the representative part (the project's -m 'not slow')


@pytest.mark.slow
def test_multidevice_slow_suite_passes():
    _multidevice("-m", "slow")


def test_bench_scaleout_small_run():
    run = subprocess.run([sys.executable, "-m", "jaxkv.bench", "scaleout", "--devices", "4",
                          "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                          "--rows", "2"], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, cwd=HERE.parent, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {int(m[0]): m for m in (line.split() for line in run.stdout.splitlines())
            if m and m[0].isdigit() and len(m) == 8}
    # KV bytes per token per device: 2 (K, V) x 1 layer x kv heads on the device x 16 x 4 B.
    assert {tp: (int(r[1]), int(r[4].replace(",", ""))) for tp, r in rows.items()} == \
        {1: (1, 256), 2: (1, 128), 4: (2, 128)}
    # Llama-3-70B: 327,680 B/token (80 layers x 8 kv heads x 128 x 2 B x 2) over 16 chips
    # with every kv head stored twice, and over 8 GPUs once: 40,960 B either way.
    assert run.stdout.count(" 40,960 ") == 2
    assert "reproduce: jaxkv bench scaleout --devices 4 --layers 1" in run.stdout


def test_bench_disagg_small_run():
    """Disaggregated serving on 1 + 2 virtual devices: the tokens equal colocated serving's
    and the second request moves only the pages past the shared prefix (whole pages of it are
    in the decode side's prefix cache by then)."""
    run = subprocess.run([sys.executable, "-m", "jaxkv.bench", "disagg", "--requests", "2",
                          "--shared", "32", "--unique", "8", "--max-tokens", "3",
                          "--decode-tp", "2", "--pages", "1,4", "--repeats", "1"],
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                         text=True, cwd=HERE.parent, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [ln.strip("|").split("|") for ln in run.stdout.splitlines() if ln.startswith("| 2 ")]
    cells = [c.strip() for c in rows[0]]
    # 2 prompts of 40 tokens: 3 pages of 16 each; the second finds the 2 whole pages of the
    # shared prefix in the decode side's cache if the first has landed by then (it usually
    # has: one request arrives per step), else moves all 3.
    moved, reused = int(cells[3]), int(cells[4])
    assert cells[:3] == ["2", "2/2", "6"] and (moved, reused) in ((4, 2), (6, 0)), cells
    # bytes: pages x 16 tokens x 4 layers x 2 kv heads x (2 x 32 x 4 B)
    assert cells[5] == f"{moved * 16 * 4 * 2 * 256:,}"
    assert "reproduce: jaxkv bench disagg --model tiny --requests 2 --shared 32" in run.stdout
