"""Window-only KV: what Gemma's local layers store, planned and measured.

First the plan: KV bytes per token of one sequence at each context for the Gemma presets
(`jaxkv.cache.memory.window_kv_bytes`: full-attention layers keep every token, local layers
the pages their window spans), against keeping every token. Then a measurement on this
machine: a Gemma-3-like model (5 local layers to 1 global, random weights) served by `LLM`
with its defaults, window-only KV on and off, each given the same KV memory: the pool each
plans (pages, window slots, bytes, full-length sequences that fit), the bytes its running
sequences hold, decode tokens/s, and whether both give the same greedy tokens.

    jaxkv bench window-kv [--contexts 4096 32768 131072] [--prompt-len 1024] [--batch 4]
"""

from __future__ import annotations

import time

import numpy as np

NAME = "window-kv"
PRESETS = ("gemma-2-2b", "gemma-3-1b", "gemma-3-4b")


def add_arguments(parser) -> None:
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--dtype", default="bfloat16", help="KV dtype of the plan")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12, help="of the measured model")
    parser.add_argument("--window", type=int, default=128, help="of the measured model")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-memory-mib", type=int, default=256,
                        help="KV memory both measured engines get")


def plan_table(contexts, dtype: str, page_size: int) -> list[dict]:
    from jaxkv.cache.memory import PRESETS as SHAPES
    from jaxkv.cache.memory import kv_bytes, window_kv_bytes

    rows = []
    print(f"Planned KV bytes per token of one sequence ({dtype} pages of {page_size} tokens)")
    print(f"{'model':<12} {'local':>6} {'window':>7} {'context':>8} {'all tokens':>11} "
          f"{'window-only':>12} {'ratio':>7}")
    for name in PRESETS:
        shape = SHAPES[name]
        for n in contexts:
            full = kv_bytes(shape, n, 1, dtype) / n
            kept = window_kv_bytes(shape, n, dtype, page_size) / n
            rows.append(dict(model=name, context=n, full=full, window=kept))
            print(f"{name:<12} {shape.local_layers:>3}/{shape.num_layers:<2} "
                  f"{shape.sliding_window:>7} {n:>8} {full:>11,.0f} {kept:>12,.0f} "
                  f"{kept / full:>6.1%}")
    return rows


def _model(layers: int, window: int, max_len: int):
    import jaxkv

    config = jaxkv.ModelConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=layers,
        num_heads=4, num_kv_heads=1, head_dim=64, max_position_embeddings=max_len,
        eos_token_ids=(1,), qk_norm=True, sandwich_norm=True, gemma_norm=True,
        scale_embeddings=True, hidden_act="gelu_tanh", query_pre_attn_scalar=64.0,
        sliding_window=window, rope_theta=1e6, local_rope_theta=1e4, model_type="gemma3_text",
        layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention"
                          for i in range(layers)))
    return jaxkv.random_model(config, seed=0, scan_layers=False)


def _measure(model, args, window_kv: bool, prompts) -> dict:
    import jax

    import jaxkv

    llm = jaxkv.LLM(model, kv_cache_memory_bytes=args.kv_memory_mib * 2**20,
                    max_model_len=args.max_model_len, window_kv=window_kv,
                    page_size=args.page_size)
    engine = llm.engine
    sp = jaxkv.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=sp, use_tqdm=False)  # warm
    held = []
    step = engine.step

    def counting_step():  # the bytes the running sequences' KV occupies, at each step
        out = step()
        used, _ = engine.scheduler.page_usage()
        w = engine.window
        held.append(used * llm.kv_pool.bytes_per_token * args.page_size
                    + (w.num_pinned * llm.kv_pool.window_slot_bytes if w else 0))
        return out

    engine.step = counting_step
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    seconds = time.perf_counter() - t
    engine.step = step
    pool = llm.kv_pool
    state = sum(x.nbytes for x in jax.tree.leaves(engine.state))
    return dict(window_kv=window_kv, pages=pool.pages, slots=pool.window_slots,
                pool_bytes=state, full_sequences=pool.full_sequences,
                peak_held=max(held), tokens_per_s=len(prompts) * args.new_tokens / seconds,
                tokens=[o.outputs[0].token_ids for o in outs])


def run(args) -> dict:
    rows = plan_table(args.contexts, args.dtype, args.page_size)
    model = _model(args.layers, args.window, args.max_model_len)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 4096, args.prompt_len).tolist() for _ in range(args.batch)]
    local = model.config.num_local_layers
    print(f"\nMeasured: a Gemma-3-like model ({local} of {model.config.num_layers} layers local, "
          f"window {args.window}, fp32 KV), LLM defaults with {args.kv_memory_mib} MiB of KV, "
          f"{args.batch} prompts of {args.prompt_len} tokens, {args.new_tokens} new each")
    measured = [_measure(model, args, on, prompts) for on in (False, True)]
    same = measured[0]["tokens"] == measured[1]["tokens"]
    print(f"{'window-only':<12} {'pages':>7} {'slots':>6} {'pool MiB':>9} "
          f"{'full seqs':>10} {'peak held MiB':>14} {'tok/s':>7}")
    for m in measured:
        print(f"{'on' if m['window_kv'] else 'off':<12} {m['pages']:>7} {m['slots']:>6} "
              f"{m['pool_bytes'] / 2**20:>9.1f} {m['full_sequences']:>10} "
              f"{m['peak_held'] / 2**20:>14.1f} {m['tokens_per_s']:>7.1f}")
    print(f"greedy tokens identical: {same}")
    for m in measured:
        m.pop("tokens")
    return {"plan": rows, "measured": measured, "same_tokens": same}
