"""The CI-sized soak: `jaxkv bench soak` with a small pool and budget, everything accounted
for."""

import re

from jaxkv.bench.cli import main as bench


def test_short_soak_loses_nothing_and_leaks_nothing(capsys):
    argv = ["--requests", "100", "--num-pages", "12", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "32", "--window", "50", "--verify", "5", "--no-warmup",
            "--abort-rate", "0.1", "--bad-rate", "0.05", "--n2-rate", "0.2"]
    assert bench(["soak", *argv]) == 0
    out = capsys.readouterr().out
    done, completed, aborted, rejected = map(int, re.search(
        r"requests: (\d+) submitted = (\d+) completed \+ (\d+) aborted \+ (\d+) rejected",
        out).groups())
    assert done == 100 == completed + aborted + rejected and aborted > 0 and rejected > 0
    assert int(re.search(r"preemptions (\d+)", out).group(1)) > 0
    assert "greedy requests re-run alone: 5, tokens differing: 0" in out
    assert re.search(r"page leaks: 0 \(pages held by requests at the end: 0", out)
    assert "result: OK" in out
