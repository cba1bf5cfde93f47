"""Ahead-of-time compile checks for real accelerators, run on a CPU machine (``make test-aot``).

These tools drive the TPU and GPU compilers through private jax modules (the Triton pipeline,
the lowering of Pallas calls); they live under tests/ so that the library never imports them.
"""
