"""The transformers side of `bench throughput` and `bench peers`: one checkpoint through
``generate`` (left-padded, masked, greedy, exactly the requested new tokens) and through
transformers' continuous batching (``generate_batch``, paged). torch is imported only here."""

from __future__ import annotations

import time


def load(folder, threads: int):
    """The checkpoint as an fp32 transformers model in eval mode, torch on ``threads`` threads."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def left_padded(prompts, pad_id: int = 0):
    """(input_ids, attention_mask), both long [len(prompts), longest]: prompts right-aligned."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def generate_batches(hf, prompts, new_tokens: int, batch: int, pad_id: int = 0):
    """Greedy generate in batches of ``batch`` (with batches smaller than the prompts, similar
    lengths go together: less padding); (outputs in prompt order, tokens generated)."""
    import torch

    order = list(range(len(prompts)))
    if batch < len(prompts):
        order.sort(key=lambda i: len(prompts[i]))
    results: list[list[int] | None] = [None] * len(prompts)
    generated = 0
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        ids, mask = left_padded([prompts[i] for i in idx], pad_id)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=pad_id)
        new = out[:, ids.shape[1]:]
        generated += new.numel()
        for row, i in enumerate(idx):
            results[i] = new[row].tolist()
    return results, generated


def generate_round(hf, prompts, new: int, pad_id: int = 0):
    """One static batch of every prompt: (outputs, TTFTs, TPOTs), timed by a streamer."""
    import torch

    ids, mask = left_padded(prompts, pad_id)
    width = ids.shape[1]
    times = []

    class Clock:  # a streamer: the time each step's tokens come out (the first: the prompt)
        def put(self, _):
            times.append(time.perf_counter())

        def end(self):
            pass

    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id,
                          streamer=Clock())
    first = times[1] - t if len(times) > 1 else times[-1] - t
    tpot = (times[-1] - times[1]) / max(new - 1, 1) if len(times) > 2 else 0.0
    outs = [out[row, width:].tolist() for row in range(len(prompts))]
    return outs, [first] * len(prompts), [tpot] * len(prompts)


def continuous_batching_round(hf, prompts, new: int):
    """The prompts through ``generate_batch``: (outputs, TTFTs, TPOTs) from its timestamps."""
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)
    res = hf.generate_batch(prompts, generation_config=config, record_timestamps=True,
                            progress_bar=False, warmup=False)
    by_prompt = sorted(res.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    outs, ttft, tpot = [], [], []
    for r in by_prompt:
        outs.append(list(r.generated_tokens)[:new])
        ts = r.timestamps or []
        if ts:
            ttft.append(ts[0] - r.created_time)
            tpot.append((ts[-1] - ts[0]) / max(len(ts) - 1, 1))
    return outs, ttft, tpot
