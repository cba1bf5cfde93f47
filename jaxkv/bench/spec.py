"""Speculative decoding: tokens/s with n-gram lookup, self-speculation and a draft model
against none.

`LLM(model, speculative_config=...)` with every other setting at its default, on three
workloads rendered with the model's chat template, at each batch size:

- grounded: "repeat this passage exactly" over passages of the held text (the output quotes
  its input: n-gram lookup's case), greedy, each reply ending at EOS or ``--new-tokens``;
- chat: open-ended questions, greedy, likewise;
- unmatched: prompts of random tokens sampled at temperature 1 (nothing to look up, and
  drafts that are rejected when one is found): what speculation costs when it does not pay.

Methods: off, ngram, self, draft (``draft_model``: ``--draft-model`` if given, else the target
quantized as ``--draft-quantization``, int4-g32 by default). Each cell is the median of
``--repeats`` timed `generate` calls of the batch after the engines compiled and ran once, the
methods' order rotated between repeats (engines sharing two cores disturb each other); the
table gives tokens/s, the speedup over no speculation in the same run, the acceptance rate
(accepted / drafted tokens), the mean accepted length (tokens emitted per verification), and
whether greedy outputs equal the ones without speculation.

    jaxkv bench spec [--model smollm2] [--methods off ngram self draft] [--batches 1 4 16]
        [--repeats 3] [--draft-quantization int4-g32] [--draft-model PATH]
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

NAME = "spec"
QUESTIONS = ("Write a short story about a robot who learns to paint.",
             "Explain how a bicycle stays upright.",
             "What are three good habits for a student, and why?",
             "Describe the water cycle to a ten-year-old.")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a path")
    parser.add_argument("--methods", nargs="+", default=["off", "ngram", "self", "draft"],
                        choices=["off", "ngram", "self", "draft"])
    parser.add_argument("--workloads", nargs="+", default=["grounded", "chat", "unmatched"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=None,
                        help="num_speculative_tokens (default: the method's)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="self: num_draft_layers (default: half the model's)")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="(default: SpeculativeConfig's)")
    parser.add_argument("--draft-model", default=None,
                        help="draft: the draft's path (default: the target, quantized)")
    parser.add_argument("--draft-quantization", default="int4-g32",
                        help="draft: its weights' quantization ('none': as loaded)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per cell, the median reported")


def _passages(n: int) -> list[str]:
    """n passages of the public-domain texts in jaxkv/assets/texts/held_text.txt."""
    import jaxkv

    text = (Path(jaxkv.__file__).parent / "assets" / "texts" / "held_text.txt").read_text()
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
    return [paras[i % len(paras)][:1000] for i in range(n)]


def _conversations(workload: str, n: int, tokenizer, seed: int):
    if workload == "grounded":
        return [[{"role": "user", "content": "Repeat the following passage exactly, word for "
                  f"word:\n\n{p}"}] for p in _passages(n)]
    if workload == "chat":
        return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size if tokenizer is not None else 256
    return [rng.integers(100, vocab - 1, 200).tolist() for _ in range(n)]


def _measure(llm, prompts, sp) -> tuple[float, list, dict]:
    before = llm.stats()
    t = time.perf_counter()
    if isinstance(prompts[0], list) and isinstance(prompts[0][0], int):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    else:
        outs = llm.chat(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    d = {f: getattr(after, f) - getattr(before, f)
         for f in ("spec_verifications", "spec_draft_tokens", "spec_accepted_tokens")}
    return tokens / seconds, [o.outputs[0].token_ids for o in outs], d


def _config(method: str, args):
    if method == "off":
        return None
    cfg = {"method": "draft_model" if method == "draft" else method}
    if method == "draft":
        cfg["model"] = args.draft_model
        cfg["quantization"] = None if args.draft_quantization == "none" \
            else args.draft_quantization
    if args.k is not None:
        cfg["num_speculative_tokens"] = args.k
    if args.disable_by_batch_size is not None:
        cfg["disable_by_batch_size"] = args.disable_by_batch_size
    if method == "self" and args.draft_layers:
        cfg["num_draft_layers"] = args.draft_layers
    return cfg


def _repeated(llms: dict, prompts, sps, repeats: int) -> dict:
    """Each method's run with the median tokens/s of ``repeats`` (its order rotated)."""
    got = {m: [] for m in llms}
    names = list(llms)
    for i in range(repeats):
        for m in names[i % len(names):] + names[:i % len(names)]:
            got[m].append(_measure(llms[m], prompts, sps))
    return {m: sorted(runs, key=lambda x: x[0])[len(runs) // 2] for m, runs in got.items()}


def run(args) -> dict:
    import jaxkv
    from jaxkv.bench.common import load_model

    model, described = load_model(args.model)
    tok = model.tokenizer
    llms = {m: jaxkv.LLM(model, speculative_config=_config(m, args)) for m in args.methods}
    work = {}
    for w in args.workloads:
        greedy = w != "unmatched"
        for b in args.batches:
            prompts = _conversations(w, b, tok, seed=b)
            # the replies end at EOS (a quote ends with its passage); random prompts run on
            sps = [jaxkv.SamplingParams(temperature=0 if greedy else 1.0, seed=i,
                                        max_tokens=args.new_tokens, ignore_eos=not greedy)
                   for i in range(b)]
            work[w, b] = (prompts, sps)
    for llm in llms.values():  # compile and run every shape once, untimed
        for prompts, sps in work.values():
            _measure(llm, prompts[:1], sps[0])
    print(f"{described}: LLM defaults + speculative_config, {args.new_tokens} new tokens per "
          f"request, k={args.k}, disable_by_batch_size={args.disable_by_batch_size}, "
          f"draft: {args.draft_model or 'the target'} ({args.draft_quantization}), "
          f"median of {args.repeats}")
    print(f"{'workload':<10} {'batch':>5} {'method':<6} {'tok/s':>7} {'speedup':>8} "
          f"{'accept':>7} {'mean len':>9} {'same':>5}")
    rows = []
    for (w, b), (prompts, sps) in work.items():
        runs = _repeated(llms, prompts, sps, args.repeats)
        base_tps, base_tokens, _ = runs.get("off", (None, None, None))
        for m, (tps, tokens, d) in runs.items():
            rate = d["spec_accepted_tokens"] / d["spec_draft_tokens"] \
                if d["spec_draft_tokens"] else None
            mean = 1 + d["spec_accepted_tokens"] / d["spec_verifications"] \
                if d["spec_verifications"] else None
            same = None if base_tokens is None or w == "unmatched" else tokens == base_tokens
            rows.append(dict(workload=w, batch=b, method=m, tokens_per_s=tps,
                             speedup=None if base_tps is None else tps / base_tps,
                             acceptance_rate=rate, mean_accepted_length=mean, same=same, **d))
            print(f"{w:<10} {b:>5} {m:<6} {tps:>7.1f} "
                  f"{'' if base_tps is None else f'{tps / base_tps:.2f}x':>8} "
                  f"{'' if rate is None else f'{rate:.0%}':>7} "
                  f"{'' if mean is None else f'{mean:.2f}':>9} "
                  f"{'' if same is None else str(same):>5}")
    ok = all(r["same"] is not False for r in rows)
    return {"rows": rows, "ok": ok}
