"""Availability windows at chosen instants: an injected clock, never a wait."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import trio

from agent.app import assemble, create_app
from agent.machine.identity import Identity
from agent.machine.inventory import NoGpus
from agent.backends.launch import ProcessLauncher
from reconciler.agents.client import AgentClient
from reconciler.core.desired import NodeSpec
from tests.memory_transport import MemoryTransport, asgi
from wire.windows import Window, status

TZ = timezone(timedelta(hours=2))


def at(day: int, hh: int, mm: int = 0) -> datetime:
    return datetime(2026, 11, day, hh, mm, tzinfo=TZ)


NIGHT = (Window.parse("19:00-07:00"),)


@pytest.mark.parametrize("now, inside, ends, next_start", [
    (at(30, 2), True, at(30, 7), at(30, 19)),          # after midnight: the window began yesterday
    (at(30, 20), True, datetime(2026, 12, 1, 7, tzinfo=TZ), datetime(2026, 12, 1, 19, tzinfo=TZ)),
    (at(30, 12), False, None, at(30, 19)),             # midday: closed until the evening
    (at(30, 7), False, None, at(30, 19)),              # the end is exclusive
    (at(30, 19), True, datetime(2026, 12, 1, 7, tzinfo=TZ), datetime(2026, 12, 1, 19, tzinfo=TZ)),  # the start is inclusive
    (at(30, 6, 59), True, at(30, 7), at(30, 19)),
])
def test_window_crossing_midnight(now: datetime, inside: bool, ends: datetime | None, next_start: datetime) -> None:
    s = status(NIGHT, now)
    assert s["inside"] is inside
    assert s["current_ends_at"] == (ends.isoformat() if ends else None)
    assert s["next_starts_at"] == next_start.isoformat()


def test_touching_windows_merge() -> None:
    wins = (Window.parse("22:00-00:00"), Window.parse("00:00-03:00"))
    s = status(wins, at(30, 23))
    assert s["inside"] and s["current_ends_at"] == datetime(2026, 12, 1, 3, tzinfo=TZ).isoformat()


def test_equal_ends_mean_all_day_and_no_windows_mean_always() -> None:
    assert status((Window.parse("05:00-05:00"),), at(30, 4, 59))["inside"] is True
    assert status((), at(30, 12)) == {"windows": [], "always": True, "inside": True,
                                      "current_ends_at": None, "next_starts_at": None}


@pytest.mark.parametrize("bad", ["7pm-7am", "24:00-01:00", "19:00", "19:60-20:00", "", "19:00-07:00-08:00"])
def test_bad_windows_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="HH:MM-HH:MM"):
        Window.parse(bad)


def test_state_uses_the_injected_clock_end_to_end_in_process(tmp_path: Path) -> None:
    """The app's state route and the client, joined in memory (the client's own reader), at a chosen instant."""
    ident = Identity(id="a" * 32, name="n", enrolled_at="2026-01-01T00:00:00+00:00", agent_version="t")
    ctx = assemble(tmp_path, ident, b"s" * 16, "t", NoGpus("none"), ProcessLauncher(), windows=NIGHT,
                   clock=lambda: at(30, 23, 30))
    transport = MemoryTransport(asgi(create_app(ctx)))

    async def go() -> dict:
        async with AgentClient("s" * 16, transport=transport) as client:
            return await client.state(NodeSpec(name="n", address="127.0.0.1"))

    state = trio.run(go)
    assert state["observed_at"] == at(30, 23, 30).isoformat()
    assert state["availability"]["inside"] is True
    assert state["availability"]["current_ends_at"] == datetime(2026, 12, 1, 7, tzinfo=TZ).isoformat()
