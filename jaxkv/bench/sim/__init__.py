"""The serving simulator behind `jaxkv bench sim-disagg`: `step_models` (seconds per step, and
their measurement), `serving_sim` (the discrete-event core), `disagg` (scenarios, goodput,
the report)."""
