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
    run = subprocess.run([sys.executable, "scripts/bench_scaleout.py", "--devices", "4",
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
    assert "reproduce: python scripts/bench_scaleout.py" in run.stdout
