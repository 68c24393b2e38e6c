"""agent/app.Generations, the name GET /v1/state gives a state, keeping the last one's: always the
name generation() gives, whatever changed and however (a value, its type, a dict changed in place
after it was named, a value marshal cannot write)."""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any, cast

import pytest

from agent.api.context import Generations, generation
from wire.state import AgentState

STATE: dict[str, Any] = {
    "identity": {"id": "i"}, "observed_at": "t", "weights": [{"digest": "sha256:a", "bytes": 1, "layers": None}],
    "servers": [{"id": "s", "uptime_s": 1.5, "settings": {"threads": 4}}], "fetches": [], "link_rates": [],
    "inventory": {"memory": {"available_bytes": 1, "total_bytes": 2}, "disk": {"free_bytes": 1 << 40},
                  "gpus": [{"name": "G", "memory_free_bytes": 1 << 30, "memory_total_bytes": 2 << 30}]}}


def named(names: Generations, state: dict[str, Any]) -> str:
    got = names(cast(AgentState, state))
    assert got == generation(cast(AgentState, state))
    return got


@pytest.mark.parametrize("change", [
    lambda s: s["weights"][0].update(bytes=True),  # 1 -> True: equal in Python, not in JSON
    lambda s: s["weights"][0].update(bytes=1.0),
    lambda s: s["servers"][0]["settings"].update(threads=5),
    lambda s: s["weights"].append({"digest": "sha256:b"}),
    lambda s: s["identity"].update(id="j"),
], ids=["int-to-bool", "int-to-float", "nested-setting", "a-model-more", "identity"])
def test_a_changed_state_is_named_anew_even_in_place(change: Any) -> None:
    names = Generations()
    state = copy.deepcopy(STATE)
    before = named(names, state)
    assert named(names, state) == before  # kept
    change(state)  # the very dicts the last state was named from, changed in place
    assert named(names, state) != before


def test_moving_values_keep_the_name_and_back_again() -> None:
    names = Generations()
    first = named(names, STATE)
    moved = copy.deepcopy(STATE)
    moved["observed_at"], moved["servers"][0]["uptime_s"] = "later", 99.0
    assert named(names, moved) == first
    other = {**STATE, "fetches": [{"digest": "sha256:f"}]}
    assert named(names, other) != first and named(names, STATE) == first


def test_a_value_marshal_cannot_write_is_named_whole() -> None:
    names = Generations()
    state = {**STATE, "identity": {"id": "i", "enrolled_at": datetime(2026, 1, 1, tzinfo=timezone.utc)}}
    first = named(names, state)
    state["identity"]["enrolled_at"] = datetime(2026, 1, 2, tzinfo=timezone.utc)
    assert named(names, state) != first
