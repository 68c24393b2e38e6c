"""`fleet serve`'s side of a drain (reconciler/applying/drain.py is apply's): notice at once that an apply
drains a member, take it out of routing before anything else runs, say when its last request in
flight ended, and admit it again once its agent, asked afresh, reports its new server."""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Collection, Protocol

import trio

from reconciler.state.drains import Drain
from reconciler.serve.heartbeat import View, utc_now

log = logging.getLogger("fleet")

EVERY_S = 0.05  # how often the board is looked at: the longest a drain waits to be seen
IDLE_S = 1.0  # with notifications, the longest between two looks while nothing is drained


class WatchBoard(Protocol):
    """What serve reads and writes of the board (state_drains.DrainRows, on either store)."""

    def changed(self) -> bool: ...
    def active(self) -> list[Drain]: ...
    def answer(self, server_id: str, seen: str, in_flight: int, when: str) -> None: ...
    def answer_for(self, serve: str, drain: Drain, in_flight: int, when: str) -> None: ...
    def others_in_flight(self, drain: Drain) -> int | None: ...


class DrainWatcher:
    """`in_flight(server_id)`: requests the router has on that member now; `refresh(nodes)`: ask
    those agents now (Heartbeat.refresh); `on_change(n)`: members drained now (the metrics);
    `wait(limit)`: until the board may have changed (None: look every `every` seconds); `answers()`:
    whether this process answers in the rows (the leader, when several serve one shared store);
    `name`: this process's among them (a follower answers its requests in flight under it)."""

    def __init__(self, board: WatchBoard, view: View, in_flight: Callable[[str], int],
                 refresh: Callable[[Collection[str]], Awaitable[None]], *, every: float = EVERY_S,
                 now: Callable[[], str] = utc_now, on_change: Callable[[int], None] | None = None,
                 wait: Callable[[float], Awaitable[None]] | None = None,
                 answers: Callable[[], bool] = lambda: True, name: str = "") -> None:
        self.board, self.view, self.in_flight, self.refresh = board, view, in_flight, refresh
        self.every, self.now, self.wait, self.answers, self.name = every, now, wait, answers, name
        self._told: dict[tuple[str, str], int] = {}  # a follower's last answers, by member and apply
        self.on_change = on_change or (lambda n: None)
        self.rows: list[Drain] = []

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.tick()
            if self.wait is None or self.rows:  # a drain under way: its requests in flight are counted
                await trio.sleep(self.every)
            else:  # nothing drained: until the store says something changed (PostgreSQL's NOTIFY)
                await self.wait(IDLE_S)

    async def tick(self) -> None:
        # Nothing committed by another process and nothing being drained: one PRAGMA, no query.
        if not self.board.changed() and not self.rows:
            return
        self.rows = self.board.active()
        drained = {d.server_id for d in self.rows if d.phase == "drain" or d.seen != "admitted"}
        if drained != self.view.draining:
            # Set before anything awaits: no request is routed to a drained member from here on.
            for sid in drained - self.view.draining:
                log.info("draining %s for an apply: new requests go to the other members", sid)
            self.view.draining = drained
            self.on_change(len(drained))
        if not self.answers():  # another `fleet serve` leads: it answers, and admits (serve/leader.py)
            told = {}
            for d in self.rows:
                if d.phase == "drain":
                    told[d.server_id, d.lock_id] = n = self.in_flight(d.server_id)
                    if self._told.get((d.server_id, d.lock_id)) != n:  # in flight here, for the leader
                        self.board.answer_for(self.name, d, n, self.now())
            self._told = told
            return
        for d in self.rows:
            if d.phase == "drain":
                # Drained once no serve has a request in flight on it, and every other serve sharing
                # the store has said so (each took it out of routing before it answered).
                n, others = self.in_flight(d.server_id), self.board.others_in_flight(d)
                seen = "drained" if n == 0 and others == 0 else "draining"
                if (seen, n + (others or 0)) != (d.seen, d.in_flight):
                    self.board.answer(d.server_id, seen, n + (others or 0), self.now())
            elif d.seen != "admitted":
                await self.admit(d)

    async def admit(self, d: Drain) -> None:
        """Back into routing on what its agent says now: the router sends it requests only if its
        new server is reported running (a beat from before the replacement says nothing of it)."""
        try:
            await self.refresh([d.node])
        except Exception as exc:  # the row says it; the next beat asks again
            log.warning("could not ask %s before admitting %s: %s", d.node, d.server_id, exc)
        self.view.draining.discard(d.server_id)
        self.on_change(len(self.view.draining))
        server = self.view.nodes[d.node].servers.get(d.server_id) if d.node in self.view.nodes else None
        log.info("admitted %s back into routing (%s)", d.server_id, server.state if server else "not reported")
        self.board.answer(d.server_id, "admitted", self.in_flight(d.server_id), self.now())
