"""OpenAI's strict mode: the JSON schemas it takes, and a 400 naming what it refuses.

``strict: true`` (a function's, ``response_format.json_schema``'s, the Responses
API's ``text.format``) promises an answer that follows the schema exactly. OpenAI
keeps that promise with a subset of JSON Schema and refuses any other schema; so
does mlxserve, so a schema that works here works there and the other way round.
Within the subset the grammar (llguidance) enforces every keyword, so strict
arguments always validate against the schema they were asked for.

The rules, from OpenAI's Structured Outputs guide, "Supported schemas"
(https://platform.openai.com/docs/guides/structured-outputs#supported-schemas):

- the root is an object (``type: "object"``), not an ``anyOf``;
- every object sets ``additionalProperties: false`` and lists every one of its
  properties in ``required`` (an optional value is a union with ``null``);
- types: string, number, integer, boolean, object, array, null (alone or in a
  list), enum, const and ``anyOf`` (each branch in the subset), local ``$ref`` s to
  ``$defs`` / ``definitions`` (recursion allowed);
- keywords: strings ``pattern``, ``format`` (date-time, time, date, duration, email,
  hostname, ipv4, ipv6, uuid); numbers ``multipleOf``, ``maximum``,
  ``exclusiveMaximum``, ``minimum``, ``exclusiveMinimum``; arrays ``minItems``,
  ``maxItems``; and annotations (``title``, ``description``...). Not supported:
  ``allOf``, ``not``, ``dependentRequired``, ``dependentSchemas``, ``if``, ``then``,
  ``else``, and any keyword the guide does not name (``oneOf``, ``patternProperties``,
  ``uniqueItems``...). ``minLength`` / ``maxLength`` are taken: the guide names them
  only among what fine-tuned models do not support, and llguidance enforces them;
- limits: at most 5000 object properties in all, 10 levels of object nesting,
  120,000 characters of property names, definition names, enum and const values,
  1000 enum values in all, and 15,000 characters for one string enum of more than
  250 values.

mlxserve adds what the guide implies: every schema says what its values are (a
``type``, ``enum``, ``const``, ``anyOf`` or ``$ref``: ``{}`` would let any object
in), an array says what its ``items`` are, and a keyword applies to a type the
schema names (``pattern`` needs ``type: "string"``). Nesting counts objects: the
root is level 1, a ``$defs`` entry counts from the root's level.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlxserve.server.errors import InvalidRequest

GUIDE = "https://platform.openai.com/docs/guides/structured-outputs#supported-schemas"

MAX_PROPERTIES = 5000
MAX_OBJECT_LEVELS = 10
MAX_TEXT_CHARS = 120_000
MAX_ENUM_VALUES = 1000
#: One string enum of more than this many values ...
LARGE_ENUM = 250
#: ... holds at most this many characters in all.
LARGE_ENUM_CHARS = 15_000

TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
FORMATS = ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "deprecated", "$comment", "$schema", "$id"}
)
_ANY_TYPE = frozenset({"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions"})
_NUMBER = frozenset({"multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"})
_FOR_TYPE = {
    "string": frozenset({"pattern", "format", "minLength", "maxLength"}),
    "number": _NUMBER,
    "integer": _NUMBER,
    "array": frozenset({"items", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
}
#: The keywords the guide names as not supported.
UNSUPPORTED = ("allOf", "not", "dependentRequired", "dependentSchemas", "if", "then", "else")


def refuse_unstrict(schema: Any, param: str) -> None:
    """A 400 naming the part of ``schema`` (under ``param``) that strict mode refuses."""
    problem = strict_problem(schema)
    if problem is not None:
        where, message = problem
        at = ".".join([param, *where])
        raise InvalidRequest(
            f"{at}: {message} (strict: true takes OpenAI's strict subset of JSON Schema, "
            f"{GUIDE}; or send strict: false)",
            param=at,
        )


def strict_problem(schema: Any) -> tuple[list[str], str] | None:
    """The first part of ``schema`` strict mode refuses, as its path of keys, and why."""
    walk = _Walk()
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return [], 'the root must be an object schema (type: "object")'
    if "anyOf" in schema:
        return ["anyOf"], "the root must not be an anyOf"
    problem = next(walk.problems(schema, [], 0), None)
    return problem if problem is not None else walk.totals()


@dataclass
class _Walk:
    properties: int = 0
    enum_values: int = 0
    text_chars: int = 0

    def problems(self, node: Any, at: list[str], levels: int) -> Iterator[tuple[list[str], str]]:
        """Each problem of ``node`` (at ``at``, inside ``levels`` objects), first first."""
        if not isinstance(node, dict):
            yield at, "a schema must be an object (not a boolean schema)"
            return
        types, problem = _types(node)
        if problem is not None:
            yield [*at, "type"], problem
            return
        if "$ref" in node:
            allowed = ANNOTATIONS | {"$ref", "$defs", "definitions"}
        else:
            allowed = ANNOTATIONS | _ANY_TYPE.union(*(_FOR_TYPE.get(t, ()) for t in types))
        for key in node:
            if key not in allowed:
                yield [*at, key], _unsupported(key, node, types)
                return
        if "format" in node and node["format"] not in FORMATS:
            yield [*at, "format"], f"format {node['format']!r} is not one of {', '.join(FORMATS)}"
            return
        if not types and not {"enum", "const", "anyOf", "$ref"} & node.keys():
            yield at, "a strict schema says what its values are: a type, enum, const, anyOf or $ref"
            return
        yield from self._values(node, at)
        if "object" in types:
            levels += 1
            if levels > MAX_OBJECT_LEVELS:
                yield at, f"objects nest at most {MAX_OBJECT_LEVELS} levels deep"
                return
            yield from self._object(node, at, levels)
        if "array" in types:
            if not isinstance(node.get("items"), dict):
                yield [*at, "items"], "an array says what its items are (one schema)"
                return
            yield from self.problems(node["items"], [*at, "items"], levels)
        branches = node.get("anyOf")
        if branches is not None:
            if not isinstance(branches, list) or not branches:
                yield [*at, "anyOf"], "anyOf is a non-empty list of schemas"
                return
            for i, branch in enumerate(branches):
                yield from self.problems(branch, [*at, "anyOf", str(i)], levels)
        ref = node.get("$ref")
        if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
            yield [*at, "$ref"], "only local references (#, #/$defs/...) are supported"
        for key in ("$defs", "definitions"):
            defs = node.get(key)
            if defs is None:
                continue
            if not isinstance(defs, dict):
                yield [*at, key], f"{key} maps names to schemas"
                return
            for name, schema in defs.items():
                self.text_chars += len(name)
                yield from self.problems(schema, [*at, key, name], levels)

    def _values(self, node: dict[str, Any], at: list[str]) -> Iterator[tuple[list[str], str]]:
        """Count the enum and const values (their number and their text)."""
        if "const" in node and isinstance(node["const"], str):
            self.text_chars += len(node["const"])
        if "enum" not in node:
            return
        values = node["enum"]
        if not isinstance(values, list) or not values:
            yield [*at, "enum"], "enum is a non-empty list"
            return
        self.enum_values += len(values)
        chars = sum(len(value) for value in values if isinstance(value, str))
        self.text_chars += chars
        strings = all(isinstance(value, str) for value in values)
        if strings and len(values) > LARGE_ENUM and chars > LARGE_ENUM_CHARS:
            yield (
                [*at, "enum"],
                (
                    f"an enum of more than {LARGE_ENUM} strings holds at most "
                    f"{LARGE_ENUM_CHARS} characters, not {chars}"
                ),
            )

    def _object(
        self, node: dict[str, Any], at: list[str], levels: int
    ) -> Iterator[tuple[list[str], str]]:
        if node.get("additionalProperties") is not False:
            where = [*at, "additionalProperties"] if "additionalProperties" in node else at
            yield where, "every object must set additionalProperties: false"
            return
        properties = node.get("properties", {})
        if not isinstance(properties, dict):
            yield [*at, "properties"], "properties maps names to schemas"
            return
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            yield [*at, "required"], "required is a list of property names"
            return
        for name in required:
            if name not in properties:
                yield [*at, "required"], f"{name!r} is required but not among the properties"
                return
        self.properties += len(properties)
        for name, schema in properties.items():
            self.text_chars += len(name)
            if name not in required:
                yield (
                    [*at, "properties", name],
                    f"every property must be required; {name!r} is not (an optional value is "
                    'a union with null: "type": ["string", "null"])',
                )
                return
            yield from self.problems(schema, [*at, "properties", name], levels)

    def totals(self) -> tuple[list[str], str] | None:
        if self.properties > MAX_PROPERTIES:
            return [], f"at most {MAX_PROPERTIES} object properties in all, not {self.properties}"
        if self.enum_values > MAX_ENUM_VALUES:
            return [], f"at most {MAX_ENUM_VALUES} enum values in all, not {self.enum_values}"
        if self.text_chars > MAX_TEXT_CHARS:
            return [], (
                f"property names, definition names, enum and const values hold at most "
                f"{MAX_TEXT_CHARS} characters in all, not {self.text_chars}"
            )
        return None


def _types(node: dict[str, Any]) -> tuple[list[str], str | None]:
    """The types ``node`` names (none: no ``type``), or why its ``type`` is refused."""
    given = node.get("type")
    if given is None:
        return [], None
    types = [given] if isinstance(given, str) else given
    if not isinstance(types, list) or not types or len(set(map(str, types))) != len(types):
        return [], "type is a type name or a list of distinct ones"
    for name in types:
        if name not in TYPES:
            return [], f"type {name!r} is not one of {', '.join(TYPES)}"
    return types, None


def _unsupported(key: str, node: dict[str, Any], types: list[str]) -> str:
    if key in UNSUPPORTED:
        return f"{key} is not supported in strict mode"
    owners = [name for name, keys in _FOR_TYPE.items() if key in keys]
    if "$ref" in node:
        return f"{key} next to a $ref is not supported in strict mode (only annotations)"
    if owners:
        return f"{key} applies to type {' or '.join(owners)}, which this schema does not name"
    return f"{key} is not among the keywords strict mode supports"
