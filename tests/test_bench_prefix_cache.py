"""`jaxkv bench prefix-cache` runs end to end on a tiny model (timings are not checked)."""

import re

from jaxkv.bench.cli import main as bench


def test_bench_prefix_cache_small_run(capsys, tmp_path):
    argv = ["--layers", "1", "--hidden", "64", "--prefix", "32", "--suffix", "8",
            "--requests", "3", "--max-tokens", "2", "--convs", "2", "--turns", "2",
            "--user", "8", "--reply", "4", "--out", str(tmp_path / "p.png")]
    assert bench(["prefix-cache", *argv]) == 0
    out = capsys.readouterr().out
    assert "caching on" in out and "caching off" in out
    assert "reproduce: jaxkv bench prefix-cache --layers 1 --hidden 64" in out
    # (a): hit rate column of each mode; with caching on it reaches the theoretical maximum.
    rates = {m: float(r) for m, r in re.findall(r"^caching (on|off) .* ([\d.]+)% +[\d.]+%$",
                                                 out, re.M)}
    assert rates["on"] > 0 and rates["off"] == 0
    assert "theoretical max with caching on: True (64 / 64)" in out
    # (b): overall hit rates, and every cacheable token reused.
    on, off = re.search(r"all turns: hit rate on ([\d.]+)% .* off ([\d.]+)%", out).groups()
    assert float(on) > 0 and float(off) == 0
    assert out.count("theoretical max with caching on: True") == 2
    assert (tmp_path / "p.png").exists()
