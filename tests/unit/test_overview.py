"""The status page's data (reconciler/serve/overview.py) from a View built the way the heartbeat
builds it, and its app (serve/ui/app.py) in-process through the router: access by key or cookie,
the files it serves, paging at 10,000 nodes, paths scrubbed."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
from reconciler.core.observed import node_from_state
from reconciler.serve import overview as ov
from reconciler.serve.heartbeat import View
from reconciler.serve.metrics import ServeMetrics
from reconciler.serve.router import Router
from reconciler.serve.ui.app import COOKIE, StatusPage, sample, session_token

DIGEST = "sha256:" + "1" * 64
OTHER = "sha256:" + "2" * 64
GIB = 2**30
HOSTILE = "<img src=x onerror=alert(1)>"


def desired(nodes: int = 3) -> Desired:
    names = ["cp", "a", "b"] + [f"n{i:05d}" for i in range(max(0, nodes - 3))]
    specs = {n: NodeSpec(n, f"10.0.{i // 250}.{i % 250 + 1}") for i, n in enumerate(names)}
    return Desired(1, ControlPlaneSpec("cp"), specs, {"m": ModelSpec("m", "safetensors", DIGEST, "cp")}, (),
                   {"chat": ClusterSpec("chat", "m", ("a", "b"), 9001)})


def state(node: str, server: str | None = None, reason: str | None = None, **extra: Any) -> dict[str, Any]:
    home = f"/srv/{node}-home"
    s: dict[str, Any] = {
        "agent_version": "0.9", "observed_at": "2026-12-02T06:00:00+00:00", "variant": {"accelerator": "cuda"},
        "inventory": {"cores": {"logical": 16, "usable": 12}, "memory": {"total_bytes": 64 * GIB, "available_bytes": 40 * GIB},
                      "disk": {"path": home, "total_bytes": 500 * GIB, "free_bytes": 200 * GIB, "reserve_bytes": 10 * GIB},
                      "gpus": [{"index": 0, "name": "H100", "uuid": "GPU-0", "memory_total_bytes": 80 * GIB,
                                "memory_free_bytes": 50 * GIB}], "simulated": True},
        "availability": {"windows": ["22:00-06:00"], "inside": True, "current_ends_at": "2026-12-02T06:00:00+00:00"},
        "weights": [{"digest": DIGEST, "name": "m", "format": "safetensors", "bytes": GIB, "path": home + "/store/m",
                     "integrity": {"state": "verified"}}],
        "fetches": [], "servers": [],
    }
    if server is not None:
        s["servers"] = [{"id": f"chat@{node}", "state": server, "model": DIGEST, "port": 9001, "reason": reason,
                         "gpus": [{"index": 0, "uuid": "GPU-0", "bytes": 20 * GIB}]}]
    s.update(extra)
    return s


def view(**states: dict[str, Any] | None) -> View:
    """None: a node that missed beats until it went offline."""
    v = View()
    for node, st in states.items():
        if st is None:
            v.online[node], v.misses[node] = False, 2
            continue
        v.nodes[node] = node_from_state(node, st)
        v.online[node], v.misses[node] = True, 0
    v.beats = 3
    return v


def test_a_node_with_its_gpus_holdings_servers_and_window() -> None:
    reason = "exited with code 1\nTraceback: /srv/a-home/store/m/model.safetensors is bad\n  in /usr/lib/python3/x.py"
    v = view(cp=state("cp"), a=state("a", "failed", reason), b=None)
    o = ov.overview(desired(), v)
    nodes = {n["name"]: n for n in o["nodes"]["items"]}
    assert [n["name"] for n in o["nodes"]["items"]] == ["b", "a", "cp"]  # offline first
    assert nodes["b"]["status"] == "offline" and nodes["b"]["last_seen"] is None
    a = nodes["a"]
    assert a["status"] == "online" and a["last_seen"] == "2026-12-02T06:00:00+00:00"
    assert a["gpus"] == [{"index": 0, "name": "H100", "total": 80 * GIB, "free": 50 * GIB, "fleet": 20 * GIB,
                          "others": 10 * GIB}]
    assert a["cores"] == {"logical": 16, "usable": 12} and a["disk"]["free"] == 200 * GIB
    assert a["availability"]["windows"] == ["22:00-06:00"] and a["availability"]["inside"] is True
    assert a["holds"][0]["model"] == "m" and a["holds"][0]["verification"] == "verified"
    run = a["runs"][0]
    # The full reason, every line, with the node's store path scrubbed as the router scrubs it, and other paths too.
    assert run["state"] == "failed" and run["reason"].splitlines()[0] == "exited with code 1"
    assert "Traceback: chat/model.safetensors is bad" in run["reason"] and "<path>" in run["reason"] and "/srv" not in run["reason"]
    assert o["summary"]["statuses"] == {"online": 2, "missed": 0, "offline": 1, "unknown": 0}
    assert o["summary"]["gpus"]["fleet"] == 20 * GIB and o["summary"]["gpus"]["count"] == 2


def test_a_clusters_members_with_their_states_and_reasons() -> None:
    v = view(cp=state("cp"), a=state("a", "failed", "out of memory at /srv/a-home/store/m"), b=state("b", "running"))
    c = ov.overview(desired(), v)["clusters"][0]
    assert c["name"] == "chat" and c["serving"] is True and c["states"] == {"failed": 1, "running": 1}
    assert c["members"][0] == {"node": "a", "state": "failed", "reason": "out of memory at chat", "id": "chat@a"}
    v.draining.add("chat@b")
    c = ov.overview(desired(), v)["clusters"][0]
    assert c["states"] == {"failed": 1, "drained": 1} and c["serving"] is False
    v.online["b"], v.misses["b"] = False, 2
    assert ov.overview(desired(), v)["clusters"][0]["states"] == {"failed": 1, "node_offline": 1}


def test_a_missed_beat_and_a_node_never_asked() -> None:
    v = view(cp=state("cp"), a=state("a"))
    v.misses["a"] = 1  # the heartbeat keeps it online until its misses reach the threshold
    o = ov.overview(desired(), v)
    assert {n["name"]: n["status"] for n in o["nodes"]["items"]} == {"a": "missed", "b": "unknown", "cp": "online"}


def test_weights_corrupt_named_and_a_replication_with_bytes_and_rate() -> None:
    corrupt = state("a", weights=[{"digest": DIGEST, "name": "m", "format": "safetensors", "bytes": GIB,
                                   "path": "/srv/a-home/store/m",
                                   "integrity": {"state": "corrupt", "file": "model.safetensors", "reason": "digest differs"}}])
    fetching = state("b", fetches=[{"digest": DIGEST, "state": "fetching", "peer": "10.0.0.2:7070", "layers": None,
                                    "bytes_total": 1000, "bytes_done": 250, "bytes_fetched": 250,
                                    "rate_bytes_per_s": 125, "error": None}], weights=[])
    w = ov.overview(desired(), view(cp=state("cp"), a=corrupt, b=fetching))["weights"]
    m = w["models"][0]
    assert m["name"] == "m" and m["holders_total"] == 2 and m["corrupt"] == 1
    assert m["holders"][0] == {"node": "a", "layers": None, "verification": "corrupt",
                               "corrupt": "model.safetensors: digest differs", "key_missing": None, "bytes": GIB}
    assert w["replications"] == [{"node": "b", "digest": DIGEST, "model": "m", "state": "fetching",
                                  "peer": "10.0.0.2:7070", "layers": None, "bytes_total": 1000, "bytes_done": 250,
                                  "rate": 125, "error": None}]


def test_alerts_open_first_then_newest_and_causes_scrubbed() -> None:
    alerts = [{"id": 1, "node": "a", "kind": "node_offline", "cause": "x", "raised_at": "t1", "cleared_at": "t2"},
              {"id": 2, "node": "fleet", "kind": "drift", "cause": "1 to start", "raised_at": "t3", "cleared_at": None},
              {"id": 3, "node": "b", "kind": "node_offline", "cause": "at /srv/b-home/x", "raised_at": "t4",
               "cleared_at": "t5"}]
    out = ov.alerts_json(alerts, view(b=state("b")))
    assert [a["id"] for a in out] == [2, 3, 1] and out[1]["cause"] == "at <path>"


def test_an_apply_with_its_outcome() -> None:
    row = (7, "2026-12-02T06:00:00+00:00", "2026-12-02T06:01:00+00:00", "sha256:c", "Plan: 1 to start.")
    results = [{"address": "server.chat@a", "action": "start", "status": "failed", "message": "boom in /opt/x/y.py",
                "code": "server_failed"}, {"address": "weights.m@b", "action": "replicate", "status": "done"}]
    a = ov.apply_json(row, results)
    assert a["outcome"] == "failed" and a["actions"] == 2 and a["failed"] == 1
    assert a["failures"] == [{"address": "server.chat@a", "action": "start", "code": "server_failed",
                              "message": "boom in <path>"}]


def test_quantile_interpolates_within_a_bucket() -> None:
    buckets = ((0.1, 0.0), (0.5, 50.0), (1.0, 100.0), (float("inf"), 100.0))
    assert ov.quantile(0.5, buckets) == 0.5
    assert ov.quantile(0.25, buckets) == 0.1 + 0.4 * 0.5
    assert ov.quantile(0.99, buckets) == 0.5 + 0.5 * 0.98
    assert ov.quantile(0.5, ((1.0, 0.0), (float("inf"), 0.0))) is None


def test_rates_over_the_window_from_the_routers_counters() -> None:
    metrics = ServeMetrics()
    sampler = ov.Sampler(window_s=60)
    sampler.add(sample(metrics, 0.0))
    for _ in range(10):
        metrics.requests.labels("chat", "200").inc()
        metrics.latency.labels("chat").observe(0.2)
    metrics.requests.labels("chat", "503").inc()
    metrics.answered("chat", b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 40}}\n\ndata: [DONE]\n\n')
    sampler.add(sample(metrics, 10.0))
    t = sampler.traffic()["chat"]
    assert t.requests_per_s == 1.1 and t.errors_per_s == 0.1 and t.tokens_per_s == 4.0 and t.requests == 11
    assert t.p50_s is not None and 0.1 < t.p50_s <= 0.25


def test_ten_thousand_nodes_summarised_and_paged() -> None:
    d = desired(10_000)
    v = View()
    st = state("n")
    for i, name in enumerate(d.nodes):
        if i % 1000 == 7:
            v.online[name], v.misses[name] = False, 2
        else:
            v.nodes[name] = node_from_state(name, st)
            v.online[name], v.misses[name] = True, 0
    o = ov.overview(d, v, page=1, per_page=100)
    assert o["summary"]["nodes"] == 10_000 and o["summary"]["statuses"]["offline"] == 10
    assert o["nodes"]["pages"] == 100 and o["nodes"]["page"] == 1 and len(o["nodes"]["items"]) == 100
    first = ov.overview(d, v)["nodes"]["items"]
    assert [n["status"] for n in first[:10]] == ["offline"] * 10 and first[10]["status"] == "online"
    picked = ov.overview(d, v, query="n0999", status="online")["nodes"]
    assert picked["total"] == 7 and all("n0999" in n["name"] for n in picked["items"])
    assert len(ov.overview(d, v, per_page=10**6)["nodes"]["items"]) == ov.MAX_PER_PAGE
    assert len(json.dumps(o)) < 2_000_000


# ---- the app, through the router ----

def call(router: Router, method: str, path: str, cookies: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()), base_url="http://cp",
                                     cookies=cookies) as c:
            return await c.request(method, path, **kw)
    return trio.run(go)


def routed(keys: list[str] | None = None) -> Router:
    v = view(cp=state("cp"), a=state("a", "failed", HOSTILE + " at /srv/a-home/store/m"), b=state("b", "running"))
    router = Router(desired(), v, api_keys=keys)
    router.ui = StatusPage(router.d, v, router.metrics, None, router.keys)
    return router


def test_without_keys_the_page_and_its_data_are_open() -> None:
    router = routed()
    page = call(router, "GET", "/ui")
    assert page.status_code == 200 and b'<script type="module" src="/ui/static/app.js">' in page.content
    assert "script-src 'self'" in page.headers["content-security-policy"]
    data = call(router, "GET", "/ui/api/overview").json()
    assert data["auth"] is False and data["clusters"][0]["name"] == "chat"
    member = data["clusters"][0]["members"][0]
    # The text arrives as it was reported (the page puts it in as text), less the paths.
    assert member["reason"] == HOSTILE + " at chat"
    for name in ("app.js", "render.js", "playground.js", "style.css"):
        r = call(router, "GET", f"/ui/static/{name}")
        assert r.status_code == 200 and r.content
    assert call(router, "GET", "/ui/static/../app.py").status_code == 404
    assert call(router, "GET", "/ui/nothing").status_code == 404


def test_with_keys_the_data_needs_the_key_or_the_login_cookie() -> None:
    router = routed(["k-123"])
    assert call(router, "GET", "/ui/api/overview").status_code == 401
    assert call(router, "GET", "/ui/api/events").status_code == 401
    assert call(router, "GET", "/ui/static/app.js").status_code == 401
    page = call(router, "GET", "/ui")
    assert page.status_code == 401 and b'action="/ui/login"' in page.content
    assert call(router, "GET", "/ui/static/style.css").status_code == 200  # the login page's style
    assert call(router, "GET", "/ui/api/overview", headers={"authorization": "Bearer k-123"}).status_code == 200
    assert call(router, "GET", "/ui/api/overview", headers={"authorization": "Bearer nope"}).status_code == 401
    wrong = call(router, "POST", "/ui/login", content=b"key=nope",
                 headers={"content-type": "application/x-www-form-urlencoded"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers and b'<p id="refused">' in wrong.content
    login = call(router, "POST", "/ui/login", content=b"key=k-123",
                 headers={"content-type": "application/x-www-form-urlencoded"})
    assert login.status_code == 303 and login.headers["location"] == "/ui"
    cookie = login.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and "k-123" not in cookie
    token = session_token(b"k-123")
    assert f"{COOKIE}={token}" in cookie
    ok = call(router, "GET", "/ui/api/overview", cookies={COOKIE: token})
    assert ok.status_code == 200 and ok.json()["auth"] is True
    assert call(router, "GET", "/ui/api/overview", cookies={COOKIE: session_token(b"other")}).status_code == 401
    # The OpenAI routes still ask for the key itself: the cookie opens the page, not the API.
    assert call(router, "GET", "/v1/models", cookies={COOKIE: token}).status_code == 401


def test_many_clusters_those_not_running_first_and_every_name_for_the_playground() -> None:
    base = desired(300)
    names = list(base.nodes)
    clusters = {f"c{k}": ClusterSpec(f"c{k}", "m", (names[k],), 9001) for k in range(300)}
    d = Desired(1, base.control_plane, base.nodes, base.models, (), clusters)
    v = View()
    for k, name in enumerate(names):
        st = state(name)
        st["servers"] = [{"id": f"c{k}@{name}", "state": "failed" if k == 250 else "running", "model": DIGEST,
                          "port": 9001, "reason": "boom"}]
        v.nodes[name], v.online[name], v.misses[name] = node_from_state(name, st), True, 0
    o = ov.overview(d, v)
    assert o["clusters_total"] == 300 and len(o["clusters"]) == ov.CLUSTERS_SHOWN
    assert o["clusters"][0]["name"] == "c250" and o["clusters"][0]["members"][0]["reason"] == "boom"
    assert [c["name"] for c in o["cluster_names"]] == list(clusters)
