"""`jaxkv bench spec-roofline`: the estimate's parts against numbers worked out by hand from the
presets' parameter counts and the chips' spec sheets."""

import json
import types

import pytest

from jaxkv.bench import spec_roofline
from jaxkv.bench.sim.step_models import DATA
from jaxkv.cache.memory import PRESETS

pytestmark = pytest.mark.host  # no engine: `make test-fast`

H200_BW, V5E_BW = 4.8e12, 819e9


@pytest.fixture(scope="module")
def rows():
    args = types.SimpleNamespace(spec_json=None, batches=[1, 16], context=512, data=None)
    return spec_roofline.run(args)["rows"]


def _row(rows, **want):
    (row,) = [r for r in rows if all(r[k] == v for k, v in want.items())]
    return row


def test_a_decode_step_reads_the_weights_once(rows):
    # Llama-3-8B bf16: every weight but the input embedding (gathered by row) per step
    s = PRESETS["llama-3-8b"]
    weights = 2 * (s.num_params() - s.vocab_size * s.hidden_size)
    got = _row(rows, chip="h200", method="ngram", workload="chat", batch=1)["decode_ms"]
    assert got == pytest.approx(1e3 * weights / H200_BW, rel=0.02)
    # Llama-3.2-1B bf16, tied: every weight per step on the v5e
    s = PRESETS["llama-3.2-1b"]
    got = _row(rows, chip="v5e", method="ngram", workload="chat", batch=1)["decode_ms"]
    assert got == pytest.approx(1e3 * 2 * s.num_params() / V5E_BW, rel=0.02)


def test_verification_at_batch_one_costs_one_decode_step(rows):
    # bandwidth-bound: 8 tokens read the same weights, so n-gram's speedup is its mean length
    for chip in ("h200", "v5e"):
        r = _row(rows, chip=chip, method="ngram", workload="grounded", batch=1)
        assert r["speedup_no_overhead"] == pytest.approx(6.82, rel=0.01)


def test_the_int4_draft_reads_under_a_third_of_the_target(rows):
    s = PRESETS["llama-3-8b"]
    m = spec_roofline.models(json.loads(DATA.read_text())["models"]["h200"], s)
    head = s.vocab_size * s.hidden_size  # bf16 -> int8
    layers = s.num_params() - 2 * head  # weights without the embedding and the LM head
    want = layers * (0.5 + 4 / 32) + head
    assert spec_roofline.decode(m["int4"], 1, 0) == pytest.approx(want / H200_BW, rel=0.02)
    # a round with a draft costs k draft steps and a verification: slower than n-gram's
    d = _row(rows, chip="h200", method="draft", workload="chat", batch=1)
    n = _row(rows, chip="h200", method="ngram", workload="chat", batch=1)
    assert d["round_ms"] > n["round_ms"] + 3 * 1e3 * want / H200_BW * 0.9
