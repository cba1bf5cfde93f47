"""Compiling every program an `Engine` can run before it serves (like vLLM's CUDA-graph capture).

An engine's steps are jitted over bucketed shapes: T tokens, B rows and, for the jnp reference
attention only, Q (the longest row, which sizes its padded work; the Pallas kernels are ragged,
so Q is no shape for them). `engine_step_shapes` lists every (T, B, Q) the engine's batches can
take; `warmup` runs a padding-only batch of each (no page or slot changes), the sampler for each
row count, the page-copy programs and the per-request key derivation. Afterwards serving
compiles nothing, so no request waits on a compile and host memory stays flat. On CPU with the
reference there are many shapes (127 at max_num_batched_tokens=256, max_num_seqs=16).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.runtime.batch import bucket, padding_batch, step_shapes
from jaxkv.runtime.page_copy import copy_pages, fill_pages
from jaxkv.runtime.sampling import SamplingArrays, sample
from jaxkv.sampling_params import SamplingParams


def engine_step_shapes(engine) -> list[tuple[int, int, int]]:
    """(T tokens, B rows, Q longest row) of every step program ``engine`` can run; Q is 1 for
    decode steps, and T for prefill steps when the attention is a kernel."""
    shapes = step_shapes(engine.max_num_batched_tokens, engine.max_num_seqs,
                         min_tokens=engine.min_rows, min_rows=engine.min_rows)
    if not engine.q_is_shape:
        shapes = {(t, b, 1 if q == 1 else t) for t, b, q in shapes}
    return sorted(shapes)


def warmup(engine) -> int:
    """Compiles every program ``engine`` can run; returns the number of step shapes."""
    shapes = engine_step_shapes(engine)
    sampled = set()
    for t, b, q in shapes:
        batch = padding_batch(t, b, q, num_pages=engine.num_pages, max_seqs=engine.max_num_seqs,
                              max_pages_per_seq=engine.max_pages_per_seq)
        run = engine.steps.decode if q == 1 else engine.steps.prefill
        logits, engine.state = run(engine.model.params, engine.state, batch)
        if b not in sampled:
            sampled.add(b)
            sample(logits, np.zeros((b, 2), np.uint32), SamplingArrays(
                np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32),
                np.zeros(b, np.int32)))
    for n in sorted({bucket(n) for n in range(1, engine.max_num_seqs + 1)}):
        dropped = np.full(n, engine.num_pages, np.int32)  # out of range: nothing written
        engine.state = copy_pages(engine.state, np.zeros(n, np.int32), dropped)
        if engine.debug_nan_freed_pages:
            engine.state = fill_pages(engine.state, dropped, float("nan"))
    engine._sample_keys(SamplingParams(n=2), 0)  # the per-request key derivation
    jax.block_until_ready(engine.state)
    return len(shapes)
