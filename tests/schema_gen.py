"""Random JSON schemas for the structured-output tests: nested objects, arrays, enums,
required fields, numbers with ranges, strings with patterns and lengths."""

from __future__ import annotations

import random
from typing import Any

_PATTERNS = [r"^[a-z]{1,6}$", r"^[A-Z][a-z]{0,5}$", r"^[0-9]{2,4}$", r"^(red|green|blue)$"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-4 properties (some required)."""
    names = rng.sample(["id", "name", "count", "tags", "score", "kind", "meta", "ok"], 4)
    props = {n: _value(rng, depth) for n in names[: rng.randint(1, 4)]}
    required = [n for n in props if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(["alpha", "beta", "gamma", "delta", 1, 2, None], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = _value(rng, depth + 1) if depth < 2 else {"type": "integer"}
        return {"type": "array", "items": item, "minItems": 0, "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
