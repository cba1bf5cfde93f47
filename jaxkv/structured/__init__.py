"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a
grammar (`StructuredOutputsParams`), by a token mask applied on device at every step."""

from jaxkv.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
