"""The ``jaxkv`` command: ``jaxkv generate`` (text from a checkpoint, default: the embedded
model), ``jaxkv chat`` (a multi-turn conversation with prefix-cache reuse), ``jaxkv serve`` (an
OpenAI-compatible HTTP server) and ``jaxkv memory`` (KV-cache sizing and capacity planning)."""

from __future__ import annotations

import argparse
import logging
import sys

import numpy as np

from jaxkv.bench.cli import add_bench_parser
from jaxkv.cli_settings import add_engine_arguments, engine_settings
from jaxkv.memory_cli import add_memory_parser

DEMO_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    \"\"\"A last-in, first-out list.\"\"\"\n\n    def __init__(self):",
    "    for i in range(len(items)):",
)


CHAT_TURNS = (
    "What is the capital of France?",
    "What is it famous for?",
    "Suggest one thing to do there in the evening.",
)


def _add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="a multi-turn chat showing prefix-cache reuse")
    p.add_argument("--model", default=None,
                   help="checkpoint with a chat template: HF folder, .gguf file, or 'smollm2' "
                        "(default: embedded model)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--seed", type=int, default=0)
    add_engine_arguments(p, only=("page_size",))
    p.set_defaults(func=run_chat)


def run_chat(args) -> int:
    """Replays a conversation turn by turn through `LLM.chat`; each turn's prompt holds the
    whole history, and the prefix cache serves all of it but the new message."""
    import jaxkv

    model = (jaxkv.load_default() if args.model is None
             else jaxkv.load_pretrained(args.model))
    sampling = jaxkv.SamplingParams(temperature=args.temperature, top_p=0.9,
                                    max_tokens=args.max_tokens, seed=args.seed)
    # A first pass compiles every program the conversation needs; the second is timed, on a
    # fresh engine (empty prefix cache) that reuses those programs.
    llm = None
    for _ in range(2):
        del llm  # the first pool goes before the second is sized
        llm = jaxkv.LLM(model, page_size=args.page_size, seed=args.seed)
        rows, replies = _converse(llm, sampling)
    for message, reply in zip(CHAT_TURNS, replies, strict=True):
        print(f"[user] {message}\n[assistant] {reply.strip()[:160]}\n")
    print(f"multi-turn chat, page_size {args.page_size} "
          f"({llm.stats().kv_pages_total} KV pages in the pool)\n")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'computed':>9} {'TTFT ms':>8} "
          f"{'pages used':>10} {'pages cached':>12}")
    for turn, prompt, cached, computed, ttft, used, cached_pages in rows:
        print(f"{turn:>4} {prompt:>7} {cached:>7} {computed:>9} {ttft * 1e3:>8.1f} "
              f"{used:>10} {cached_pages:>12}")
    print("\nFrom turn 2 on, the history comes from the prefix cache and only the rest is")
    print("computed. The match ends early where re-tokenizing a reply's text gives other tokens")
    print("than were sampled. 'pages cached' are held by the prefix cache alone (evictable).")
    model_arg = f"--model {args.model} " if args.model else ""
    print(f"\nreproduce: jaxkv chat {model_arg}--max-tokens {args.max_tokens} --temperature "
          f"{args.temperature} --page-size {args.page_size} --seed {args.seed}")
    return 0


def _converse(llm, sampling):
    """Runs CHAT_TURNS through `llm.chat`; returns per-turn stats rows and the replies."""
    history = []
    rows, replies = [], []
    for turn, message in enumerate(CHAT_TURNS, 1):
        history.append({"role": "user", "content": message})
        out = llm.chat(history, sampling, use_tqdm=False)[0]
        replies.append(out.outputs[0].text)
        history.append({"role": "assistant", "content": replies[-1]})
        s = llm.stats()
        rows.append((turn, len(out.prompt_token_ids), out.num_cached_tokens,
                     len(out.prompt_token_ids) - out.num_cached_tokens, out.metrics.ttft,
                     s.kv_pages_used, s.kv_pages_cached))
    return rows, replies


def _add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text with the paged KV cache")
    p.add_argument("--model", default=None,
                   help="HF checkpoint folder, .gguf file, or 'smollm2' (default: the "
                        "embedded tiny model)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the chat template")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable; default: a few Python openings)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    add_engine_arguments(p, only=("page_size", "dtype", "kv_cache_dtype"))
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    """Generates for each prompt and prints text, speed and KV memory: paged vs contiguous."""
    import jaxkv

    model = (jaxkv.load_default(dtype=args.dtype) if args.model is None
             else jaxkv.load_pretrained(args.model, dtype=args.dtype))
    prompts = list(args.prompt or DEMO_PROMPTS)
    inputs = prompts
    if args.chat:
        if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
            raise ValueError("--chat needs a model whose tokenizer has a chat template")
        inputs = [model.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
            return_dict=False) for p in prompts]
    sampling = jaxkv.SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                    top_k=args.top_k, max_tokens=args.max_tokens,
                                    seed=args.seed)
    # The first call compiles; time a second, identical call.
    kw = dict(page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype)
    jaxkv.generate_with_stats(model, inputs, sampling, **kw)
    outputs, stats = jaxkv.generate_with_stats(model, inputs, sampling, **kw)
    name = args.model or "embedded tiny-llama"
    print(f"model: {name} ({model.config.num_params():,} params, {np.dtype(model.dtype).name})"
          "\n")
    for prompt, out in zip(prompts, outputs, strict=True):
        print("─" * 72)
        text = model.decode(out) if model.tokenizer is not None else str(out)
        if args.chat:
            print(f"[user] {prompt}\n[assistant] {text.strip()}")
        else:
            print(f"{prompt}\033[1m{text}\033[0m" if sys.stdout.isatty() else prompt + text)
    print("─" * 72)
    c = model.config
    per_tok = stats.kv_bytes_per_token
    filled = stats.prompt_tokens + stats.generated_tokens
    paged = stats.kv_pages_used * stats.page_size
    contiguous = len(outputs) * c.max_position_embeddings
    print(f"\n{len(outputs)} sequences, {stats.prompt_tokens} prompt + "
          f"{stats.generated_tokens} generated tokens in {stats.steps} steps")
    print(f"prefill {stats.prefill_seconds * 1e3:.1f} ms, decode {stats.decode_seconds * 1e3:.1f}"
          f" ms -> {stats.generated_tokens / max(stats.decode_seconds, 1e-9):,.0f} tokens/s "
          "(batched decode, after compilation)")
    print(f"\nKV memory ({per_tok:,} bytes/token, page_size {stats.page_size}):")
    rows = [("tokens actually cached", filled),
            (f"paged: {stats.kv_pages_used} pages reserved", paged),
            (f"contiguous: {len(outputs)} x max_model_len {c.max_position_embeddings}",
             contiguous)]
    for label, tokens in rows:
        print(f"  {label:<44} {tokens:>8,} tokens {tokens * per_tok / 2**20:>9.2f} MiB")
    print(f"  paged reserves {paged / filled:.2f}x what is used; contiguous "
          f"{contiguous / filled:.2f}x")
    model_arg = f"--model {args.model} " if args.model else ""
    chat_arg = "--chat " + " ".join(f"--prompt {p!r}" for p in prompts) + " " if args.chat \
        else ""
    print(f"\nreproduce: jaxkv generate {model_arg}{chat_arg}--max-tokens {args.max_tokens} "
          f"--page-size "
          f"{args.page_size} --temperature {args.temperature} --top-p {args.top_p} "
          f"--seed {args.seed} --kv-cache-dtype {args.kv_cache_dtype}")
    return 0


def _add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI)")
    p.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint folder, .gguf file, or 'smollm2' (default: the embedded "
                        "tiny model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model argument)")
    p.add_argument("--host-kv-cache-gib", type=float, default=None,
                   help="host_kv_cache_bytes in GiB")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=argparse.SUPPRESS, help="the same as --no-enable-prefix-caching")
    p.add_argument("--max-pending", type=int, default=256,
                   help="unfinished requests accepted before answering 429")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a key /v1/* requires as 'Authorization: Bearer KEY' (repeatable); "
                        "each key is a tenant with its own prefix-cache namespace")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="more keys, one per line (like --api-key)")
    p.add_argument("--tokenizer-routes-need-key", action="store_true",
                   help="with --api-key, /tokenize, /detokenize and /tokenizer_info need a key "
                        "too (default: they answer without one, as vLLM's do)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json",
                                                                  "mistral"],
                   help="how tool calls look in the model's text, for tool_choice 'auto' "
                        "(default: detected from the chat template)")
    p.set_defaults(func=run_serve, settings=add_engine_arguments(p))
    p.set_defaults(background_warmup=True)  # healthy once requests can run (see RuntimeConfig)


def run_serve(args) -> int:
    """Loads the model, warms the engine up and serves until interrupted."""
    import jaxkv
    from jaxkv.server import serve
    from jaxkv.server.auth import Tenants, read_key_file

    keys = list(args.api_key)
    if args.api_key_file is not None:
        keys += read_key_file(args.api_key_file)
    Tenants(keys)  # a malformed key is refused before the model loads
    settings = engine_settings(args, args.settings)
    if args.host_kv_cache_gib is not None:
        settings["host_kv_cache_bytes"] = int(args.host_kv_cache_gib * 2**30)
    # compiles what every request needs (the rest in the background; --no-background-warmup:
    # every program first)
    llm = jaxkv.LLM(args.model, **settings)
    serve(llm, model_name=args.served_model_name or args.model or "tiny-llama",
          host=args.host, port=args.port, max_pending=args.max_pending, api_keys=keys,
          tool_call_parser=args.tool_call_parser,
          tokenizer_routes_need_key=args.tokenizer_routes_need_key)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_chat_parser(sub)
    _add_serve_parser(sub)
    add_memory_parser(sub)
    add_bench_parser(sub)
    return parser


def _log_to_stderr() -> None:
    """jaxkv's INFO lines (the KV pool, the server) on stderr, once."""
    log = logging.getLogger("jaxkv")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
