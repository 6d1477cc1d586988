"""What a request asks its output to match."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import cast

KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint: ``json_schema`` (a schema as JSON text or dict), ``json_object`` (any
    JSON object), ``regex`` (the whole output matches it) or ``grammar`` (Lark syntax)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "json_schema":  # one text per schema as given (its key order kept): the cache key
            try:
                schema = json.loads(self.value) if isinstance(self.value, str) else self.value
                object.__setattr__(self, "value", json.dumps(schema, separators=(",", ":")))
            except (ValueError, TypeError):
                pass  # not JSON: compiling it reports the error
        if not isinstance(self.value, str) or (self.kind != "json_object" and not self.value):
            raise ValueError(f"structured output {self.kind} needs a non-empty value")

    @classmethod
    def json(cls, schema: dict | str | None = None) -> StructuredOutput:
        """A JSON schema, or any JSON object when `schema` is None."""
        # a dict schema becomes its JSON text in __post_init__
        return cls("json_object") if schema is None else cls("json_schema", cast("str", schema))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, lark: str) -> StructuredOutput:
        return cls("grammar", lark)
