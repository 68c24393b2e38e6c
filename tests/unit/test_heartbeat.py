"""The heartbeat's schedule and alert rules with a fake clock and a fake observation: no waiting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from reconciler.model import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
from reconciler.serve import heartbeat as hb
from reconciler.store import Store

DIGEST = "sha256:" + "1" * 64


def desired() -> Desired:
    nodes = {n: NodeSpec(n, f"10.0.0.{i}") for i, n in enumerate(["cp", "a"], 1)}
    models = {"m": ModelSpec("m", "safetensors", DIGEST, "cp")}
    return Desired(1, ControlPlaneSpec("cp"), nodes, models, (), {"chat": ClusterSpec("chat", "m", ("a",), 9001)})


def state(servers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"servers": servers, "weights": [], "inventory": {}}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """observe() replaced: each node answers or not as the test says, and beats are counted with
    the (fake) time at which they happened."""
    world: dict[str, Any] = {"up": {"cp": True, "a": True}, "times": []}

    async def observe(d: Desired, client: Any, timeout: float) -> dict[str, Any]:
        world["times"].append(trio.current_time())
        nodes = {}
        for n in d.nodes:
            if world["up"][n]:
                servers = [{"id": "chat@a", "state": "running", "model": DIGEST}] if n == "a" else []
                nodes[n] = {"state": state(servers), "error": None}
            else:
                nodes[n] = {"state": None, "error": {"code": "node_unreachable", "message": "connection refused"}}
        return {"nodes": nodes, "manifests": {}}

    monkeypatch.setattr(hb, "observe", observe)
    return world


def test_beats_every_interval_on_a_fake_clock(fake: dict[str, Any], tmp_path: Path) -> None:
    store = Store(tmp_path)

    async def main() -> None:
        beat = hb.Heartbeat(desired(), None, store, interval=30, misses=2)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            await nursery.start(beat.run)
            await trio.sleep(95)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert fake["times"] == [0, 30, 60, 90]


def test_offline_after_the_stated_misses_then_cleared(fake: dict[str, Any], tmp_path: Path) -> None:
    store = Store(tmp_path)
    beat = hb.Heartbeat(desired(), None, store, interval=30, misses=2, now=lambda: "T")  # type: ignore[arg-type]

    async def main() -> None:
        await beat.beat()
        assert beat.view.online["a"] and store.server_rows()[0]["state"] == "running"
        fake["up"]["a"] = False
        await beat.beat()  # one miss: not yet an outage
        assert store.alerts() == [] and [n["status"] for n in store.nodes() if n["name"] == "a"] == ["missed"]
        await beat.beat()  # the second: node_offline, rows marked
        (alert,) = store.alerts()
        assert alert["node"] == "a" and alert["kind"] == "node_offline" and "connection refused" in alert["cause"]
        assert not beat.view.online["a"]
        assert store.server_rows()[0]["state"] == "node_offline"
        await beat.beat()  # still down: one alert, not one per beat
        assert len(store.alerts()) == 1
        fake["up"]["a"] = True
        await beat.beat()
        assert store.alerts() == [] and store.alerts(include_cleared=True)[0]["cleared_at"] == "T"
        assert store.server_rows()[0]["state"] == "running"

    trio.run(main)
