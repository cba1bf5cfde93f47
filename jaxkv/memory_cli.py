"""`jaxkv memory`: print KV-cache and weight sizes, and optionally a capacity plan."""

from __future__ import annotations

import argparse
import sys

from jaxkv.cache import memory

HELP = "KV-cache and weight memory for a model (preset name, config.json, or 'list')"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model",
                        help="preset name, config.json path or folder; 'list' shows presets")
    parser.add_argument("--dtype", default="bfloat16", help="KV/weight dtype (default bfloat16)")
    parser.add_argument("--kv-dtype", default=None,
                        help="KV pages' dtype when it differs: int8 or fp8 count their scales "
                             "(default: --dtype)")
    parser.add_argument("--context", type=int, default=4096,
                        help="tokens per sequence (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="number of sequences (default 1)")
    parser.add_argument("--hbm-gib", type=float, default=None,
                        help="device memory in GiB; when set, print a capacity plan")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence for the plan (default: --context)")
    parser.add_argument("--avg-seq-len", type=int, default=None,
                        help="typical sequence length for the plan (default: max-model-len // 2)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--utilization", type=float, default=0.9,
                        help="fraction of HBM the server may use (default 0.9)")


def add_memory_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `memory` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser("memory", help=HELP, description=HELP)
    _add_arguments(parser)
    parser.set_defaults(func=run_memory)
    return parser


def run_memory(args: argparse.Namespace) -> int:
    """Print the report; returns a process exit code."""
    if args.model == "list":
        for name in memory.PRESETS:
            print(name)
        return 0
    try:
        if args.context < 0 or args.batch < 0:
            raise ValueError(
                f"--context and --batch must be >= 0, got {args.context}, {args.batch}")
        shape = memory.resolve_model(args.model)
        kv_dtype = args.dtype if args.kv_dtype is None else args.kv_dtype
        per_token = memory.kv_bytes_per_token(shape, kv_dtype)
        total = memory.kv_bytes(shape, args.context, args.batch, kv_dtype)
        weights = memory.weight_bytes(shape, args.dtype)
        plan = None
        if args.hbm_gib is not None:
            max_len = args.max_model_len if args.max_model_len is not None else args.context
            avg_len = args.avg_seq_len if args.avg_seq_len is not None else max_len // 2
            plan = memory.plan_capacity(
                shape, int(args.hbm_gib * 2**30), dtype=args.dtype, max_model_len=max_len,
                avg_seq_len=avg_len, page_size=args.page_size,
                gpu_memory_utilization=args.utilization, kv_dtype=kv_dtype)
    except ValueError as e:
        print(f"jaxkv memory: error: {e}", file=sys.stderr)
        return 2
    print(f"model: {shape.name}  layers={shape.num_layers} hidden={shape.hidden_size} "
          f"heads={shape.num_heads} kv_heads={shape.num_kv_heads} head_dim={shape.head_dim} "
          f"params={shape.num_params():,}")
    scales = " (values + scales)" if kv_dtype.lower() in memory.QUANTIZED else ""
    print(f"KV per token ({kv_dtype}{scales}): {per_token:,} bytes")
    print(f"KV for {args.context:,} tokens x {args.batch} seq: {total:,} bytes = "
          f"{memory.format_bytes(total)}")
    if shape.sliding_window and shape.local_layers:
        kept = memory.window_kv_bytes(shape, args.context, kv_dtype, args.page_size) * args.batch
        print(f"with window-only KV ({shape.local_layers} of {shape.num_layers} layers keep "
              f"their {shape.sliding_window:,}-token window): {kept:,} bytes = "
              f"{memory.format_bytes(kept)}, {kept / max(1, args.batch * args.context):,.0f} "
              f"per token ({kept / max(1, total):.1%} of keeping every token)")
    print(f"weights ({args.dtype}): {weights:,} bytes = {memory.format_bytes(weights)}")
    if plan is not None:
        print()
        print(plan.table())
    return 0


def main(argv=None) -> int:
    """Run the `memory` subcommand on its own (for tests and direct use)."""
    parser = argparse.ArgumentParser(prog="jaxkv memory", description=HELP)
    _add_arguments(parser)
    return run_memory(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
