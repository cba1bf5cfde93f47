"""`jaxkv bench`'s plumbing, without running a benchmark: every subcommand is registered with
--json, its reproduce line parses back to the same arguments, engine settings map onto
keyword arguments, and no benchmark code edits sys.path or imports the tests."""

import ast
import re
import shlex
from pathlib import Path

import pytest

from jaxkv.bench import cli, common
from jaxkv.cli import build_parser

pytestmark = pytest.mark.host  # no engine: `make test-fast`

ROOT = Path(__file__).resolve().parent.parent


def _parse(argv):
    return build_parser().parse_args(argv)


def test_every_subcommand_is_registered_with_json(capsys):
    with pytest.raises(SystemExit):
        _parse(["bench", "--help"])
    help_text = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert re.search(rf"^\s+{re.escape(name)}\b", help_text, re.M), name
        args = _parse(["bench", name, "--json", "out.json"])
        assert args.json == "out.json" and args.bench == name


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_reproduce_line_parses_back_to_the_same_arguments(name):
    args = _parse(["bench", name])
    parser = args.func.args[2]
    line = common.reproduce(name, parser, args)
    words = shlex.split(line)
    assert words[:3] == ["jaxkv", "bench", name]
    again = _parse(words[1:])

    def options(a):
        return {k: v for k, v in vars(a).items() if k != "func"}

    assert options(again) == options(args)


def test_engine_settings_become_keyword_arguments():
    args = _parse(["bench", "host-tier", "--page-size", "8", "--kv-cache-dtype", "int8"])
    kw = common.engine_kwargs(args, num_pages=100, max_model_len=64, page_size=32)
    assert kw == dict(max_num_seqs=4, page_size=8, max_num_batched_tokens=512,
                      kv_cache_dtype="int8", num_pages=100, max_model_len=64)
    args = _parse(["bench", "throughput", "--enable-prefix-caching"])
    assert common.engine_kwargs(args)["enable_prefix_caching"] is True
    assert "--enable-prefix-caching" in common.reproduce("throughput", args.func.args[2], args)


def test_no_sys_path_edits_and_no_imports_from_tests():
    for folder in ("jaxkv", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert "sys.path" not in text, path
            assert not re.search(r"^\s*(from|import) (tests|tools|script_loader)\b", text,
                                 re.M), path


def test_the_command_imports_only_the_benchmark_it_runs():
    """`jaxkv` builds its parser without importing the benchmarks: a subcommand's module is
    imported when that subcommand is parsed (or its help printed)."""
    import subprocess
    import sys

    code = ("import sys\nfrom jaxkv.cli import build_parser\nparser = build_parser()\n"
            "before = {m for m in sys.modules if m.startswith('jaxkv.bench.')}\n"
            "parser.parse_args(['bench', 'kv-capacity'])\n"
            "after = {m for m in sys.modules if m.startswith('jaxkv.bench.')}\n"
            "print(sorted(before)); print(sorted(after - before))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    before, loaded = (ast.literal_eval(line) for line in run.stdout.splitlines()[-2:])
    assert before == ["jaxkv.bench.cli", "jaxkv.bench.common"]
    assert "jaxkv.bench.kv_capacity" in loaded
    others = {f"jaxkv.bench.{m}" for m, _ in cli.COMMANDS.values()} - {"jaxkv.bench.kv_capacity"}
    assert not others & set(loaded), loaded
