"""Runs tests/multidevice (tensor and data parallelism on 8 virtual CPU devices) in a separate
process, so that this process keeps its single device."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_multidevice_suite_passes():
    env = dict(os.environ, JAXKV_MULTIDEVICE="1", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(HERE / "multidevice")], env=env, capture_output=True, text=True,
                         cwd=HERE.parent, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
