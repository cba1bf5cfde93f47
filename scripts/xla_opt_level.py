"""What XLA:CPU's LLVM optimization level costs and gives on SmolLM2: a cold warmup (no cache),
a 401-token prefill, and greedy decode single-stream and at 16 sequences. Run it as is and with
``XLA_FLAGS=--xla_backend_optimization_level=0``, one after the other on a quiet machine
(docs/BENCHMARKS.md, start-up)."""

import os
import time

import jaxkv

llm_start = time.perf_counter()
llm = jaxkv.LLM("smollm2", compilation_cache_dir="none")
warmup = time.perf_counter() - llm_start
one = jaxkv.SamplingParams(max_tokens=1, temperature=0)
prompt = "the quick brown fox " * 100
llm.generate([prompt], one, use_tqdm=False)
t = time.perf_counter()
llm.generate([prompt + "x"], one, use_tqdm=False)
prefill = time.perf_counter() - t
run = jaxkv.SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llm.generate(["hello"], jaxkv.SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
t = time.perf_counter()
llm.generate(["once upon a time"], run, use_tqdm=False)
single = 128 / (time.perf_counter() - t)
t = time.perf_counter()
llm.generate([f"story {i}:" for i in range(16)], run, use_tqdm=False)
batch = 16 * 128 / (time.perf_counter() - t)
print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: LLM(smollm2) cold {warmup:.1f} s, "
      f"prefill of 401 tokens {prefill * 1e3:.0f} ms, single stream {single:.1f} tok/s, "
      f"16 sequences {batch:.1f} tok/s")
