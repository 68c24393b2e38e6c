"""Several `fleet serve` processes on one shared store: the one holding the leadership lock runs the
heartbeat (asks the agents, writes node status, server rows and alerts, so an alert is raised
once); the others route from what it writes, re-read when it notifies a change; when the leader
dies its lock goes with its connection, and the first follower to look takes over."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any, Awaitable, Callable, Collection, Protocol

import trio

from reconciler.core.observed import ObservedNode, node_from_state
from reconciler.state.store import ServeRecord
from reconciler.serve.heartbeat import Heartbeat, ObserveFn, View

log = logging.getLogger("fleet")


class Lock(Protocol):
    """state_pg.LeaderLock: blocking calls, run here in a thread."""

    def try_take(self) -> bool: ...
    def held(self) -> bool: ...
    def close(self) -> None: ...


class Follower:
    """The router's view from the leader's rows: a node is up when its row says online, and what it
    runs is the state its row keeps (re-parsed only when that text changed). Workers' credentials
    are not kept in the store (observed.node_from_state leaves them out): a follower keeps the ones
    it asked for itself (`refresh`, when a worker refuses a request), until refused again."""

    def __init__(self, record: ServeRecord, view: View, observe: ObserveFn | None = None,
                 timeout: float = 10.0) -> None:
        self.record, self.view, self.observe, self.timeout = record, view, observe, timeout
        self._texts: dict[str, str] = {}

    async def sync(self) -> None:
        # PostgreSQL: in a thread (at 1,000 nodes the rows are megabytes, and the event loop relays
        # streams); a SQLite connection is its thread's, and reads a local file.
        read = self.record.node_states
        rows = read() if self.record.sql.dialect == "sqlite" else await trio.to_thread.run_sync(read)
        for name, status, text in rows:
            if text is not None and self._texts.get(name) != text:
                self.view.nodes[name] = _credentials_kept(node_from_state(name, json.loads(text)),
                                                          self.view.nodes.get(name))
                self._texts[name] = text
            self.view.online[name] = status == "online" and name in self.view.nodes
        self.view.beats += 1

    async def refresh(self, nodes: Collection[str]) -> None:
        """Ask these agents now, for this process's view only (the leader writes the rows)."""
        if self.observe is None:
            return
        observed = await self.observe(self.timeout, nodes)
        for name, node in observed.nodes.items():
            if node.ok:
                self.view.nodes[name] = node


def _credentials_kept(node: ObservedNode, before: ObservedNode | None) -> ObservedNode:
    """`node` read from the store, with the credentials this process had for the same servers."""
    if before is None:
        return node
    servers = {sid: replace(s, credential=before.servers[sid].credential)
               if not s.credential and sid in before.servers and before.servers[sid].credential else s
               for sid, s in node.servers.items()}
    return replace(node, servers=servers)


class Roles:
    """Lead or follow, for as long as serve runs. `make_heartbeat(view)`: a heartbeat for a term
    as leader (a fresh one each term: what a former term wrote may have been changed since by
    another leader); `changed(limit)`: until the leader's next notification, or `limit` seconds;
    `poll_s`: how often a follower tries to take the lead, and the leader checks it still holds it
    (a follower takes over within that much of the leader's death, plus one beat)."""

    def __init__(self, make_heartbeat: Callable[[View], Heartbeat], view: View, record: ServeRecord, lock: Lock,
                 changed: Callable[[float], Awaitable[None]], *, poll_s: float,
                 on_lead: Callable[[bool], None] | None = None, observe: ObserveFn | None = None,
                 timeout: float = 10.0) -> None:
        self.make_heartbeat, self.view, self.lock, self.changed = make_heartbeat, view, lock, changed
        self.follower = Follower(record, view, observe, timeout)
        self.poll_s = poll_s
        self.on_lead = on_lead or (lambda leading: None)
        self.heartbeat: Heartbeat | None = None  # while this process leads

    @property
    def leading(self) -> bool:
        return self.heartbeat is not None

    async def refresh(self, nodes: Collection[str]) -> None:
        """Heartbeat.refresh while leading (it records what it found); a follower asks for its own
        view only (a worker's new credential: the leader admits drains)."""
        if self.heartbeat is not None:
            await self.heartbeat.refresh(nodes)
        else:
            await self.follower.refresh(nodes)

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Started once this process routes: after its first beat as leader, or its first read of
        the leader's rows as follower."""
        started = False
        try:
            while True:
                if await trio.to_thread.run_sync(self.lock.try_take):
                    await self._lead(None if started else task_status)
                    started = True
                    continue
                await self.follower.sync()
                if not started:
                    task_status.started()
                    started = True
                await self.changed(self.poll_s)
        finally:
            self.lock.close()

    async def _lead(self, task_status: Any) -> None:
        log.info("leading the heartbeat (the shared state store's leadership lock is this process's)")
        self.heartbeat = self.make_heartbeat(self.view)
        self.on_lead(True)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.heartbeat.run)
                if task_status is not None:
                    task_status.started()
                while await trio.to_thread.run_sync(self.lock.held):
                    await trio.sleep(self.poll_s)
                nursery.cancel_scope.cancel()
        finally:
            self.heartbeat = None
            self.on_lead(False)
        log.warning("lost the leadership lock (the state store's connection ended): following until it "
                    "can be taken again")
