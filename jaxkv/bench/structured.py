"""Structured outputs: replies that validate, grammar compile and mask times (llguidance, the
backend, against xgrammar), and what the mask costs a decode step.

1. Backends, on every schema of jaxkv.bench.structured_schemas (held out: never used by the
   tests): the first compile and a cached one (ms), and the mean time to fill one row's mask
   (us) along a reply (the tokens of the reply jaxkv generated for that schema, replayed).
   xgrammar is measured only when it is installed (it needs torch).
2. Validity: each schema's reply from ``--model`` (greedy and ``--samples`` at temperature
   0.8), parsed and checked with jsonschema; cut off at ``--new-tokens`` counts apart.
3. Cost at batch ``--batch``, every row constrained, ``max_decode_steps=1`` for both runs (a
   constrained row decodes one step per host round trip): tokens/s against the same batch
   unconstrained, and per step the host's mask fill (llguidance threads) and the device's
   masked sampling, against the step's time.
   Then the price a constrained row makes its batch pay with `LLM(model)` defaults (where a
   CPU decodes unconstrained batches in loops of 8 steps on device): ``--batch`` rows without
   a constraint, against one of them constrained for all its tokens (a letters-only regex).
   And the device's masked draw alone on random logits at vocabularies 49,152 (SmolLM2)
   and 128,256 (Llama 3), ``--batch`` constrained rows of max(32, batch), against the LM head of the
   smallest 128k model (Llama-3.2-1B: hidden 2048) for those rows: a floor for its step.
4. Speculation: extraction prompts (a record whose fields are asked for as JSON, so the
   reply copies from the prompt), one at a time, greedy, with `LLM(model)` defaults and with
   n-gram speculation: tokens/s, drafts accepted, and whether the replies are the same.

    jaxkv bench structured [--model smollm2] [--batch 16] [--new-tokens 96] [--samples 2]
"""

from __future__ import annotations

import json
import time

import numpy as np

NAME = "structured"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a path")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--samples", type=int, default=2,
                        help="replies per schema at temperature 0.8 (beside the greedy one)")


def _prompt(name: str, schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Reply with one JSON object for a {name}, matching "
             f"this JSON schema:\n{json.dumps(schema)}"}]


def _backends(model):
    """name -> (compile(schema) -> matcher factory, fill(matcher, bitmask), consume)."""
    from jaxkv.structured.grammar import GrammarCompiler
    from jaxkv.structured.params import StructuredOutputsParams

    cfg = model.config
    out = {}
    shared = GrammarCompiler(model.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    shared.tokenizer()  # built once per server: not part of a compile

    def ll_compile(schema, fresh=True):
        c = shared.fresh() if fresh else shared
        return c.compile(StructuredOutputsParams(json=schema)).matcher

    out["llguidance"] = (ll_compile, lambda m, bm: m.fill(bm, 0),
                         lambda m, t: m.consume(t))
    try:
        import xgrammar as xgr
    except ImportError:
        return out
    info = xgr.TokenizerInfo.from_huggingface(model.tokenizer, vocab_size=cfg.vocab_size,
                                              stop_token_ids=list(cfg.eos_token_ids))
    cached = xgr.GrammarCompiler(info)

    def xg_compile(schema, fresh=True):
        compiler = xgr.GrammarCompiler(info) if fresh else cached
        grammar = compiler.compile_json_schema(json.dumps(schema))
        return lambda: xgr.GrammarMatcher(grammar)

    def xg_fill(m, bm):
        import torch

        t = torch.from_numpy(bm)
        m.fill_next_token_bitmask(t)

    out["xgrammar"] = (xg_compile, xg_fill, lambda m, t: m.accept_token(int(t)))
    return out


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(args) -> dict:
    import jsonschema

    import jaxkv
    from jaxkv.bench.common import load_model
    from jaxkv.bench.structured_schemas import HELD_OUT

    model, described = load_model(args.model)
    llm = jaxkv.LLM(model, max_decode_steps=1)
    so = {name: {"json": schema} for name, schema in HELD_OUT.items()}

    # 2. validity (and the replies replayed in 1.)
    valid = {}
    replies = {}
    for name, schema in HELD_OUT.items():
        sps = [jaxkv.SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                    structured_outputs=so[name])]
        sps += [jaxkv.SamplingParams(temperature=0.8, seed=i, max_tokens=args.new_tokens,
                                     structured_outputs=so[name]) for i in range(args.samples)]
        outs = llm.chat([_prompt(name, schema)] * len(sps), sps, use_tqdm=False)
        got = [o.outputs[0] for o in outs]
        replies[name] = got[0].token_ids
        ok = cut = 0
        for c in got:
            if c.finish_reason != "stop":
                cut += 1
                continue
            try:
                jsonschema.validate(json.loads(c.text), schema)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        valid[name] = (ok, len(got) - cut, cut)
    print(f"{described}: held-out schemas, greedy + {args.samples} sampled replies each, "
          f"max_tokens {args.new_tokens}")
    print(f"{'schema':<16} {'valid':>7} {'ended':>6} {'cut off':>8}")
    for name, (ok, ended, cut) in valid.items():
        print(f"{name:<16} {ok:>7} {ended:>6} {cut:>8}")
    total_ok = sum(v[0] for v in valid.values())
    total_ended = sum(v[1] for v in valid.values())
    print(f"{'all':<16} {total_ok:>7} {total_ended:>6} "
          f"{sum(v[2] for v in valid.values()):>8}  ({total_ok}/{total_ended} of the ended "
          "replies valid)")

    # 1. backends
    words = (model.config.vocab_size + 31) // 32
    rows = []
    print(f"\n{'backend':<11} {'schema':<16} {'compile ms':>10} {'cached ms':>9} "
          f"{'mask us/token':>13}")
    for backend, (compile_, fill, consume) in _backends(model).items():
        for name, schema in HELD_OUT.items():
            first = min(_time(lambda s=schema, c=compile_: c(s)) for _ in range(3))
            compile_(schema, fresh=False)
            again = min(_time(lambda s=schema, c=compile_: c(s, fresh=False))
                        for _ in range(3))
            matcher = compile_(schema, fresh=False)()
            bm = np.zeros((1, words), np.int32)
            fills = []
            for t in replies[name]:
                fills.append(_time(lambda m=matcher, b=bm, f=fill: f(m, b)))
                if not consume(matcher, t):
                    break
            rows.append(dict(backend=backend, schema=name, compile_ms=1e3 * first,
                             cached_ms=1e3 * again, mask_us=1e6 * float(np.mean(fills))))
            print(f"{backend:<11} {name:<16} {1e3 * first:>10.2f} {1e3 * again:>9.3f} "
                  f"{1e6 * np.mean(fills):>13.1f}")

    # 3. the cost at batch B
    cost = _cost(llm, model, HELD_OUT, so, args)
    cost["mixed"] = _mixed(model, convs_for(HELD_OUT, args.batch), args)
    cost["vocab"] = _vocab_scaling(args.batch)
    # 4. n-gram speculation of constrained replies
    spec = _speculation(model, args)
    return {"validity": valid, "backends": rows, "cost": cost, "speculation": spec,
            "ok": total_ok == total_ended and spec["same"]}


def convs_for(schemas, batch: int) -> list:
    names = list(schemas)
    return [_prompt(names[i % len(names)], schemas[names[i % len(names)]])
            for i in range(batch)]


def _mixed(model, convs, args) -> dict:
    """Tokens/s of a batch with LLM defaults, unconstrained, and with its first row held to a
    regex it cannot finish in --new-tokens (so it is constrained throughout)."""
    import jaxkv

    llm = jaxkv.LLM(model)
    free = jaxkv.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    held = jaxkv.SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                structured_outputs={"regex": "[a-z ]{1000}"})
    llm.chat(convs[:2], [held, free], use_tqdm=False)  # first use: compiles
    got = {}
    for label, sps in (("none constrained", [free] * len(convs)),
                       ("one constrained", [held] + [free] * (len(convs) - 1))):
        t = time.perf_counter()
        outs = llm.chat(convs, sps, use_tqdm=False)
        seconds = time.perf_counter() - t
        got[label] = dict(tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
                          cut_off=outs[0].outputs[0].finish_reason == "length")
    print(f"\nbatch {len(convs)}, LLM(model) defaults (decode loops of "
          f"{llm.engine.runner.steps.max_decode_steps} steps when no row is constrained):")
    for label, g in got.items():
        print(f"{label:<17} {g['tokens_per_s']:>8.1f} tok/s")
    return got


def _vocab_scaling(batch: int) -> list[dict]:
    """The masked draw of ``batch`` constrained rows of max(32, batch) (median ms, greedy and
    at temperature 0.8) at two vocabularies, and a 128k model's LM head for those rows."""
    import jax
    import jax.numpy as jnp

    from jaxkv import SamplingParams
    from jaxkv.runtime.processors import build_processors, sample_processed
    from jaxkv.runtime.sampling import SamplingArrays

    def median_ms(fn, *a):
        jax.block_until_ready(fn(*a))
        return 1e3 * float(np.median([_time(lambda: jax.block_until_ready(fn(*a)))
                                      for _ in range(30)]))

    class Random:  # a mask with half the tokens allowed (its values do not change the cost)
        def __init__(self, vocab_size):
            self.vocab_size = vocab_size

        def fill(self, constrained, bitmask):
            bitmask[:] = np.random.default_rng(0).integers(-2**31, 2**31, bitmask.shape)

    rng, rows = np.random.default_rng(0), max(32, batch)
    so = SamplingParams(structured_outputs={"regex": "a"})
    keys, tokens = np.zeros((rows, 2), np.uint32), np.zeros(rows, np.int32)
    out = []
    for vocab in (49152, 128256):
        logits = jnp.asarray(rng.standard_normal((rows, vocab), np.float32))
        procs = build_processors([(i, [1], 1, so, [], object()) for i in range(batch)], rows,
                                 Random(vocab))
        row = {"vocab": vocab}
        for name, sampling in (("greedy", SamplingArrays.greedy(rows)),
                               ("t=0.8", SamplingArrays.build([0.8] * rows, [0] * rows,
                                                              [1.0] * rows, [0] * rows, rows))):
            row[name] = median_ms(sample_processed, logits, keys, sampling, procs, tokens)
        out.append(row)
    hidden = jnp.asarray(rng.standard_normal((batch, 2048), np.float32))
    head = jnp.asarray(rng.standard_normal((2048, 128256), np.float32) * 0.02)
    head_ms = median_ms(jax.jit(lambda h, w: h @ w), hidden, head)
    print(f"\nthe masked draw alone (device), {batch} constrained rows of {rows}, median ms:")
    print(f"{'vocab':>7} {'greedy':>7} {'t=0.8':>7}")
    for row in out:
        print(f"{row['vocab']:>7} {row['greedy']:>7.2f} {row['t=0.8']:>7.2f}")
    print(f"Llama-3.2-1B's LM head alone (fp32 [{batch}, 2048] x [2048, 128256]): "
          f"{head_ms:.1f} ms")
    return out + [{"lm_head_ms": head_ms}]


def _speculation(model, args) -> dict:
    import jsonschema

    import jaxkv
    from jaxkv.bench.structured_schemas import EXTRACTION_RECORDS, EXTRACTION_SCHEMA

    sp = jaxkv.SamplingParams(temperature=0, max_tokens=2 * args.new_tokens,
                              structured_outputs={"json": EXTRACTION_SCHEMA})
    schema = json.dumps(EXTRACTION_SCHEMA)
    convs = [[{"role": "user", "content": f"Extract the order as JSON ({schema}):\n{record}"}]
             for record in EXTRACTION_RECORDS]
    got = {}
    for label, spec in (("off", None), ("ngram", {"method": "ngram"})):
        llm = jaxkv.LLM(model, speculative_config=spec)
        llm.chat(convs[:1], sp, use_tqdm=False)  # first use: the masked programs compile
        seconds, outs = 0.0, []
        for conv in convs:  # one at a time (batch 1)
            t = time.perf_counter()
            outs += llm.chat([conv], sp, use_tqdm=False)
            seconds += time.perf_counter() - t
        done = [o.outputs[0] for o in outs]
        valid = ended = 0
        for c in done:
            if c.finish_reason != "stop":  # cut off at max_tokens
                continue
            ended += 1
            try:
                jsonschema.validate(json.loads(c.text), EXTRACTION_SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        got[label] = dict(tokens=sum(len(c.token_ids) for c in done), seconds=seconds,
                          texts=[c.text for c in done], valid=valid, ended=ended,
                          drafted=sum(o.metrics.num_draft_tokens for o in outs),
                          accepted=sum(o.metrics.num_accepted_tokens for o in outs))
        del llm
    same = got["off"]["texts"] == got["ngram"]["texts"]
    print(f"\nextraction, {len(convs)} records one at a time, greedy, json schema, "
          "LLM(model) defaults:")
    print(f"{'speculation':<12} {'tokens':>6} {'tok/s':>7} {'speedup':>7} {'accepted':>12} "
          f"{'valid/ended':>11}")
    base = got["off"]["tokens"] / got["off"]["seconds"]
    for label, g in got.items():
        rate = g["tokens"] / g["seconds"]
        acc = f"{g['accepted']}/{g['drafted']}" if g["drafted"] else "-"
        print(f"{label:<12} {g['tokens']:>6} {rate:>7.1f} {rate / base:>6.2f}x {acc:>12} "
              f"{g['valid']:>9}/{g['ended']}")
    print(f"replies the same with and without speculation: {same}")
    return dict(same=same, **{k: {x: v for x, v in g.items() if x != "texts"}
                              for k, g in got.items()})


def _cost(llm, model, schemas, so, args) -> dict:
    import jax

    import jaxkv
    import jaxkv.engine.runner as runner_module

    runner = llm.engine.runner
    names = list(schemas)
    convs = convs_for(schemas, args.batch)
    free = [jaxkv.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
            for _ in convs]
    tight = [jaxkv.SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                  structured_outputs=so[names[i % len(names)]])
             for i in range(args.batch)]
    spent = {"fill": 0.0, "sample": 0.0, "fills": 0}
    fill, sample = runner.grammars.fill, runner_module.sample_processed

    def timed_fill(rows, bitmask):
        t = time.perf_counter()
        fill(rows, bitmask)
        spent["fill"] += time.perf_counter() - t
        spent["fills"] += 1

    def timed_sample(*a):
        jax.block_until_ready(a[0])  # the step's logits first: time the sampling alone
        t = time.perf_counter()
        out = jax.block_until_ready(sample(*a))
        spent["sample"] += time.perf_counter() - t
        return out

    llm.chat(convs[:2], tight[:2], use_tqdm=False)  # compiles what both runs use
    llm.chat(convs[:2], free[:2], use_tqdm=False)
    results = {}
    for label, sps in (("unconstrained", free), ("constrained", tight)):
        steps0 = runner.num_steps
        # timed where the runner calls them (each waits for its result: serialized)
        runner.grammars.fill, runner_module.sample_processed = timed_fill, timed_sample
        try:
            t = time.perf_counter()
            outs = llm.chat(convs, sps, use_tqdm=False)
            seconds = time.perf_counter() - t
        finally:
            runner.grammars.fill, runner_module.sample_processed = fill, sample
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = runner.num_steps - steps0
        results[label] = dict(tokens_per_s=tokens / seconds, steps=steps,
                              step_ms=1e3 * seconds / max(steps, 1))
    n = max(spent["fills"], 1)
    results["fill_ms_per_step"] = 1e3 * spent["fill"] / n
    results["sample_ms_per_step"] = 1e3 * spent["sample"] / n
    step = results["unconstrained"]["step_ms"]
    print(f"\nbatch {args.batch}, max_decode_steps=1, {args.new_tokens} tokens per row:")
    for label in ("unconstrained", "constrained"):
        r = results[label]
        print(f"{label:<14} {r['tokens_per_s']:>8.1f} tok/s  {r['steps']:>4} steps  "
              f"{r['step_ms']:>7.1f} ms/step")
    print(f"mask fill (host, {args.batch} rows): {results['fill_ms_per_step']:.2f} ms/step "
          f"({results['fill_ms_per_step'] / step:.1%} of an unconstrained step; it runs while "
          f"the device computes the step's forward)")
    print(f"masked sampling (device, after the step's logits): "
          f"{results['sample_ms_per_step']:.2f} ms/step "
          f"({results['sample_ms_per_step'] / step:.1%})")
    return results
