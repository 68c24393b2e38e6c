"""The values of an agent's state that move all the time, as its 304 carries them (header
`fleet-live`): its clock, each server's uptime, the host's available memory, free disk and each
GPU's free memory. A state's generation leaves them out (agent/app.generation counts free disk
and GPU memory in 256 MiB steps), so a state held at that generation, brought up to date with
these values, is what a 200 would have said now, field for field. Pure: no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

HEADER = "fleet-live"
LIMIT = 16 << 10  # a longer header is not ours: the state is asked for whole instead


@dataclass(frozen=True, slots=True)
class Live:
    observed_at: str
    memory_available: int
    disk_free: int
    gpus_free: tuple[int, ...]  # in the order of inventory.gpus
    uptimes: tuple[float, ...]  # in the order of servers


def encode(state: Mapping[str, Any]) -> str:
    """The header's value for `state` (ASCII JSON: no byte of it can end the header line)."""
    inv = state["inventory"]
    return json.dumps([state["observed_at"], inv["memory"]["available_bytes"], inv["disk"]["free_bytes"],
                       [g["memory_free_bytes"] for g in inv["gpus"]], [s["uptime_s"] for s in state["servers"]]],
                      separators=(",", ":"))


def decode(raw: bytes | str) -> Live | None:
    """The values in a header, or None when it is not one this module wrote."""
    if len(raw) > LIMIT:
        return None
    try:
        at, memory, disk, gpus, uptimes = json.loads(raw)
        # type() is: a bool is not a count here. Checked inline: a warm plan does this per node.
        if (type(at) is str and type(memory) is int and type(disk) is int and memory >= 0 and disk >= 0
                and type(gpus) is list and type(uptimes) is list
                and all(type(g) is int and g >= 0 for g in gpus) and all(type(u) in _NUMBER for u in uptimes)):
            return Live(at, memory, disk, tuple(gpus), tuple(uptimes))
    except (ValueError, TypeError, RecursionError):
        pass  # not JSON (UnicodeDecodeError is a ValueError), not five values, or nested past the recursion limit
    return None


_NUMBER = (int, float)


def fits(state: Mapping[str, Any], live: Live) -> bool:
    """Whether `live` can describe `state`: as many GPUs and as many servers."""
    inv = state.get("inventory") or {}
    return len(inv.get("gpus") or ()) == len(live.gpus_free) and len(state.get("servers") or ()) == len(live.uptimes)


def brought_up(state: Mapping[str, Any], live: Live) -> dict[str, Any]:
    """A copy of `state` with `live`'s values (`state` is left as it was; the parts not touched
    are shared, a GPU's row too where its free memory has not moved). The caller has checked fits()."""
    inv = state["inventory"]
    return {**state, "observed_at": live.observed_at,
            "servers": [{**s, "uptime_s": u} for s, u in zip(state["servers"], live.uptimes)],
            "inventory": {**inv, "memory": {**inv["memory"], "available_bytes": live.memory_available},
                          "disk": {**inv["disk"], "free_bytes": live.disk_free},
                          "gpus": [g if g["memory_free_bytes"] == f else {**g, "memory_free_bytes": f}
                                   for g, f in zip(inv["gpus"], live.gpus_free)]}}
