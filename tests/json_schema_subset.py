"""A validator for the subset of JSON Schema that ``docs/verify-card.schema.json`` uses.

``jsonschema`` is not a dependency. This checks ``type`` (one name or a list), ``enum``,
``required``, ``properties``, ``additionalProperties`` (a boolean or a schema), ``items``,
``minimum`` and ``pattern``; annotations (``$schema``, ``$id``, ``title``, ``description``) are
ignored, and any other keyword is refused so that the schema cannot use one this does not check.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["schema_errors"]

_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_ANNOTATIONS = {"$schema", "$id", "title", "description"}
_CHECKED = {"type", "enum", "required", "properties", "additionalProperties", "items", "minimum", "pattern"}


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema``, each as ``"<json path>: <what>"`` (empty: valid)."""
    unknown = set(schema) - _ANNOTATIONS - _CHECKED
    if unknown:
        raise ValueError(f"{path}: schema keyword(s) {sorted(unknown)} are outside the supported subset")
    errors: list[str] = []
    if "type" in schema:
        names = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        if not any(_TYPES[n](value) for n in names):
            return [f"{path}: {value!r} is not of type {' or '.join(names)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _TYPES["number"](value) and value < schema["minimum"]:
        errors.append(f"{path}: {value} < {schema['minimum']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    if isinstance(value, dict):
        errors += [f"{path}: required {k!r} is missing" for k in schema.get("required", ()) if k not in value]
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in properties:
                errors += schema_errors(v, properties[k], f"{path}.{k}")
            elif extra is False:
                errors.append(f"{path}: property {k!r} is not allowed")
            elif isinstance(extra, dict):
                errors += schema_errors(v, extra, f"{path}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors
