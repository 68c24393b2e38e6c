"""The heartbeat's schedule and alert rules with a fake clock and an injected observer: no waiting,
no network. (tests/e2e/test_serve.py beats real agents.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
import trio.testing

from reconciler.core.desired import DEFAULT_STARTUP_TIMEOUT_S, ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
from reconciler.core.observed import Observed, ObservedNode, node_from_state
from reconciler.serve.heartbeat import Heartbeat
from reconciler.state.store import StateStore

DIGEST = "sha256:" + "1" * 64


def desired() -> Desired:
    nodes = {n: NodeSpec(n, f"10.0.0.{i}") for i, n in enumerate(["cp", "a"], 1)}
    models = {"m": ModelSpec("m", "safetensors", DIGEST, "cp")}
    return Desired(1, ControlPlaneSpec("cp"), nodes, models, (), {"chat": ClusterSpec("chat", "m", ("a",), 9001)})


class World:
    """Each node answers or not as the test says; each beat's (fake) time is kept. A node whose
    answer is the same as last time is the same object, as the heartbeat's observer keeps it."""

    def __init__(self) -> None:
        self.up = {"cp": True, "a": True}
        self.model = DIGEST
        self.server_state = "running"
        self.settings: dict[str, Any] = {"startup_timeout_s": DEFAULT_STARTUP_TIMEOUT_S}
        self.times: list[float] = []
        self.timeouts: list[float] = []
        self.asked: list[list[str] | None] = []
        self.last: dict[str, tuple[str, ObservedNode]] = {}

    async def observe(self, timeout: float, only: list[str] | None = None) -> Observed:
        self.times.append(trio.current_time())
        self.timeouts.append(timeout)
        self.asked.append(only)
        nodes = {}
        for n, up in self.up.items():
            if only is not None and n not in only:
                continue
            if up:
                servers = [{"id": "chat@a", "state": self.server_state, "model": self.model, "port": 9001,
                            "settings": self.settings}] if n == "a" and self.server_state else []
                weights = [{"digest": DIGEST, "format": "safetensors", "bytes": 10}] if n == "cp" else []
                state = {"servers": servers, "weights": weights, "inventory": {}}
                key = json.dumps(state, sort_keys=True)
                if self.last.get(n, ("", None))[0] != key:
                    self.last[n] = (key, node_from_state(n, state))
                nodes[n] = self.last[n][1]
            else:
                nodes[n] = ObservedNode(n, "node_unreachable", "connection refused")
        return Observed(nodes)


def test_beats_every_interval_on_a_fake_clock(tmp_path: Path) -> None:
    world = World()
    store = StateStore(tmp_path)

    async def main() -> None:
        beat = Heartbeat(desired(), world.observe, store.serve, interval=30, misses=2, timeout=45)
        async with trio.open_nursery() as nursery:
            await nursery.start(beat.run)
            await trio.sleep(95)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert world.times == [0, 30, 60, 90]
    assert world.timeouts == [30] * 4  # no node may take longer than a beat


def test_offline_after_the_stated_misses_then_cleared(tmp_path: Path) -> None:
    world = World()
    record = StateStore(tmp_path).serve
    beat = Heartbeat(desired(), world.observe, record, interval=30, misses=2, now=lambda: "T")

    def status(node: str) -> Any:
        return next(n["status"] for n in record.nodes() if n["name"] == node)

    async def main() -> None:
        await beat.beat()
        assert beat.view.online["a"] and record.server_rows()[0]["state"] == "running"
        world.up["a"] = False
        await beat.beat()  # one miss: not yet an outage
        assert record.alerts() == [] and status("a") == "missed" and beat.view.online["a"]
        await beat.beat()  # the second: node_offline, rows marked
        (alert,) = record.alerts()
        assert alert["node"] == "a" and alert["kind"] == "node_offline"
        assert alert["cause"] == "node_unreachable: connection refused"
        assert not beat.view.online["a"] and status("a") == "offline"
        assert record.server_rows()[0]["state"] == "node_offline"
        await beat.beat()  # still down: one alert, not one per beat
        assert len(record.alerts()) == 1
        world.up["a"] = True
        await beat.beat()
        assert record.alerts() == [] and record.alerts(include_cleared=True)[0]["cleared_at"] == "T"
        assert record.server_rows()[0]["state"] == "running" and status("a") == "online"

    trio.run(main)


def test_a_member_running_another_model_is_drifted(tmp_path: Path) -> None:
    world = World()
    record = StateStore(tmp_path).serve
    beat = Heartbeat(desired(), world.observe, record, interval=30)

    async def main() -> None:
        world.model = "sha256:" + "2" * 64
        await beat.beat()
        (row,) = record.server_rows()
        assert row["state"] == "drifted" and "another model" in row["reason"]
        world.model = DIGEST
        await beat.beat()
        assert record.server_rows()[0]["state"] == "running"

    trio.run(main)


def test_the_state_kept_for_a_node_is_what_it_sent(tmp_path: Path) -> None:
    world = World()
    record = StateStore(tmp_path).serve
    trio.run(Heartbeat(desired(), world.observe, record).beat)
    a = next(n for n in record.nodes() if n["name"] == "a")
    assert a["state"]["servers"] == [{"id": "chat@a", "state": "running", "model": DIGEST, "port": 9001,
                                      "settings": {"startup_timeout_s": DEFAULT_STARTUP_TIMEOUT_S}}]


def drift_alerts(record: Any) -> list[dict[str, Any]]:
    return [a for a in record.alerts(include_cleared=True) if a["kind"] == "drift"]


def test_drift_raised_with_the_plan_then_cleared_and_nothing_acted_on(tmp_path: Path) -> None:
    world = World()
    record = StateStore(tmp_path).serve
    plans: list[Any] = []
    beat = Heartbeat(desired(), world.observe, record, now=lambda: "T", on_plan=plans.append)

    async def main() -> None:
        await beat.beat()
        assert drift_alerts(record) == [] and not plans[-1].changes
        world.server_state = ""  # stopped behind fleet's back: the agent reports no server
        await beat.beat()
        (alert,) = drift_alerts(record)
        assert alert["node"] == "fleet" and alert["cleared_at"] is None
        assert "Plan: 0 to replicate, 1 to start, 0 to replace, 0 to stop, 0 to delete." in alert["cause"]
        assert "start server.chat@a" in alert["cause"]
        world.settings = {"startup_timeout_s": DEFAULT_STARTUP_TIMEOUT_S, "speculative": {"mode": "ngram"}}
        world.server_state = "running"  # back, with a nested setting fleet.yaml does not ask for
        await beat.beat()
        (alert,) = drift_alerts(record)  # the same alert, its cause brought up to date
        assert "replace server.chat@a (changed: speculative.mode ngram → unset)" in alert["cause"]
        assert alert["cleared_at"] is None
        world.settings = {"startup_timeout_s": DEFAULT_STARTUP_TIMEOUT_S}
        await beat.beat()
        (alert,) = drift_alerts(record)
        assert alert["cleared_at"] == "T" and not plans[-1].changes

    trio.run(main)
    assert world.asked == [None] * 4  # it only observed: no call but the beats'


def test_a_quiet_beat_plans_nothing_again_and_rewrites_no_row(tmp_path: Path) -> None:
    world = World()
    store = StateStore(tmp_path)
    beat = Heartbeat(desired(), world.observe, store.serve, now=lambda: "T")

    async def main() -> None:
        await beat.beat()
        first = beat.view.plan
        before = store.db.total_changes
        await beat.beat()  # every node the same object: the same plan, and only the two touches
        assert beat.view.plan is first
        assert store.db.total_changes - before == len(store.serve.nodes()) + len(store.serve.server_rows())
        world.server_state = "failed"
        await beat.beat()
        assert beat.view.plan is not first and beat.view.plan is not None and beat.view.plan.changes

    trio.run(main)


def test_refresh_asks_only_the_nodes_named(tmp_path: Path) -> None:
    world = World()
    record = StateStore(tmp_path).serve
    beat = Heartbeat(desired(), world.observe, record)

    async def main() -> None:
        await beat.beat()
        world.server_state = "starting"
        await beat.refresh(["a"])
        assert world.asked[-1] == ["a"] and beat.view.nodes["a"].servers["chat@a"].state == "starting"
        assert record.server_rows()[0]["state"] == "starting"

    trio.run(main)
