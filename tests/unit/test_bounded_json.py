"""reconciler/agents/bounded.py: an agent's JSON within bounds (depth, number length), each refusal
naming its field; what is inside strings never counts. (tests/e2e/test_hostile_agent.py sends the
same forms from a real server beside real agents.)"""

from __future__ import annotations

import json

import pytest

from reconciler.agents.bounded import MAX_DEPTH, MAX_DIGITS, NotJson, Unbounded, loads


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_what_is_within_the_bounds_reads_as_json_loads_reads_it() -> None:
    value = {"a\"[": "\\", "b": [[1, -2.5e10, {"c": "]]]\\\\\"{{"}]], "d": "9" * 1000, "e": None, "f": True,
             "g": 10 ** (MAX_DIGITS - 1), "h": "\u00e9\u4e2d"}
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
        assert loads(text.encode()) == value == loads(text)
    assert loads(nested(MAX_DEPTH)) == json.loads(nested(MAX_DEPTH))


@pytest.mark.parametrize(("raw", "problem", "field"), [
    (b"1" * 5001, f"a number of more than {MAX_DIGITS} digits", ""),
    (b"[" + b"7" * (MAX_DIGITS + 1) + b"]", f"a number of more than {MAX_DIGITS} digits", "[0]"),
    (b'{"x": [1, 2, {"y": -0.' + b"5" * 100 + b"}]}", f"a number of more than {MAX_DIGITS} digits", "x[2].y"),
    (nested(MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} deep", "[0]" * MAX_DEPTH),
    (nested(200_000), f"nested more than {MAX_DEPTH} deep", "[0]" * MAX_DEPTH),
    (b'{"a": {"b": [1, ' + nested(MAX_DEPTH) + b"]}}", f"nested more than {MAX_DEPTH} deep",
     "a.b[1]" + "[0]" * (MAX_DEPTH - 3)),
    # A string's brackets do not hide real nesting: each "]" here is text, each [ a level.
    (b'["]",' * 40 + b"1" + b"]" * 40, f"nested more than {MAX_DEPTH} deep", "[1]" * MAX_DEPTH),
    (b'{"m": NaN}', "NaN is not a JSON number", ""),
    (b"[-Infinity]", "-Infinity is not a JSON number", ""),
])
def test_each_bound_is_refused_naming_its_field(raw: bytes, problem: str, field: str) -> None:
    with pytest.raises(Unbounded) as caught:
        loads(raw)
    assert (caught.value.problem, caught.value.field) == (problem, field)
    assert not isinstance(caught.value, NotJson)


@pytest.mark.parametrize("raw", [b"", b"[1,2", b"]", b"{'a': 1}", b"\xff\xfe[", b"[1]]", b'"unterminated'])
def test_what_is_not_json_is_said_to_be_so(raw: bytes) -> None:
    with pytest.raises(NotJson):
        loads(raw)


def test_a_fleet_live_header_nested_past_the_recursion_limit_is_no_live_values() -> None:
    """A 304's fleet-live header (wire/live.py) is under 16 KiB, yet that is room for 8,000 levels:
    RecursionError escaped the heartbeat's decode."""
    from wire import live

    assert live.decode(nested(8000)) is None
    assert live.decode(b'["t", 1, 2, [3], [4.5]]') == live.Live("t", 1, 2, (3,), (4.5,))
