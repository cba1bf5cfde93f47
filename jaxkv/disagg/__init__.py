"""Prefill/decode disaggregation: prompts run on one engine, decoding on another.

Reading order:

- `connector`: the scheduler halves (`PrefillConnector` holds a request's pages after its
  prompt ran; `DecodeConnector` reserves pages for it on the decode side), plugged into each
  engine's scheduler through `Engine.use_connector` (`jaxkv.engine.connector` is the seam);
- `transport`: the worker half, moving page runs between pools (`PageTransport`), with
  `kv_transfer.PageMover` (one process, device to device) and `FakeTransport` (through host
  memory, deliveries a test can hold back);
- `engine`: `DisaggregatedEngine`, both engines in one process (the `Engine` API);
- `remote`, `remote_decode`, `kv_remote`, `serve`: the same across two processes, pages
  moving over jax.experimental.transfer, each worker serving a front end.

Disaggregation touches an engine only through its public methods (`dispatch`/`collect`,
`take_request`/`adopt_request`, `write_kv`, `use_connector`, ...).
"""

__all__ = ["DisaggregatedEngine", "TransferStats"]


def __getattr__(name: str):
    # Imported on first use, so the host-only `connector` loads without jax.
    if name in __all__:
        from jaxkv.disagg import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'jaxkv.disagg' has no attribute {name!r}")
