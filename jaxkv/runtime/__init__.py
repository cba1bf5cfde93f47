"""The jit-compiled core: batch building, prefill/decode steps and sampling."""
