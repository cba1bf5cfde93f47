"""``make test-aot``: compile kernels and engine steps for real chips on a CPU machine.

test_tpu.py and test_gpu.py each run in a process of their own (the Makefile starts them):
libtpu's compile-only topology and the CUDA plugin's Triton pipeline are loaded by the tools in
tests/tools, which need the ``aot`` extra. Each test adds a row to a table printed at the end
of the run and written to out/aot-<target>.md.
"""

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))  # tests/: the tools package

import pytest  # noqa: E402

_TABLES: dict[str, tuple[list[str], list[list[str]]]] = {}


@pytest.fixture(scope="session")
def table():
    """``table(title, columns, row)`` records one row of a result table."""
    def add(title: str, columns: list[str], row: list) -> None:
        _TABLES.setdefault(title, (columns, []))[1].append([str(x) for x in row])

    return add


def _markdown(title, columns, rows) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter):
    if not _TABLES:
        return
    text = "\n".join(_markdown(t, c, r) for t, (c, r) in _TABLES.items())
    terminalreporter.write("\n" + text)
    target = os.environ.get("JAXKV_AOT_TARGET", "aot")
    out = TESTS.parent / "out"
    out.mkdir(exist_ok=True)
    (out / f"aot-{target}.md").write_text(text)
    terminalreporter.write(f"\n(also written to out/aot-{target}.md)\n")
