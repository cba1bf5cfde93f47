"""Tests on 8 virtual CPU devices. They run in their own process (tests/test_scaleout.py
starts it), because the device count is fixed when jax first initializes its backend."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: shared helpers

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
