"""The layering of docs/architecture.md, checked on the source so it cannot grow back: imports
point down and form no cycle, the kernels import nothing of jaxkv, host bookkeeping imports no
jax, one module writes the KV state, and no module reaches into another's privates. (Files are
split by responsibility, not by a line count: STYLE.md.)"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host  # no engine: `make test-fast`

ROOT = Path(__file__).resolve().parent.parent

# Rank of each layer: a module may import its own layer and layers of a lower rank only.
# The `jaxkv` package itself (its public names) is for the applications above the engine.
RANK = {
    "pallas_kernels": 0, "jaxkv.errors": 0, "jaxkv.config": 0, "jaxkv.cli_settings": 0,
    "jaxkv.config_checks": 0, "jaxkv.config_speculative": 0, "jaxkv.spec.methods": 0,
    "jaxkv.model": 1, "jaxkv.sampling_params": 1, "jaxkv.structured": 1,
    "jaxkv.kv": 2, "jaxkv.attention": 2, "jaxkv.sharding": 2, "jaxkv.distributed": 2,
    "jaxkv.cache": 2,
    "jaxkv.runtime": 3,
    "jaxkv.engine": 4, "jaxkv.spec": 4,
    "jaxkv.disagg": 5,
    "jaxkv.engine.llm": 5.5,  # the facade: builds colocated, replicated or disaggregated engines
    "jaxkv": 6, "jaxkv.server": 6, "jaxkv.bench": 6, "jaxkv.memory_cli": 6,
    "jaxkv.cli": 7,
}
HOST_ONLY = ("jaxkv.config", "jaxkv.config_checks", "jaxkv.config_speculative",
             "jaxkv.cli_settings", "jaxkv.cache.allocator", "jaxkv.cache.prefix",
             "jaxkv.cache.radix", "jaxkv.cache.host_radix", "jaxkv.cache.memory",
             "jaxkv.engine.scheduler", "jaxkv.engine.plan", "jaxkv.engine.request",
             "jaxkv.engine.connector", "jaxkv.spec.speculator", "jaxkv.spec.ngram",
             "jaxkv.spec.self_draft", "jaxkv.spec.methods",
             "jaxkv.disagg.connector", "jaxkv.sampling_params", "jaxkv.structured.params",
             "jaxkv.structured.grammar")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    return None


def _sources():
    for folder in ("jaxkv", "pallas_kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno


def test_imports_point_down():
    up = []
    for module, path in _sources():
        mine = _layer(module)
        assert mine is not None, f"{module} belongs to no layer: add it to RANK"
        for name, line in _imports(path):
            other = _layer(name)
            if other is not None and other != mine and RANK[other] > RANK[mine]:
                up.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {name} ({other})")
    assert not up, "\n".join(up)


def _graph() -> dict[str, set[str]]:
    """Module -> the modules of this repository it imports, anywhere in the file (inside
    functions and under TYPE_CHECKING too: a lazy import hides a cycle, it does not remove
    it). ``from package import module`` is an edge to the module."""
    modules = dict(_sources())
    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                if subs:
                    edges |= subs
                elif node.module in modules:
                    edges.add(node.module)
        graph[module] = edges - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = _graph()
    # the package's own __init__ re-exports its modules; a module importing the package
    # facade (`import jaxkv`) is an application above it, checked by the layers above
    cycles = [c for c in _cycles({m: e - {"jaxkv", "pallas_kernels"} for m, e in graph.items()})]
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_a_cycle_would_be_caught():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _state_writers() -> dict[str, list[int]]:
    """Files (and lines) that assign an attribute named ``state`` or ``_state``."""
    found = {}
    for _, path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            names = [x.value if isinstance(x, ast.Starred) else x for t in targets
                     for x in (t.elts if isinstance(t, ast.Tuple) else [t])]
            if any(isinstance(x, ast.Attribute) and x.attr in ("state", "_state")
                   for x in names):
                found.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    return found


def test_one_writer_of_the_kv_state():
    """The engine's KV state is assigned in `ModelRunner` only (programs run through its
    `run`/`update_state`); a draft model's own pool, in its class."""
    writers = _state_writers()
    assert set(writers) == {"jaxkv/engine/runner.py", "jaxkv/spec/draft_model.py"}, writers


def test_kernels_import_no_jaxkv_and_nothing_imports_jax_internals():
    bad = []
    for module, path in _sources():
        for name, line in _imports(path):
            if name.startswith("jax._src") or (module.startswith("pallas_kernels")
                                                and name.split(".")[0] == "jaxkv"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_a_reach_into_jax_internals_would_be_caught(tmp_path):
    """The scan above sees imports anywhere in a file, also inside functions."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from jax._src import core\n    return core\n")
    assert [n for n, _ in _imports(src)] == ["jax._src"]


def test_host_bookkeeping_imports_no_jax_or_numpy():
    """Imported with an empty `jaxkv` package standing in (its __init__ imports the engine)."""
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('jaxkv')\n"
        f"pkg.__path__ = [{str(ROOT / 'jaxkv')!r}]\n"
        "sys.modules['jaxkv'] = pkg\n"
        f"for name in {HOST_ONLY!r}:\n"
        "    __import__(name)\n"
        "loaded = {'jax', 'jaxlib', 'flax', 'numpy'} & set(sys.modules)\n"
        "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_private_access_across_modules():
    """ruff's SLF001 (pyproject.toml names the test files that may)."""
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "SLF001",
                           "--no-cache", "jaxkv", "pallas_kernels"],
                          capture_output=True, text=True, cwd=ROOT)
    if "No module named ruff" in ruff.stderr:
        pytest.fail("ruff is not installed: pip install -e .[test]")
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr
