"""Draining a cluster member around its replacement, `fleet apply`'s side: the member is taken out
of routing (new requests go to the others), its requests in flight finish up to a grace period,
and after its new server runs it is handed back and admitted by `fleet serve` before the next
member goes. The two processes meet on a DrainBoard: the state store's drains table
(state_drains.DrainRows, watched by serve/drains.py: polled on SQLite, notified on PostgreSQL).
docs/ARCHITECTURE.md says why."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import AsyncIterator, Awaitable, Callable, Protocol

import trio

from reconciler.planning.plan import Change
from reconciler.state.drains import Drain

GRACE_S = 30.0  # the longest a request in flight on a drained member is waited for
ACK_S = 2.0  # serve looks every 50 ms: silence this long means no `fleet serve` routes to it
ADMIT_S = 15.0  # serve asks the member's agent before admitting it: one call, its own timeout
POLL_S = 0.05


class DrainBoard(Protocol):
    """Where apply asks and serve answers (state_drains.DrainRows)."""

    def ask(self, drain: Drain) -> None: ...
    def set_phase(self, server_id: str, phase: str) -> None: ...
    def get(self, server_id: str) -> Drain | None: ...
    def remove(self, server_id: str) -> None: ...


Note = Callable[[str], None]  # what the drain is doing, for the apply's progress lines


def _utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Drainer:
    """Drains as the apply holding lock `lock_id`: serve ignores the drains of any other apply, so a
    drain an apply left behind (it died) holds no member out of routing."""

    def __init__(self, board: DrainBoard, lock_id: str, *, grace_s: float = GRACE_S, ack_s: float = ACK_S,
                 admit_s: float = ADMIT_S, poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = trio.sleep, now: Callable[[], str] = _utc) -> None:
        self.board, self.lock_id = board, lock_id
        self.grace_s, self.ack_s, self.admit_s, self.poll_s = grace_s, ack_s, admit_s, poll_s
        self.clock, self.sleep, self.now = clock, sleep, now

    @asynccontextmanager
    async def around(self, change: Change, note: Note) -> AsyncIterator[None]:
        """Drained on entry; handed back on the way out, whether the new server started or not (serve
        then asks its agent and routes to it only if it runs)."""
        sid = change.details["server_id"]
        self.board.ask(Drain(sid, change.node, change.details["cluster"], self.lock_id, "drain", self.grace_s,
                             self.now()))
        served = False
        try:
            served = await self._drained(sid, note)
            yield
        except BaseException as exc:
            if not served or not isinstance(exc, Exception):  # cancelled or interrupted: only let go
                self.board.remove(sid)
                raise
            await self._admitted(sid, note)
            raise
        if served:
            await self._admitted(sid, note)
        else:
            self.board.remove(sid)

    async def _wait(self, sid: str, limit: float, done: Callable[[Drain], bool]) -> Drain | None:
        """The row once `done` says so; None after `limit` seconds (or if the row is gone)."""
        deadline = self.clock() + limit
        while True:
            row = self.board.get(sid)
            if row is None or done(row):
                return row
            if self.clock() >= deadline:
                return None
            await self.sleep(self.poll_s)

    async def _drained(self, sid: str, note: Note) -> bool:
        """Whether a `fleet serve` took the member out of routing (it then waits to admit it)."""
        acked = await self._wait(sid, self.ack_s, lambda d: d.seen in ("draining", "drained"))
        if acked is None:
            note(f"no fleet serve took {sid} out of routing within {self.ack_s:g}s (none running?): "
                 "replacing it without draining")
            return False
        note(f"draining {sid}: {acked.in_flight or 0} request(s) in flight, new ones go to the other members")
        if await self._wait(sid, self.grace_s, lambda d: d.seen == "drained") is None:
            row = self.board.get(sid)
            left = row.in_flight if row is not None else "?"
            note(f"{sid}: {left} request(s) still in flight after the {self.grace_s:g}s grace period: "
                 "stopping it anyway (their streams end with an error event)")
            return True
        note(f"drained {sid}: no request in flight")
        return True

    async def _admitted(self, sid: str, note: Note) -> None:
        self.board.set_phase(sid, "admit")
        try:
            if await self._wait(sid, self.admit_s, lambda d: d.seen == "admitted") is None:
                note(f"fleet serve did not confirm {sid} back in routing within {self.admit_s:g}s; "
                     "its next heartbeat will")
            else:
                note(f"{sid} is back in routing")
        finally:
            self.board.remove(sid)
