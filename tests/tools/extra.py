"""Prints the requirements of one optional-dependency group of pyproject.toml on one line, so
the Makefile can install them without repeating the pins.

    python tests/tools/extra.py aot [--skip jax]    (--skip: leave out that package)
"""

import argparse
import re
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("group")
p.add_argument("--skip", action="append", default=[])
args = p.parse_args()
text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
found = re.search(rf"^{re.escape(args.group)} = \[(.*?)\]", text, re.S | re.M)
if found is None:
    raise SystemExit(f"no optional dependency group {args.group!r} in pyproject.toml")
reqs = re.findall(r'"([^"]+)"', found.group(1))
print(" ".join(r for r in reqs if re.split(r"[=<>!~\[ ]", r)[0] not in args.skip))
