"""`StructuredOutputsParams`: what a request's output must match (vLLM's field names), checked
on the host (no jax, no grammar backend)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Whitespace between JSON tokens by default: bounded, since a small model may otherwise write
# newlines until max_tokens (pretty-printed JSON still fits: a newline and 19 of indentation).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    - ``json``: a JSON schema (a dict, or its JSON text): the output is a JSON value valid
      against it;
    - ``regex``: the output matches the regular expression in full (Rust regex syntax);
    - ``choice``: the output is one of these strings;
    - ``grammar``: a context-free grammar, in Lark syntax or llama.cpp's GBNF (``::=`` rules,
      ``root`` first);
    - ``json_object=True``: any JSON object.

    Between JSON tokens, whitespace matches ``whitespace_pattern`` (a regex; default: at most
    20 spaces, tabs and newlines, so a model cannot write whitespace until max_tokens);
    ``disable_any_whitespace`` allows none. Invalid values raise ValueError naming the
    field; a schema or grammar the backend cannot compile, or that could not be served (no
    output of it can ever be complete), is named when the request is added
    (`jaxkv.structured.grammar`).
    """

    json: object = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        name = "structured_outputs"
        given = [k for k in KINDS if getattr(self, k) is not None and
                 (k != "json_object" or self.json_object is not False)]
        if len(given) != 1:
            raise ValueError(f"{name}: give exactly one of {', '.join(KINDS)} "
                             f"(got {', '.join(given) or 'none'})")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name}.json: not JSON: {e}") from None
            if not isinstance(schema, Mapping):
                raise ValueError(f"{name}.json must be a JSON schema (an object), got "
                                 f"{schema!r}")
            object.__setattr__(self, "json", schema)
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}.{field} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or \
                    not all(isinstance(c, str) for c in choice):
                raise ValueError(f"{name}.choice must be a non-empty list of strings, got "
                                 f"{choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"{name}.json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"{name}.disable_any_whitespace must be a bool")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(f"{name}.whitespace_pattern must be a regex string")
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise ValueError(f"{name}.whitespace_pattern: disable_any_whitespace allows none")
        if (self.whitespace_pattern is not None or self.disable_any_whitespace) and \
                given[0] not in ("json", "json_object"):
            field = "whitespace_pattern" if self.whitespace_pattern is not None \
                else "disable_any_whitespace"
            raise ValueError(f"{name}.{field} is for json and json_object, not {given[0]}")

    @classmethod
    def of(cls, value) -> StructuredOutputsParams | None:
        """From a StructuredOutputsParams, a dict of its fields (as JSON gives them) or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs must be a dict or StructuredOutputsParams, "
                             f"got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: unknown field (known: "
                             f"{', '.join(sorted(fields))})")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and
                    (k != "json_object" or self.json_object is not False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the compile cache's key)."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace, self.whitespace_pattern
