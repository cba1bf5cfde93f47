"""Host-side KV bookkeeping: page allocator, prefix cache, memory planning (plain Python, no jax)."""
