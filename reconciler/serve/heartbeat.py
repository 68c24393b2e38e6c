"""The heartbeat: poll every agent on an interval, keep node status and server rows, and raise or
clear `node_offline` alerts after a stated number of missed beats. It never starts or stops
anything: nodes never act on their own, and neither does the control plane between applies."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import trio

from wire.ids import server_id

from ..model import Desired
from ..observe import Observer
from ..observed import Observed, ObservedNode
from ..state_store import ServeRecord

DEFAULT_INTERVAL_S = 30.0
DEFAULT_MISSES = 2  # consecutive missed beats before node_offline: one lost packet is not an outage


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class View:
    """The latest beat, in memory, for the router: which members are up and what to scrub."""

    nodes: dict[str, ObservedNode] = field(default_factory=dict)  # node → what it last reported
    online: dict[str, bool] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    beats: int = 0


class Heartbeat:
    """`observe` asks the fleet (reconciler.observe.observer in production); `store` keeps what it
    found; `now` stamps the rows."""

    def __init__(self, desired: Desired, observe: Observer, store: ServeRecord, *,
                 interval: float = DEFAULT_INTERVAL_S, misses: int = DEFAULT_MISSES, timeout: float = 10.0,
                 now: Callable[[], str] = utc_now, on_beat: Callable[[float], None] | None = None) -> None:
        self.d = desired
        self.observe = observe
        self.store = store
        self.interval = interval
        self.threshold = misses
        self.timeout = min(timeout, interval)
        self.now = now
        self.on_beat = on_beat or (lambda seconds: None)
        self.view = View()

    async def beat(self) -> None:
        started = trio.current_time()
        observed = await self.observe(self.timeout)
        with self.store.transaction():
            self.record(observed)
        self.view.beats += 1
        self.on_beat(trio.current_time() - started)

    def record(self, observed: Observed) -> None:
        when = self.now()
        for name, node in observed.nodes.items():
            if node.ok:
                self.view.nodes[name] = node
                self.view.misses[name] = 0
                self.view.online[name] = True
                self.store.put_node(name, "online", when, state=node.state, error=None)
                self.store.clear_alert(name, "node_offline", when)
                continue
            self.view.misses[name] = self.view.misses.get(name, 0) + 1
            offline = self.view.misses[name] >= self.threshold
            self.view.online[name] = not offline and self.view.online.get(name, False)
            cause = f"{node.error_code}: {node.error}"
            self.store.put_node(name, "offline" if offline else "missed", when, state=None, error=cause)
            if offline:
                self.store.raise_alert(name, "node_offline", cause, when)
        self.reconcile_rows(when)

    def reconcile_rows(self, when: str) -> None:
        """One row per cluster member; its state is what the agent reports, or why it cannot say."""
        for c in self.d.clusters.values():
            digest = self.d.models[c.model].digest
            for node in c.members:
                sid = server_id(c.name, node)
                row: dict[str, Any] = {"id": sid, "cluster": c.name, "node": node, "model": c.model, "port": c.port}
                if not self.view.online.get(node, False):
                    row.update(state="node_offline", reason=f"node {node} is offline")
                else:
                    server = self.view.nodes[node].servers.get(sid)
                    if server is None:
                        row.update(state="missing", reason=f"{node} reports no server {sid} (not applied yet?)")
                    elif server.model != digest and not (c.pipeline is not None and _slice_of(
                            self.view.nodes[node], server.model) == digest):
                        row.update(state="drifted", reason=f"{node} runs {sid} with another model")
                    else:
                        row.update(state=server.state, reason=server.reason)
                self.store.put_server_row(row, when)

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await self.beat()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            await self.beat()


def _slice_of(node: ObservedNode, digest: str) -> str | None:
    """The model a pipeline stage's weights are a slice of (its server reports the slice's digest)."""
    held = node.weights.get(digest)
    return held.slice_of if held is not None else None
