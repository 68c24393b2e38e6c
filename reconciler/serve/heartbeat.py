"""The heartbeat: poll every agent on an interval, keep node status and server rows, and raise or
clear `node_offline` alerts after a stated number of missed beats. It never starts or stops
anything: nodes never act on their own, and neither does the control plane between applies."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import trio

from ..client import AgentClient
from ..model import Desired
from ..observe import observe
from ..store import Store

DEFAULT_INTERVAL_S = 30.0
DEFAULT_MISSES = 2  # consecutive missed beats before node_offline: one lost packet is not an outage


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class View:
    """The latest beat, in memory, for the router: which members are up and what to scrub."""

    states: dict[str, dict[str, Any]] = field(default_factory=dict)  # node → agent state
    online: dict[str, bool] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    beats: int = 0


class Heartbeat:
    def __init__(self, desired: Desired, client: AgentClient, store: Store, *, interval: float = DEFAULT_INTERVAL_S,
                 misses: int = DEFAULT_MISSES, timeout: float = 10.0, now: Callable[[], str] = utc_now,
                 on_beat: Callable[[float], None] | None = None) -> None:
        self.d = desired
        self.client = client
        self.store = store
        self.interval = interval
        self.threshold = misses
        self.timeout = min(timeout, interval)
        self.now = now
        self.on_beat = on_beat or (lambda seconds: None)
        self.view = View()

    async def beat(self) -> None:
        started = trio.current_time()
        snapshot = await observe(self.d, self.client, timeout=self.timeout)
        with self.store.transaction():
            self.record(snapshot)
        self.view.beats += 1
        self.on_beat(trio.current_time() - started)

    def record(self, snapshot: dict[str, Any]) -> None:
        when = self.now()
        for name, entry in snapshot["nodes"].items():
            state = entry["state"]
            if state is not None:
                self.view.states[name] = state
                self.view.misses[name] = 0
                self.view.online[name] = True
                self.store.put_node(name, "online", when, state=state, error=None)
                self.store.clear_alert(name, "node_offline", when)
                continue
            err = entry["error"]
            self.view.misses[name] = self.view.misses.get(name, 0) + 1
            offline = self.view.misses[name] >= self.threshold
            self.view.online[name] = not offline and self.view.online.get(name, False)
            cause = f"{err['code']}: {err['message']}"
            self.store.put_node(name, "offline" if offline else "missed", when, state=None, error=cause)
            if offline:
                self.store.raise_alert(name, "node_offline", cause, when)
        self.reconcile_rows(when)

    def reconcile_rows(self, when: str) -> None:
        """One row per cluster member; its state is what the agent reports, or why it cannot say."""
        for c in self.d.clusters.values():
            digest = self.d.models[c.model].digest
            for node in c.members:
                sid = f"{c.name}@{node}"
                row = {"id": sid, "cluster": c.name, "node": node, "model": c.model, "port": c.port}
                if not self.view.online.get(node, False):
                    row.update(state="node_offline", reason=f"node {node} is offline")
                else:
                    server = next((s for s in self.view.states[node].get("servers", []) if s["id"] == sid), None)
                    if server is None:
                        row.update(state="missing", reason=f"{node} reports no server {sid} (not applied yet?)")
                    elif server["model"] != digest:
                        row.update(state="drifted", reason=f"{node} runs {sid} with another model")
                    else:
                        row.update(state=server["state"], reason=server.get("reason"))
                self.store.put_server_row(row, when)

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await self.beat()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            await self.beat()
