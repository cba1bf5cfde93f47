"""How many bytes of KV pages an `LLM` allocates when the user names no size.

Like vLLM's ``gpu_memory_utilization``: on a GPU/TPU the pool gets ``fraction`` of the device's
memory, less what is in use once the weights are loaded (the device's own ``memory_stats``),
less an estimate of the largest step's activations (the step's temporaries, the last tokens'
logits and the sampler's rows). On CPU, where the pool is host RAM that tests, the tokenizer
and the compiler share, it gets ``fraction`` of the RAM available now, capped at
``CPU_KV_CACHE_BYTES``, 2 GiB (vLLM's CPU backend reserves 4 GiB; a small development machine
runs several engines at once).

The result is then capped by what can be used: ``max_num_seqs`` sequences at
``max_model_len`` each (`LLM` does that), so a small model never reserves gigabytes it cannot
fill.
"""

from __future__ import annotations

import dataclasses

import jax

CPU_KV_CACHE_BYTES = 2 * 2**30


@dataclasses.dataclass(frozen=True)
class KVBudget:
    bytes: int
    source: str  # how it was found, for the log line


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def activation_bytes(config, max_num_batched_tokens: int, max_num_seqs: int,
                     dtype_bytes: int) -> int:
    """An upper estimate of one step's live activations: per token the residual stream,
    q/k/v, attention output and the MLP's gate/up/product (f32 where the model upcasts), and
    per row the f32 logits with the sampler's few [B, V] temporaries."""
    c = config
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_token = (4 * c.hidden_size + qkv + c.num_heads * c.head_dim + 3 * c.intermediate_size)
    return (max_num_batched_tokens * per_token * max(dtype_bytes, 4)
            + 4 * max_num_seqs * c.vocab_size * 4)


def kv_budget(config, *, fraction: float, max_num_batched_tokens: int, max_num_seqs: int,
              dtype_bytes: int, device=None, pending_bytes: int = 0) -> KVBudget:
    """Bytes for KV pages on ``device`` (default: the first device). ``pending_bytes``: weights
    the device will hold that are not on it yet (a model loaded on the host, placed later)."""
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction!r}")
    device = device or jax.devices()[0]
    stats = None
    if device.platform != "cpu":
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - some backends have none
            stats = None
    if not stats or "bytes_limit" not in stats:
        avail = available_host_bytes()
        size = min(int(fraction * avail), CPU_KV_CACHE_BYTES)
        return KVBudget(size, f"min({fraction:g} x {avail / 2**30:.1f} GiB of available RAM, "
                              f"{CPU_KV_CACHE_BYTES / 2**30:g} GiB)")
    limit = stats["bytes_limit"]
    used = stats.get("bytes_in_use", 0) + pending_bytes  # weights, other engines' pools
    act = activation_bytes(config, max_num_batched_tokens, max_num_seqs, dtype_bytes)
    size = int(fraction * limit) - used - act
    if size <= 0:
        raise ValueError(
            f"kv_cache_memory_fraction={fraction:g} leaves no room for KV pages on "
            f"{device.device_kind}: {limit / 2**30:.1f} GiB x {fraction:g}, "
            f"{used / 2**30:.2f} GiB in use (weights), ~{act / 2**30:.2f} GiB for activations")
    return KVBudget(size, f"{fraction:g} x {limit / 2**30:.1f} GiB on {device.device_kind} - "
                          f"{used / 2**30:.2f} GiB in use - ~{act / 2**30:.2f} GiB activations")
