"""Which schemas only an infinite value matches: refused before admission, since
llguidance gets stuck on them only when the answer reaches them."""

from typing import Any

import pytest

from mlxserve.server.schema_values import infinite_only

LOOP = {"a": {"$ref": "#/$defs/a"}}
TO_LOOP = {"$ref": "#/$defs/a"}
NODE = {
    "type": "object",
    "properties": {"next": {"$ref": "#/$defs/node"}},
    "required": ["next"],
}


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"$ref": "#"}, "#"),
        ({"$ref": "#/$defs/a", "$defs": LOOP}, "#"),
        (
            {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": LOOP},
            "#/properties/x",
        ),
        (
            {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1, "$defs": LOOP},
            "#/items",
        ),
        ({"$ref": "#/$defs/node", "$defs": {"node": NODE}}, "#"),
        ({"allOf": [{"$ref": "#"}]}, "#/allOf/0"),
        ({"$ref": "#/$defs/a~1b", "$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}}, "#"),
        ({"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}, "#"),
    ],
)
def test_recursion_with_no_way_out_is_found(schema: dict[str, Any], where: str) -> None:
    assert infinite_only(schema) == where


@pytest.mark.parametrize(
    "schema",
    [
        # Trees and lists: the recursion has a way out (an empty array, a null, an
        # optional key, another branch).
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
        {
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"],
        },
        {
            "$ref": "#/$defs/node",
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                    "required": ["next"],
                }
            },
        },
        {"oneOf": [{"$ref": "#"}, {"type": "string"}]},
        # Without a type a value need not be an object: a string matches.
        {"properties": {"n": {"$ref": "#"}}, "required": ["n"]},
        # Not recursion: llguidance's to judge ("x": false forbids the key).
        {"type": "object", "properties": {"x": False}},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        # A definition no $ref uses is not part of the schema.
        {"type": "string", "$defs": LOOP},
        # Refs it cannot resolve are llguidance's to refuse.
        {"$ref": "https://example.com/schema"},
        {"$ref": "#/$defs/missing"},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        True,
    ],
)
def test_schemas_with_finite_values_pass(schema: Any) -> None:
    assert infinite_only(schema) is None


def test_a_long_chain_of_refs_is_linear() -> None:
    """Each part changes at most once (a worklist): a 20 000-link chain is quick."""
    n = 20_000
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"$ref": "#/$defs/d0"}
    assert infinite_only({"$ref": "#/$defs/d0", "$defs": defs}) == "#"
