"""Benchmarks as a package: ``jaxkv bench NAME`` runs module ``jaxkv.bench.NAME`` (see `cli`);
`common` holds what they share; `sim` the serving simulator behind ``bench sim-disagg``."""
