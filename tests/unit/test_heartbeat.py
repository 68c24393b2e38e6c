"""The heartbeat's schedule and alert rules with a fake clock and an injected observer: no waiting,
no network. (tests/e2e/test_serve.py beats real agents.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
import trio.testing

from reconciler.model import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
from reconciler.observed import Observed, ObservedNode, node_from_state
from reconciler.serve.heartbeat import Heartbeat
from reconciler.state_store import StateStore

DIGEST = "sha256:" + "1" * 64


def desired() -> Desired:
    nodes = {n: NodeSpec(n, f"10.0.0.{i}") for i, n in enumerate(["cp", "a"], 1)}
    models = {"m": ModelSpec("m", "safetensors", DIGEST, "cp")}
    return Desired(1, ControlPlaneSpec("cp"), nodes, models, (), {"chat": ClusterSpec("chat", "m", ("a",), 9001)})


class World:
    """Each node answers or not as the test says; each beat's (fake) time is kept."""

    def __init__(self) -> None:
        self.up = {"cp": True, "a": True}
        self.model = DIGEST
        self.times: list[float] = []
        self.timeouts: list[float] = []

    async def observe(self, timeout: float) -> Observed:
        self.times.append(trio.current_time())
        self.timeouts.append(timeout)
        nodes = {}
        for n, up in self.up.items():
            if up:
                servers = [{"id": "chat@a", "state": "running", "model": self.model}] if n == "a" else []
                nodes[n] = node_from_state(n, {"servers": servers, "weights": [], "inventory": {}})
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
    assert a["state"]["servers"] == [{"id": "chat@a", "state": "running", "model": DIGEST}]
