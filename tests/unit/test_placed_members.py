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


def test_the_views_placed_members_follow_each_change_of_the_nodes_and_answer_as_members_of() -> None:
    """View.members works a placed cluster's members out once per change of the view's nodes (a
    beat's, a refresh's, a leader's), for every placed cluster at once: each answer equals
    members_of on the same nodes, also right after a node's report changed."""
    from reconciler.serve.heartbeat import View

    loaded = config.load_text(FLEET + "  chat: {model: llama, members: {count: 2}, port: 9001}\n"
                              "  code: {model: llama, members: {count: 1}, port: 9002}\n", "fleet.yaml")
    d = loaded.desired
    assert d is not None

    def srv(sid: str) -> ObservedServer:
        return ObservedServer(sid, "running", d.models["llama"].digest, 9001, {})

    view = View(nodes={"gpu-b": ObservedNode("gpu-b", servers={"chat@gpu-b": srv("chat@gpu-b")}),
                       # an id not of this node (nor fleet's) names no member
                       "cp": ObservedNode("cp", servers={"chat@gpu-a": srv("chat@gpu-a"), "x": srv("x")})})

    def agree() -> dict[str, tuple[str, ...]]:
        got = {name: view.members(d, d.clusters[name]) for name in ("chat", "code")}
        assert got == {name: members_of(d, Observed(dict(view.nodes)), name) for name in ("chat", "code")}
        return got

    assert agree() == {"chat": ("gpu-b",), "code": ()}
    view.nodes["gpu-a"] = ObservedNode("gpu-a", servers={"chat@gpu-a": srv("chat@gpu-a"), "code@gpu-a": srv("code@gpu-a")})
    assert agree() == {"chat": ("gpu-a", "gpu-b"), "code": ("gpu-a",)}  # the file's order
    view.nodes["gpu-b"] = ObservedNode("gpu-b")  # its server gone from its report
    assert agree() == {"chat": ("gpu-a",), "code": ("gpu-a",)}
    del view.nodes["gpu-a"]
    assert agree() == {"chat": (), "code": ()}
