"""JSON from an agent (or whatever answers at its address), parsed within bounds: nesting at most
MAX_DEPTH deep and no number longer than MAX_DIGITS digits, both checked on the bytes before
json.loads builds anything. Python's own limits are no bound to lean on: an integer of more than
sys.get_int_max_str_digits() digits raises a bare ValueError (and a process may lift that limit),
and nesting deeper than what is left of the interpreter's recursion limit raises RecursionError
from wherever the parse happens to be called, after building the levels above it. What is
checked here, and the bounds being small, also keep every later walk over a state (the schema
check, the cache's json.dumps, deepcopy) far from the recursion limit.

A refusal (Unbounded) names the field where the bound was crossed, found by a second, slower
look that only a refused answer pays for."""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from reconciler.core.diagnostics import format_path

MAX_DEPTH = 32  # an agent's state nests 6 deep; a manifest 4
MAX_DIGITS = 64  # the longest number an agent writes is a float's repr (17 digits) or a byte count (< 20)
FIELD_SCAN = 1 << 20  # the field of a refusal is looked for in the first MiB only

_LONG_NUMBER = re.compile(rb"[0-9]{%d}" % (MAX_DIGITS + 1))
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))  # each digit a "0", the rest " "
_LONG_RUN = b"0" * (MAX_DIGITS + 1)
_OPEN_CLOSE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(set(range(256)) - set(b"[]{}"))
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:,]|[^\s\[\]{}:,"]+|\S', re.DOTALL)


class Unbounded(ValueError):
    """The answer crosses a bound (or is not JSON); `field` is where, "" for the answer itself."""

    def __init__(self, problem: str, field: str = "") -> None:
        super().__init__(problem)
        self.problem, self.field = problem, field


class NotJson(Unbounded):
    """Not JSON at all (nor UTF-8)."""


def _constant(name: str) -> NoReturn:
    raise Unbounded(f"{name} is not a JSON number")


def loads(content: bytes | str) -> Any:
    """The value `content` holds, or Unbounded: nested over MAX_DEPTH, a number over MAX_DIGITS
    digits, NaN or Infinity (which json.loads would take), or not JSON at all."""
    raw = content.encode() if isinstance(content, str) else content
    # Strings taken out, so that no bracket or digit inside one counts: escaped backslashes first,
    # then escaped quotes, as JSON's lexer reads them left to right; every quote left delimits a
    # string. (Plain bytes operations: a regular expression over the strings cost twice the parse.)
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    bare = b"".join(plain.split(b'"')[::2])
    if _LONG_RUN in bare.translate(_DIGITS):
        raise Unbounded(f"a number of more than {MAX_DIGITS} digits", _field(raw, "digits"))
    brackets = bare.translate(_OPEN_CLOSE, _NOT_BRACKET)
    # Each pass takes away the innermost pairs, one level at least: what is left after MAX_DEPTH
    # passes was nested deeper (or does not pair up, which json.loads would refuse as well).
    for _ in range(MAX_DEPTH):
        if not brackets:
            break
        brackets = brackets.replace(b"[]", b"")
    if brackets:
        if brackets.count(b"[") != brackets.count(b"]"):
            raise NotJson("not JSON (its brackets do not pair up)")
        raise Unbounded(f"nested more than {MAX_DEPTH} deep", _field(raw, "depth"))
    try:
        return json.loads(raw, parse_constant=_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if isinstance(exc, Unbounded):
            raise
        raise NotJson("not JSON") from None


def _field(raw: bytes, bound: str) -> str:
    """Where in `raw` the bound was first crossed, as a path (format_path); "" when that is the
    answer itself or lies past the first FIELD_SCAN bytes."""
    path: list[str | int] = []
    expect_key = False  # the next string in an object is a key
    for token in _TOKEN.finditer(raw, 0, FIELD_SCAN):
        t = token.group()
        if t in (b"[", b"{"):
            if bound == "depth" and len(path) >= MAX_DEPTH:
                return format_path(tuple(path))
            path.append(0 if t == b"[" else "")
            expect_key = t == b"{"
        elif t in (b"]", b"}"):
            if path:
                path.pop()
            expect_key = False
        elif t == b",":
            if path and isinstance(path[-1], int):
                path[-1] += 1
            else:
                expect_key = True
        elif t == b":":
            expect_key = False
        elif expect_key and t.startswith(b'"') and path and isinstance(path[-1], str):
            try:
                path[-1] = json.loads(t)
            except ValueError:
                path[-1] = t[1:-1].decode("latin-1")
        elif bound == "digits" and _LONG_NUMBER.search(t) and not t.startswith(b'"'):
            return format_path(tuple(path))
    return ""
