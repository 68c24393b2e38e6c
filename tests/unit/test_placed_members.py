"""A placed cluster's members are where its servers run (reconciler/planning/placement.members_of)."""

from __future__ import annotations

from reconciler.core.observed import Observed, ObservedNode, ObservedServer
from reconciler.fleetfile import config
from reconciler.planning.placement import members_of
from tests.unit.test_gpu_ledger import FLEET


def test_a_placed_cluster_is_served_where_its_servers_run_and_a_named_one_where_it_is_named() -> None:
    loaded = config.load_text(FLEET + "  chat: {model: llama, members: {count: 1}, port: 9001}\n"
                              "  code: {model: llama, members: [cp], port: 9002}\n", "fleet.yaml")
    d = loaded.desired
    assert d is not None
    running = {"chat@gpu-b": ObservedServer("chat@gpu-b", "running", "sha256:x", 9001, {})}
    o = Observed({"cp": ObservedNode("cp"), "gpu-a": ObservedNode("gpu-a"), "gpu-b": ObservedNode("gpu-b", servers=running)})
    assert members_of(d, o, "chat") == ("gpu-b",)
    assert members_of(d, o, "code") == ("cp",)
    assert members_of(d, Observed({}), "chat") == ()


def test_serve_routes_to_and_shows_a_placed_clusters_members() -> None:
    from reconciler.serve.heartbeat import View
    from reconciler.serve.overview import cluster_json

    loaded = config.load_text(FLEET + "  chat: {model: llama, members: {count: 1}, port: 9001}\n", "fleet.yaml")
    d = loaded.desired
    assert d is not None
    running = {"chat@gpu-b": ObservedServer("chat@gpu-b", "running", d.models["llama"].digest, 9001, {})}
    view = View(nodes={"cp": ObservedNode("cp"), "gpu-b": ObservedNode("gpu-b", servers=running)},
                online={"cp": True, "gpu-b": True})
    assert view.members(d, d.clusters["chat"]) == ("gpu-b",)  # ClusterSpec.members is empty for it
    shown = cluster_json(d, view, d.clusters["chat"], None)
    assert shown["members_total"] == 1 and shown["states"] == {"running": 1}, shown
    assert View().members(d, d.clusters["chat"]) == ()  # nothing reported yet: no member, not a crash
