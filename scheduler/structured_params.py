"""What a request asks its output to match: a JSON schema, any JSON object, a regex, one of
a set of strings, or a Lark grammar (vLLM's `structured_outputs` names).

A leaf module (standard library only). The grammar engine lives in `jaxserve.structured`;
here are only the request-side parameters, validated on construction, and the handle
protocol the scheduler uses to hold a request back until its grammar is compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar longer than 1 MiB is refused
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields is set.

    ``json`` is a JSON schema, as a dict or as JSON text (normalised to a dict, so two
    spellings of one schema share a compiled grammar); ``json_object`` any JSON object;
    ``choice`` a non-empty list of strings, one of which is the whole output.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if self._is_set(k)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                f"must be given, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError(f"structured_outputs.json: a JSON schema must be an object, got {type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if len(self.key) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{self.kind}: longer than {MAX_SPEC_CHARS} characters")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a mapping of the same fields (the APIs' JSON); unknown fields are an error."""
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {sorted(unknown)}")
        return cls(**fields)

    def _is_set(self, kind: str) -> bool:
        v = getattr(self, kind)
        return v is not False and v is not None

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if self._is_set(k))

    @property
    def key(self) -> str:
        """A canonical string of the spec: equal keys compile to the same grammar."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return f"{self.kind}:{value}"


class GrammarHandle(Protocol):
    """A grammar being compiled off the engine thread (see `jaxserve.structured`)."""

    def ready(self) -> bool:
        """True once compiled or failed: the request may leave the grammar queue."""
        ...

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled (None while pending or on success)."""
        ...
