"""Readable differences between a server's settings as running and as planned, by path, through
deepdiff: what a replace's reason and a drift alert show ("speculative.tokens 4 → 8")."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

UNSET = "unset"


def settings_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """One line per leaf that differs, sorted by path: ["context_length 4096 → 8192",
    "speculative.tokens unset → 8"]. Equal settings cost no import of deepdiff (most servers
    match, and the planner runs on every heartbeat)."""
    if old == new:
        return []
    # deepdiff pulls in numpy and subprocess when imported: loaded only when something differs,
    # so that importing the planner stays free of both (tests/unit/test_boundaries.py).
    from deepdiff import DeepDiff

    # threshold 0: compare key by key however few keys the two share (by default deepdiff
    # reports a whole mapping as replaced when under a third of its keys are common).
    tree = DeepDiff(dict(old), dict(new), view="tree", threshold_to_diff_deeper=0)
    lines: dict[str, str] = {}
    for levels in tree.values():
        for level in levels:
            path = _path(level.path(output_format="list"))
            for leaf, before, after in _leaves(path, _value(level.t1), _value(level.t2)):
                if _unset(before) and _unset(after):
                    continue  # null and missing mean the same to an engine: not a change
                exact = type(before) is not type(after) and not (_unset(before) or _unset(after))
                lines[leaf] = f"{leaf} {_show(before, exact)} → {_show(after, exact)}"
    return [lines[k] for k in sorted(lines)]


class _Absent:
    """A side where the key does not exist (deepdiff's own marker is not part of its API)."""


_ABSENT = _Absent()


def _value(v: Any) -> Any:
    return _ABSENT if type(v).__name__ == "NotPresent" else v


def _path(keys: list[Any]) -> str:
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _leaves(path: str, before: Any, after: Any) -> Iterator[tuple[str, Any, Any]]:
    """A whole mapping added or removed is shown leaf by leaf, each by its own path."""
    if isinstance(before, Mapping) and isinstance(after, _Absent):
        for k in before:
            yield from _leaves(f"{path}.{k}", before[k], _ABSENT)
    elif isinstance(after, Mapping) and isinstance(before, _Absent):
        for k in after:
            yield from _leaves(f"{path}.{k}", _ABSENT, after[k])
    else:
        yield path, before, after


def _unset(v: Any) -> bool:
    return v is None or isinstance(v, _Absent)


def _show(v: Any, exact: bool = False) -> str:
    """`exact` where the two sides differ in type only, or "1 → 1" would say nothing."""
    return UNSET if _unset(v) else repr(v) if exact else str(v)
