"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``), validated.

Plain Python: the engine imports it. Exactly one constraint per request; sizes are bounded here,
whether the constraint compiles is the grammar compiler's call (``pagellm.structured.grammar``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 64 * 1024
"""A schema, regex or grammar longer than this (as text) is refused before compiling."""
MAX_SCHEMA_DEPTH = 64
"""A JSON schema whose text nests objects and arrays deeper than this is refused before
compiling: xgrammar's compile time grows steeply with nesting, on the pool every structured
request shares (an array schema 950 deep took 62 s here, 128 deep 0.4 s, 64 deep 0.1 s; 36
branches 62 deep, filling ``MAX_SPEC_CHARS``, 2.2 s)."""
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024

KINDS = ("json", "regex", "choice", "grammar", "json_object")


_SCHEMA_DATA = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not schemas (a ``$ref`` inside is not a reference)."""


def map_schema_refs(schema: Any, change: Callable[[str], str]) -> Any:
    """A copy of a JSON schema with each ``$ref`` replaced by ``change(ref)``."""
    if isinstance(schema, list):
        return [map_schema_refs(item, change) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            out[key] = change(value)
        elif key in _SCHEMA_DATA:
            out[key] = value
        else:
            out[key] = map_schema_refs(value, change)
    return out


class StructuredOutputError(ValueError):
    """A constraint that is malformed or cannot be compiled; ``param`` names the field."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


class CompileDeadline(StructuredOutputError):
    """The compile used more than its deadline of CPU (its worker was killed); cached as the
    compiler's own errors are."""


class CompileCrashed(StructuredOutputError):
    """The worker died compiling it: likely the constraint's doing, but not certainly (an
    out-of-memory kill), so it is not cached."""


class CompileAborted(StructuredOutputError):
    """The server could not compile it now (a worker did not start, the compiler was shut
    down, the machine too busy to give the compile its CPU): a 503, not cached."""


class CompileQueueFull(Exception):
    """Too many compiles are waiting for a new one to be queued (the server answers 503)."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One of: ``json`` (a JSON schema, as text or a mapping), ``regex``, ``choice`` (one of
    these strings), ``grammar`` (EBNF, xgrammar's dialect of GBNF) or ``json_object`` (any JSON
    object). ``disable_any_whitespace``: JSON without free whitespace between tokens."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(given) or 'none'})"
            )
        if self.choice is not None:
            _check_choices(self.choice)
        text = self.spec_text  # a mapping's JSON is made once here
        if len(text) > MAX_SPEC_CHARS:
            raise StructuredOutputError(
                f"the {self.kind} constraint is longer than {MAX_SPEC_CHARS} characters"
            )
        if self.kind == "json" and (depth := json_depth(text)) > MAX_SCHEMA_DEPTH:
            raise StructuredOutputError(
                f"the json schema nests {depth} levels of objects and arrays (at most "
                f"{MAX_SCHEMA_DEPTH})"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec_text(self) -> str:
        """The constraint as text (a schema mapping as JSON, choices as a JSON list)."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        """What decides the compiled grammar: equal keys compile once."""
        return (self.kind, self.spec_text, self.disable_any_whitespace)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deep objects and arrays nest in JSON ``text`` (strings skipped; no recursion, so
    any depth is measured)."""
    depth = deepest = 0
    for bracket in _BRACKET.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _check_choices(choice: Any) -> None:
    ok = isinstance(choice, list) and 0 < len(choice) <= MAX_CHOICES
    if not ok or not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in choice):
        raise StructuredOutputError(
            f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings of at most "
            f"{MAX_CHOICE_CHARS} characters"
        )
