"""Where logits are bitwise identical, and where only the tokens are.

Runs one 40-token prompt of the embedded model through the jitted prefill step in different
ways and compares its last-position logits with running it alone, in one chunk, at page size 16:
run again (same program, same inputs), padded to 8 rows, batched with 3 other prompts, in 3
chunks, at page size 8. Prints the largest absolute difference and whether the argmax (the
greedy token) is the same.

    jaxkv bench determinism [--attention-impl reference]
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.bench import common
from jaxkv.kv import init_state
from jaxkv.runtime.batch import PageTable, Row, build_batch
from jaxkv.runtime.sampling import SamplingArrays
from jaxkv.runtime.steps import make_steps


def add_arguments(parser) -> None:
    parser.add_argument("--attention-impl", default="reference")


def run(args) -> dict:
    model, _ = common.load_model("tiny")
    c = model.config
    steps = make_steps(model.graphdef, args.attention_impl)
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, c.vocab_size, 40).tolist()
    others = [rng.integers(4, c.vocab_size, 30).tolist() for _ in range(3)]

    def last_logits(page_size=16, chunks=(40,), tokens_bucket=64, company=False):
        state = init_state(c, 64, page_size, model.dtype)
        table = PageTable(8, 16, 64, page_size)
        pages, start = list(range(8)), 0
        for chunk in chunks:
            rows = [Row(0, prompt[start:start + chunk], start, pages)]
            if company and start == 0:
                rows += [Row(i + 1, o, 0, list(range(8 + 8 * i, 16 + 8 * i)))
                         for i, o in enumerate(others)]
            batch = build_batch(rows, table, tokens_bucket=max(tokens_bucket, 256 * company))
            _, logits, _, state = steps.step(model.params, state, batch,
                                             np.zeros((8, 2), np.uint32), SamplingArrays.greedy(8))
            start += chunk
        return np.asarray(logits[0])

    alone = last_logits()
    cases = {"run again": last_logits(), "padded to 256 tokens": last_logits(tokens_bucket=256),
             "with 3 other prompts": last_logits(company=True),
             "in chunks of 16+16+8": last_logits(chunks=(16, 16, 8)),
             "page size 8": last_logits(page_size=8)}
    print(f"backend {jax.default_backend()}, attention_impl {args.attention_impl!r}; "
          "the same prompt's last logits vs running it alone in one chunk")
    print(f"{'served':<22} {'bitwise':>8} {'max |diff|':>11} {'same token':>11}")
    rows = {}
    for name, logits in cases.items():
        diff = float(np.abs(logits - alone).max())
        rows[name] = dict(bitwise=bool(np.array_equal(logits, alone)), max_diff=diff,
                          same_token=bool(logits.argmax() == alone.argmax()))
        print(f"{name:<22} {str(rows[name]['bitwise']):>8} {diff:>11.2e} "
              f"{str(rows[name]['same_token']):>11}")
    return {"cases": rows}
