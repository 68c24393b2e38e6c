"""A placed member whose node goes offline stays a member that serve shows as offline (#35): its
members are the nodes whose agents reported its server, and a node that stops answering keeps
its last report in the heartbeat's view, so its row says node_offline rather than vanishing (and
the router names it among the members it could not use)."""

from __future__ import annotations

from pathlib import Path

from reconciler.core.observed import Observed, ObservedNode, ObservedServer
from reconciler.fleetfile import config
from reconciler.serve.heartbeat import Heartbeat
from reconciler.state.store import StateStore
from tests.unit.test_gpu_ledger import FLEET


def test_a_placed_member_on_a_node_gone_offline_is_shown_offline_not_dropped(tmp_path: Path) -> None:
    loaded = config.load_text(FLEET + "  chat: {model: llama, members: {count: 2, nodes: [gpu-a, gpu-b]}, "
                              "port: 9001}\n", "fleet.yaml")
    d = loaded.desired
    assert d is not None
    digest = d.models["llama"].digest

    def up(node: str) -> ObservedNode:
        sid = f"chat@{node}"
        return ObservedNode(node, servers={sid: ObservedServer(sid, "running", digest, 9001, {})})

    store = StateStore(tmp_path)
    beat = Heartbeat(d, lambda *a: None, store.serve, misses=2)  # type: ignore[arg-type]
    beat.record(Observed({"cp": ObservedNode("cp"), "gpu-a": up("gpu-a"), "gpu-b": up("gpu-b")}))
    assert beat.view.members(d, d.clusters["chat"]) == ("gpu-a", "gpu-b")
    for _ in range(2):  # two missed beats: offline
        beat.record(Observed({"cp": ObservedNode("cp"), "gpu-a": up("gpu-a"),
                              "gpu-b": ObservedNode("gpu-b", "node_unreachable", "connection refused")}))
    assert beat.view.members(d, d.clusters["chat"]) == ("gpu-a", "gpu-b")
    rows = {r["id"]: r for r in store.serve.server_rows()}
    assert rows["chat@gpu-a"]["state"] == "running"
    assert rows["chat@gpu-b"]["state"] == "node_offline", rows
    assert rows["chat@gpu-b"]["reason"] == "node gpu-b is offline"
