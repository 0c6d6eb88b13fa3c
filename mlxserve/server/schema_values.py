"""Find the part of a JSON schema that only an infinite value could match.

A ``$ref`` that recurses with no way out (``a: {$ref: a}``, or an object that
requires a property of its own type) describes no finite JSON value. llguidance
compiles such a schema without complaint and gets stuck only when generation
reaches that part: at the first token if it is the whole schema, else in the
middle of the answer (even under an optional property: it lets the key be
written, then nothing can follow). In the engine that is a failed request after
a slot was taken and tokens were spent, so the front refuses the schema first.

How: a sub-schema "has a finite value" by the least fixed point of the rules
below (recursion assumed to fail until a way out is found), and "could have one"
by the greatest (recursion assumed to succeed). The parts where the two differ
are exactly those that only infinite recursion could satisfy; a part without a
value for another reason (``false``, conflicting types) is llguidance's to judge,
as it already does (``Unsatisfiable schema``). Keywords not modelled here count
as satisfiable, so a schema is only refused when it certainly has such a part.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

#: Keywords whose value is one sub-schema / a list of them / a mapping of them. Not
#: ``$defs``: a definition is part of the schema only where a ``$ref`` uses it.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "if", "then", "else")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAPPED = ("properties", "patternProperties", "dependentSchemas")


def infinite_only(schema: Any) -> str | None:
    """The JSON pointer (``#/properties/x``) of the first part of ``schema`` that only
    an infinite value could match, a ``$ref`` where it can be told; None: no such part."""
    nodes = _Nodes(schema)
    least = nodes.fixed_point(start=False)
    greatest = nodes.fixed_point(start=True)
    stuck = [at for at in nodes.order if not least[at] and greatest[at]]
    if not stuck:
        return None
    refs = [at for at in stuck if isinstance(nodes.schema[at], dict) and "$ref" in nodes.schema[at]]
    return (refs or stuck)[0]


class _Nodes:
    """Every sub-schema reachable from the root (through the keywords and the local
    ``$ref`` s), by JSON pointer, with the sub-schemas each one's value depends on."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.schema: dict[str, Any] = {}
        self.order: list[str] = []  # breadth first: the shallowest part is named
        self.needs: dict[str, list[str]] = {}
        self.ref: dict[str, str] = {}  # a part's local $ref: the pointer it resolves to
        queue: deque[tuple[str, Any]] = deque([("#", root)])
        while queue:
            at, node = queue.popleft()
            if at in self.schema:
                continue
            self.schema[at] = node
            self.order.append(at)
            self.needs[at] = []
            for child_at, child in self._children(at, node):
                self.needs[at].append(child_at)
                queue.append((child_at, child))

    def _children(self, at: str, node: Any) -> Iterator[tuple[str, Any]]:
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = self._resolve(ref)
            if target is not None:
                self.ref[at] = target[0]
                yield target
        for key in _ONE:
            if isinstance(node.get(key), dict | bool):
                yield f"{at}/{key}", node[key]
        for key in _MANY:
            if isinstance(node.get(key), list):
                for i, child in enumerate(node[key]):
                    yield f"{at}/{key}/{i}", child
        for key in _MAPPED:
            if isinstance(node.get(key), dict):
                for name, child in node[key].items():
                    yield f"{at}/{key}/{_escape(name)}", child

    def _resolve(self, ref: str) -> tuple[str, Any] | None:
        """A local ref's sub-schema, and its pointer as the walk names it (None: not
        local, or not there)."""
        if ref != "#" and not ref.startswith("#/"):
            return None  # another document, an anchor: llguidance's to resolve or refuse
        parts = ref[2:].split("/") if ref != "#" else []
        keys = [unquote(part).replace("~1", "/").replace("~0", "~") for part in parts]
        node = self.root
        for key in keys:
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return "#" + "".join(f"/{_escape(key)}" for key in keys), node

    def fixed_point(self, *, start: bool) -> dict[str, bool]:
        """Whether each part has a value, from ``start`` for all until nothing changes
        (each part changes at most once: a worklist, not rounds over every part)."""
        value = dict.fromkeys(self.order, start)
        users: dict[str, list[str]] = {at: [] for at in self.order}
        for at, needs in self.needs.items():
            for need in needs:
                users[need].append(at)
        work = deque(self.order)
        while work:
            at = work.popleft()
            now = _has_value(self.schema[at], at, value, self)
            if now != value[at]:
                value[at] = now
                work.extend(users[at])
        return value


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _has_value(node: Any, at: str, value: dict[str, bool], nodes: _Nodes) -> bool:
    """Whether ``node`` has a value, given what is known of its parts."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    target = nodes.ref.get(at)
    if target is not None and not value[target]:
        return False
    if not all(value[f"{at}/allOf/{i}"] for i in range(_count(node, "allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        count = _count(node, key)
        if count and not any(value[f"{at}/{key}/{i}"] for i in range(count)):
            return False
    types = node.get("type")
    if types is None:
        return True  # any type may match: one without structure always has a value
    kinds = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    return not kinds or any(_kind_has_value(node, at, kind, value) for kind in kinds)


def _kind_has_value(node: dict[str, Any], at: str, kind: Any, value: dict[str, bool]) -> bool:
    if kind == "object":
        properties = node.get("properties")
        required = node.get("required")
        if not isinstance(properties, dict) or not isinstance(required, list):
            return True
        return all(
            value[f"{at}/properties/{_escape(key)}"]
            for key in required
            if isinstance(key, str) and key in properties
        )
    if kind == "array":
        return _array_has_value(node, at, value)
    return True


def _array_has_value(node: dict[str, Any], at: str, value: dict[str, bool]) -> bool:
    """Its first ``minItems`` items each have a value (no item needs none)."""
    least = node.get("minItems")
    least = least if isinstance(least, int) else 0
    prefix_key, rest_key = "", "items"  # no tuple form: every item follows "items"
    if isinstance(node.get("prefixItems"), list):
        prefix_key = "prefixItems"
    elif isinstance(node.get("items"), list):  # the older tuple form
        prefix_key, rest_key = "items", "additionalItems"
    prefix: list[Any] = node[prefix_key] if prefix_key else []
    if not all(value[f"{at}/{prefix_key}/{i}"] for i in range(min(least, len(prefix)))):
        return False
    if least > len(prefix) and isinstance(node.get(rest_key), dict | bool):
        return value[f"{at}/{rest_key}"]
    return True


def _count(node: dict[str, Any], key: str) -> int:
    items = node.get(key)
    return len(items) if isinstance(items, list) else 0
