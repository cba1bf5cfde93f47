"""Prints, on one line, the `aot` extra of pyproject.toml matched to the jax installed here, for
the Makefile to install into .venv/aot-site: the CUDA plugin at jax's own version, libtpu at
the version jax's `tpu` extra names, ptxas as pinned; jax itself is left out (it is already
installed). So a newer jax on a clean clone gets its own compilers, not the pinned ones.

    python tests/tools/aot_requirements.py
"""

import re
import sys
from importlib import metadata
from pathlib import Path

text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
found = re.search(r"^aot = \[(.*?)\]", text, re.S | re.M)
if found is None:
    sys.exit("no `aot` optional-dependency group in pyproject.toml")
jax_version = metadata.version("jax")
tpu_extra = [r.split(";")[0].strip() for r in metadata.requires("jax") or []
             if re.search(r"""extra\s*==\s*["']tpu["']""", r) and r.startswith("libtpu")]
out = []
for req in re.findall(r'"([^"]+)"', found.group(1)):
    name = re.split(r"[=<>!~\[ ]", req)[0]
    if name == "jax":
        continue
    if name in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        req = f"{name}=={jax_version}"
    elif name == "libtpu" and tpu_extra:
        req = tpu_extra[0].replace(" ", "")
    out.append(req)
print(" ".join(out))
