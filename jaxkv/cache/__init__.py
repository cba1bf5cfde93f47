"""Host-side KV bookkeeping: page allocator, prefix cache, memory planning (no jax)."""
