"""Serve one batch of prompts with tensor parallelism over every device of every host.

Run the same command on every host (see docs/SCALEOUT.md for a TPU pod slice and a multi-GPU
node). Each host joins the cluster (`jaxkv.distributed.initialize`), builds the same `LLM`
with ``tensor_parallel_size`` = all devices (or `--tp`), and runs the same requests; process 0
prints the outputs. On one machine without a cluster, pass `--single-process`.

    python scripts/serve_multihost.py --model PATH [--tp N] [--prompt TEXT ...]
        [--coordinator HOST:PORT --num-processes N --process-id I]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

import jaxkv
from jaxkv import distributed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: embedded)")
    parser.add_argument("--tp", type=int, default=None, help="default: every device")
    parser.add_argument("--prompt", action="append", default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--single-process", action="store_true")
    args = parser.parse_args(argv)

    if not args.single_process:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    info = distributed.process_info()
    tp = args.tp or info.device_count
    llm = jaxkv.LLM(args.model, dtype=args.dtype, tensor_parallel_size=tp)
    prompts = args.prompt or ["def fibonacci(n):", "import os\n", "class Stack:"]
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=args.max_tokens)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t
    if info.process_index == 0:
        print(f"{info.process_count} processes, {info.device_count} devices "
              f"({jax.devices()[0].platform}), tensor_parallel_size={tp}")
        for out in outs:
            print(f"--- {out.prompt!r}\n{out.outputs[0].text}")
        print(f"{sum(len(o.outputs[0].token_ids) for o in outs)} tokens in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
