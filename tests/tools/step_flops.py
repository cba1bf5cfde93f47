"""FLOPs of jaxkv's ragged step for the roofline step-time models of `jaxkv bench sim-disagg
--measure` (`jaxkv.bench.sim.step_models`): ``cost_analysis()`` of the XLA:TPU compile for v5e
(libtpu's compile-only topology), or of the step lowered for CUDA for h200, at each of the
models' (layers, T, R) buckets. A child process of the measurement, with the `aot` extra and
tests/ on its path:

    PYTHONPATH=.venv/aot-site:tests JAXKV_AOT=1 python -m tools.step_flops v5e|h200

prints one line, ``FLOPS [[layers, T, R, flops], ...]``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np


def abstract_step(preset: str, layers: int, tokens: int, rows: int, impl: str):
    """(jitted step, abstract args): jaxkv's ragged step for ``preset`` cut to ``layers``
    unrolled layers (cost_analysis counts a scanned layer's body once, not L times)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxkv.kv import init_state
    from jaxkv.model.llama import Llama
    from jaxkv.runtime.batch import PageTable, padding_batch
    from jaxkv.runtime.sampling import SamplingArrays
    from jaxkv.runtime.steps import make_steps
    from tools.aot_steps import config_of

    cfg = dataclasses.replace(config_of(preset), num_layers=layers)
    module = nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                          scan_layers=False, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(module)
    pages = 1024
    state = jax.eval_shape(lambda: init_state(cfg, pages, 16, jnp.bfloat16))
    batch = padding_batch(tokens, PageTable(rows, 256, pages, 16))
    return make_steps(graphdef, impl).step, (params, state, batch, np.zeros((rows, 2), np.uint32),
                                             SamplingArrays.greedy(rows))


def main(hw: str) -> None:
    if hw == "v5e":  # the real XLA:TPU compile; cost_analysis of the optimized program
        import jax

        from tools import aot_tpu
    else:  # lowered for CUDA (sm_90 needs a GPU client to compile): the HLO's FLOPs
        from tools import aot_gpu  # noqa: F401  (sets the environment the plugin needs)
    from jaxkv.bench.sim.step_models import BUCKETS, HARDWARE

    out = []
    for layers, tokens, rows in BUCKETS:
        if hw == "v5e":
            step, args = abstract_step(HARDWARE[hw]["preset"], layers, tokens, rows,
                                       "pallas-tpu")
            with jax.default_device(aot_tpu.device("v5e")):
                cost = step.trace(*aot_tpu.on_chip("v5e", args)).lower().compile().cost_analysis()
        else:
            step, args = abstract_step(HARDWARE[hw]["preset"], layers, tokens, rows,
                                       "pallas-gpu")
            cost = step.trace(*args).lower(lowering_platforms=("cuda",)).cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out.append((layers, tokens, rows, float(cost["flops"])))
    print("FLOPS " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
