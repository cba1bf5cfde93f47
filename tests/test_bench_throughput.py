"""`jaxkv bench throughput` runs end to end on a tiny model (numbers are not checked)."""

import pytest

from jaxkv.bench.cli import main as bench


@pytest.mark.slow  # ~45 s on 2 cores (make test time)
def test_bench_throughput_small_run(capsys, tmp_path):
    out_png = tmp_path / "tp.png"
    argv = ["--layers", "1", "--hidden", "64", "--prompts", "3", "--new-tokens", "4",
            "--hf-batch", "3", "--out", str(out_png)]
    assert bench(["throughput", *argv]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert "jaxkv" in rows and "transformers" in rows  # both engines in the table
    assert "contiguous" in out and "paged" in out and "held every step: yes" in out
    assert "reproduce: jaxkv bench throughput --prompts 3" in out
    assert out_png.stat().st_size > 0
