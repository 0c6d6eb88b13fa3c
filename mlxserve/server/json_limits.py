"""Request bodies parsed with limits: how deep JSON may nest, how long a number may be.

Why: the stdlib parser recurses once per level and gives up near Python's
recursion limit with a RecursionError, and converting an integer literal of more
than 4300 digits raises a ValueError; neither is a JSONDecodeError, so a body
nested 1000 deep or an integer of 5000 digits was a 500, and the connection was
reset. Short of those, a deep body weighs on every recursive walk after the parse
(validation, the checks, the grammar compiler) and a long integer takes quadratic
time to convert. Past either limit the answer is a 400 naming the field.

Cheap for bodies of megabytes: the C parser does the work, and the limits cost two
byte counts and one translate-and-find over the raw bytes (about 1 ms per MB).
Only a body that might break one (more brackets than levels allowed, or a run of
digits that a number too long must hold) is parsed with counting hooks and walked
once, without recursion; one that even the parser cannot take (RecursionError) is
decoded member by member down to the field that nests too deep.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from mlxserve.server.errors import InvalidRequest

#: Every digit as ``0``: a run of digits becomes a run of ``0`` that `bytes.find` finds.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")


class _TooLong:
    """What a number literal over the limit parses to: its kind and length, not its value."""

    __slots__ = ("kind", "length")

    def __init__(self, kind: str, length: int) -> None:
        self.kind = kind
        self.length = length


def loads(raw: bytes, *, max_depth: int, max_number_chars: int) -> Any:
    """`raw` parsed as JSON; `InvalidRequest` naming the field where it nests deeper than
    `max_depth` levels (the body's own object or array is level 1) or holds a number
    literal of more than `max_number_chars` characters. Malformed JSON raises what
    `json.loads` raises (JSONDecodeError, UnicodeDecodeError)."""
    deep = raw.count(b"[") + raw.count(b"{") > max_depth
    long_number = _digit_run(max_number_chars) in raw.translate(_DIGITS_AS_ZERO)
    if not deep and not long_number:
        return json.loads(raw)
    parse_int, parse_float = _number_hooks(max_number_chars)
    found: tuple[list[str], _TooLong | None] | None
    try:
        data = json.loads(raw, parse_int=parse_int, parse_float=parse_float)
    except RecursionError:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        decoder = json.JSONDecoder(parse_int=parse_int, parse_float=parse_float)
        found = _deep_path(text, max_depth, decoder)
    else:
        found = _first_violation(data, 1, max_depth)
    if found is None:
        return data
    path, number = found
    if number is None:
        raise _too_deep(path, max_depth) from None
    raise _too_long(path, number, max_number_chars) from None


def _digit_run(max_number_chars: int) -> bytes:
    """The run of digits every number literal longer than `max_number_chars` holds: it
    has at least ``max_number_chars - 3`` digits (at most four other characters: ``-``,
    ``.``, ``e``, a sign) in at most three runs (integer, fraction, exponent)."""
    return b"0" * max(1, -(-(max_number_chars - 3) // 3))


def _number_hooks(limit: int) -> tuple[Callable[[str], Any], Callable[[str], Any]]:
    def parse_int(literal: str) -> int | _TooLong:
        return int(literal) if len(literal) <= limit else _TooLong("an integer", len(literal))

    def parse_float(literal: str) -> float | _TooLong:
        return float(literal) if len(literal) <= limit else _TooLong("a number", len(literal))

    return parse_int, parse_float


#: Members `_deep_path` decodes at most, all levels together.
_DESCENT_BUDGET = 10_000

#: What may break a limit inside: a container, or a number over the limit.
_WALKED = (dict, list, _TooLong)


def _members(value: Any) -> Iterator[tuple[Any, Any]]:
    return iter(value.items() if isinstance(value, dict) else enumerate(value))


def _first_violation(
    value: Any, depth: int, max_depth: int
) -> tuple[list[str], _TooLong | None] | None:
    """The path (in document order, the first) of a container deeper than `max_depth`
    or of a number over the limit (then with it) in `value`, which sits at `depth`."""
    if isinstance(value, _TooLong):
        return [], value
    if not isinstance(value, dict | list):
        return None
    if depth > max_depth:
        return [], None
    path: list[str] = []
    stack = [_members(value)]
    while stack:
        for key, item in stack[-1]:
            kind = type(item)
            if kind is dict or kind is list:
                if depth + len(stack) > max_depth:
                    return [*path, str(key)], None
                if item:
                    path.append(str(key))
                    stack.append(_members(item))
                    break
            if kind is _TooLong:
                return [*path, str(key)], item
        else:
            stack.pop()
            if path:
                path.pop()
    return None


def _deep_path(
    text: str, max_depth: int, decoder: json.JSONDecoder
) -> tuple[list[str], _TooLong | None]:
    """Where `text`, too deep for the parser, first breaks a limit: each level's members
    are decoded in turn, and the first the parser cannot take holds the place (or one
    that parses and breaks a limit itself). The members before it parsed in the first
    attempt, so they parse again, each once; the deep one fails within a thousand
    levels. Past `_DESCENT_BUDGET` members (a body built to be slow to name), the path
    so far names the field."""
    path: list[str] = []
    budget = _DESCENT_BUDGET
    try:
        pos = _skip(text, 0)
        while len(path) < max_depth and text[pos] in "[{":
            opener = text[pos]
            pos = _skip(text, pos + 1)
            index = 0
            while text[pos] not in "]}" and budget > 0:
                budget -= 1
                name = str(index)
                if opener == "{":
                    name, pos = decoder.raw_decode(text, pos)
                    pos = _skip(text, _skip(text, pos) + 1)  # past the colon
                try:
                    value, end = decoder.raw_decode(text, pos)
                except (RecursionError, ValueError):  # the deep one (maybe malformed past it)
                    path.append(str(name))
                    break
                if type(value) in _WALKED:
                    found = _first_violation(value, len(path) + 2, max_depth)
                    if found is not None:
                        return [*path, str(name), *found[0]], found[1]
                pos = _skip(text, end)
                pos = _skip(text, pos + 1) if text[pos] == "," else pos
                index += 1
            else:
                break  # out of budget (or, for what the parser refused, cannot happen)
    except (IndexError, ValueError):  # malformed where the parser did not look: named so far
        pass
    return path, None


def _skip(text: str, pos: int) -> int:
    """The position of the next character of `text` at or after `pos` that is not JSON
    whitespace."""
    while text[pos] in " \t\n\r":
        pos += 1
    return pos


def _too_deep(path: list[str], max_depth: int) -> InvalidRequest:
    param = ".".join(path) or None
    where = f"{param}: " if param else ""
    return InvalidRequest(
        f"{where}the body nests deeper than the {max_depth} levels accepted here",
        param=param,
        code="json_too_deep",
    )


def _too_long(path: list[str], number: _TooLong, limit: int) -> InvalidRequest:
    param = ".".join(path) or None
    where = f"{param}: " if param else ""
    return InvalidRequest(
        f"{where}{number.kind} of {number.length} characters; the longest accepted is {limit}",
        param=param,
        code="number_too_long",
    )
