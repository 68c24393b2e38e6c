"""The heartbeat: poll every agent on an interval, keep node status and server rows, raise or clear
`node_offline` alerts after a stated number of missed beats, and plan against what each beat saw:
a `drift` alert while the fleet does not match its file. It never starts or stops anything: nodes
never act on their own, and neither does the control plane between applies."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Collection

import trio

from wire.ids import server_id

from reconciler.core.desired import ClusterSpec, Desired
from reconciler.core.observed import Observed, ObservedNode
from reconciler.planning.placement import members_of
from reconciler.planning.plan import Plan
from reconciler.planning.planner import plan
from reconciler.state.store import ServeRecord

DEFAULT_INTERVAL_S = 30.0
DEFAULT_MISSES = 2  # consecutive missed beats before node_offline: one lost packet is not an outage
DRIFT = "drift"
FLEET = "fleet"  # the node column of alerts about the fleet as a whole
SHOWN = 20  # addresses named in a drift alert; the rest are counted

ObserveFn = Callable[..., Awaitable[Observed]]  # (timeout[, only]) → what those nodes reported


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Nodes(dict[str, ObservedNode]):
    """View.nodes: a dict that counts its changes, so that what serve derives from it (View.members)
    is worked out once after each change (a beat, a refresh), not on every request."""

    changes = 0

    def __setitem__(self, key: str, value: ObservedNode) -> None:
        super().__setitem__(key, value)
        self.changes += 1

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.changes += 1

    def pop(self, *args: Any) -> Any:
        self.changes += 1
        return super().pop(*args)

    def popitem(self) -> tuple[str, ObservedNode]:
        self.changes += 1
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self.changes += 1

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self.changes += 1

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.changes += 1
        return super().setdefault(key, default)

    def __ior__(self, other: Any) -> Any:  # type: ignore[misc]  # dict's own |= bypasses update()
        self.changes += 1
        return super().__ior__(other)


@dataclass
class View:
    """The latest beat, in memory, for the router: which members are up and what to scrub; and
    which members are drained (server ids), kept by the drain watcher (serve/drains.py)."""

    nodes: dict[str, ObservedNode] = field(default_factory=Nodes)  # node → what it last reported
    online: dict[str, bool] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    beats: int = 0
    draining: set[str] = field(default_factory=set)
    plan: Plan | None = None  # the drift plan of the latest beat

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, Nodes):
            self.nodes = Nodes(self.nodes)
        self._placed: tuple[Desired, Nodes, int, dict[str, tuple[str, ...]]] | None = None

    def members(self, d: Desired, c: ClusterSpec) -> tuple[str, ...]:
        """The cluster's members as serve routes to them and shows them: fleet.yaml's names, or for a
        placed cluster (members: {count}) the nodes whose agents last reported its server: the
        answer of placement.members_of, for every placed cluster at once in one walk over the
        nodes, again only once the nodes have changed (the router asks on every request)."""
        if c.placement is None:
            return c.members
        nodes = self.nodes
        if not isinstance(nodes, Nodes):  # replaced by a plain dict: no count of its changes to trust
            return members_of(d, Observed(nodes), c.name)
        kept = self._placed
        if kept is None or kept[0] is not d or kept[1] is not nodes or kept[2] != nodes.changes:
            found: dict[str, list[str]] = {}
            for n in d.nodes:  # in the file's order, as members_of names them
                seen = nodes.get(n)
                if seen is None:
                    continue
                tail = "@" + n
                for sid in seen.servers:
                    if sid.endswith(tail):  # server_id(cluster, n)
                        found.setdefault(sid[:-len(tail)], []).append(n)
            kept = self._placed = (d, nodes, nodes.changes, {k: tuple(v) for k, v in found.items()})
        return kept[3].get(c.name, ())


class Heartbeat:
    """`observe` asks the fleet (reconciler.agents.observe.observer in production); `store` keeps what it
    found; `now` stamps the rows; `on_plan` hears each beat's drift plan (the metrics); `view`: the
    router's, when this heartbeat takes over from a leader that died."""

    def __init__(self, desired: Desired, observe: ObserveFn, store: ServeRecord, *,
                 interval: float = DEFAULT_INTERVAL_S, misses: int = DEFAULT_MISSES, timeout: float = 10.0,
                 now: Callable[[], str] = utc_now, on_beat: Callable[[float], None] | None = None,
                 on_plan: Callable[[Plan], None] | None = None, view: View | None = None) -> None:
        self.d = desired
        self.observe = observe
        self.store = store
        self.interval = interval
        self.threshold = misses
        self.timeout = min(timeout, interval)
        self.now = now
        self.on_beat = on_beat or (lambda seconds: None)
        self.on_plan = on_plan or (lambda p: None)
        self.view = view if view is not None else View()  # given: a follower's view it takes over (serve/leader.py)
        # What the store holds, so that a beat writes only what changed (at 10,000 nodes a row
        # per node and member each beat was most of a quiet beat's cost).
        self._nodes_written: dict[str, object] = {}  # the node written, or (status, cause)
        self._rows_written: dict[str, tuple[Any, ...]] = {}
        self._open: set[tuple[str, str]] | None = None
        self._planned: tuple[ObservedNode, ...] = ()
        self._asked = 0
        self._recorded: dict[str, int] = {}  # node → the latest observation recorded for it
        self._planned_manifests: frozenset[str] = frozenset()

    async def beat(self) -> None:
        started = trio.current_time()
        asked = self._ask()
        observed = await self.observe(self.timeout)
        with self.store.transaction():
            self.record(observed, asked=asked)
            self.drift(observed)
        await self.store.flush()  # a shared store's writes, sent from a thread (SQLite: written already)
        self.view.beats += 1
        self.on_beat(trio.current_time() - started)

    async def refresh(self, nodes: Collection[str]) -> None:
        """Ask these nodes now, between beats (a member coming back from a drain is admitted on
        what its agent says now, not on what the last beat saw)."""
        asked = self._ask()
        observed = await self.observe(self.timeout, nodes)
        with self.store.transaction():
            self.record(observed, touch=False, asked=asked)
        await self.store.flush()

    def _ask(self) -> int:
        self._asked += 1
        return self._asked

    def record(self, observed: Observed, *, touch: bool = True, asked: int | None = None) -> None:
        """`asked`: when this observation was asked for (_ask). A refresh asked during a beat may
        land first: the beat's older answer for that node is then not recorded over it."""
        when = self.now()
        if self._open is None:
            self._open = self.store.open_alert_keys()
        for name, node in observed.nodes.items():
            if asked is not None:
                if asked < self._recorded.get(name, 0):
                    continue
                self._recorded[name] = asked
            if node.ok:
                self.view.nodes[name] = node
                self.view.misses[name] = 0
                self.view.online[name] = True
                if self._nodes_written.get(name) is not node:  # the very node written last time: unchanged
                    self.store.put_node(name, "online", when, state=node.state, error=None)
                    self._nodes_written[name] = node
                self._clear(name, "node_offline", when)
                continue
            self.view.misses[name] = self.view.misses.get(name, 0) + 1
            offline = self.view.misses[name] >= self.threshold
            self.view.online[name] = not offline and self.view.online.get(name, False)
            cause = f"{node.error_code}: {node.error}"
            self.store.put_node(name, "offline" if offline else "missed", when, state=None, error=cause)
            self._nodes_written[name] = ("offline" if offline else "missed", cause)
            if offline and (name, "node_offline") not in self._open:
                self.store.raise_alert(name, "node_offline", cause, when)
                self._open.add((name, "node_offline"))
        if touch:  # every node that answered was seen now: one statement, not one per node
            self.store.touch_online(when)
        self.reconcile_rows(when, touch)

    def _clear(self, node: str, kind: str, when: str) -> None:
        assert self._open is not None
        if (node, kind) in self._open:
            self.store.clear_alert(node, kind, when)
            self._open.discard((node, kind))

    def reconcile_rows(self, when: str, touch: bool = True) -> None:
        """One row per cluster member; its state is what the agent reports, or why it cannot say."""
        for c in self.d.clusters.values():
            digest = self.d.models[c.model].digest
            for node in self.view.members(self.d, c):
                sid = server_id(c.name, node)
                reason: str | None
                if not self.view.online.get(node, False):
                    state, reason = "node_offline", f"node {node} is offline"
                else:
                    server = self.view.nodes[node].servers.get(sid)
                    if server is None:
                        state, reason = "missing", f"{node} reports no server {sid} (not applied yet?)"
                    elif server.model != digest and not (c.pipeline is not None and _slice_of(
                            self.view.nodes[node], server.model) == digest):
                        state, reason = "drifted", f"{node} runs {sid} with another model"
                    else:
                        state, reason = server.state, server.reason
                key = (c.name, node, c.model, c.port, state, reason)
                if self._rows_written.get(sid) != key:
                    self.store.put_server_row({"id": sid, "cluster": c.name, "node": node, "model": c.model,
                                               "port": c.port, "state": state, "reason": reason}, when)
                    self._rows_written[sid] = key
        if touch:
            self.store.touch_rows(when)

    def drift(self, observed: Observed) -> None:
        """Plan against what this beat saw (pure: plan() does no I/O) and say whether the fleet
        matches its file. A beat that changed nothing keeps the last plan: its inputs are the very
        same node objects (observe.py keeps each node an agent reports unchanged)."""
        nodes = tuple(observed.nodes.values())
        same = (self.view.plan is not None and len(nodes) == len(self._planned)
                and all(a is b for a, b in zip(nodes, self._planned))
                and frozenset(observed.manifests) == self._planned_manifests)
        if not same:
            self.view.plan = plan(self.d, observed)
            self._planned, self._planned_manifests = nodes, frozenset(observed.manifests)
        p = self.view.plan
        assert p is not None
        self.on_plan(p)
        when = self.now()
        if self._open is None:
            self._open = self.store.open_alert_keys()
        if not p.changes:
            self._clear(FLEET, DRIFT, when)
            return
        self.store.set_alert(FLEET, DRIFT, drift_cause(p), when)
        self._open.add((FLEET, DRIFT))

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await self.beat()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            await self.beat()


def drift_cause(p: Plan) -> str:
    """The plan's summary line, then each change by action and address, with the first line of
    its reason (a settings change by path: "changed: speculative.tokens 4 → 8"); the first SHOWN."""
    shown = [f"{c.action.value} {c.address} ({_short(c.reason)})" for c in p.changes[:SHOWN]]
    more = f", and {len(p.changes) - SHOWN} more" if len(p.changes) > SHOWN else ""
    return f"the fleet does not match its file. {p.summary()} " + ", ".join(shown) + more


def _short(reason: str, limit: int = 160) -> str:
    line = reason.splitlines()[0] if reason else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _slice_of(node: ObservedNode, digest: str) -> str | None:
    """The model a pipeline stage's weights are a slice of (its server reports the slice's digest)."""
    held = node.weights.get(digest)
    return held.slice_of if held is not None else None
