"""Workers answer only the router: a real agent starts real engines (llama.cpp for GGUF, PyTorch for
safetensors) with a credential of their own, which a request straight to the worker's port must
carry; the router, given it by the agent's state, relays as before; and the model is named by its
cluster, never by a store path, even on the worker's own port."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import trio

from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
from reconciler.core.observed import node_from_state
from reconciler.serve.heartbeat import View
from reconciler.serve.router import Router
from tests.agents import SECRET, Agent, free_port
from tests.fleets import import_model
from tests.models import tiny_gguf, tiny_safetensors

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {SECRET}"}
HOST = "127.0.0.2"
CLUSTERS = {"gguf": "local", "safetensors": "chat"}  # the cluster each format is served as, on node srv
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, dict[str, dict[str, Any]]]]:
    """One agent with a server of each engine running; the servers as its state reports them."""
    base = tmp_path_factory.mktemp("credential")
    agent = Agent("srv", HOST, free_port(HOST), base / "srv").start()
    try:
        servers = {}
        for fmt, make in (("gguf", tiny_gguf), ("safetensors", tiny_safetensors)):
            digest = import_model(agent, make(base / "models"))
            sid = f"{CLUSTERS[fmt]}@srv"
            r = httpx.post(f"{agent.url}/v1/servers", headers=AUTH, timeout=30, json={
                "id": sid, "model": digest, "port": free_port(HOST),
                "settings": {"context_length": 256, "threads": 1, "startup_timeout_s": 180}})
            assert r.status_code == 202, r.text
        for fmt in CLUSTERS:
            s = agent.wait_for(f"/v1/servers/{CLUSTERS[fmt]}@srv", ("running", "failed"), timeout=200, every=0.2)
            assert s["state"] == "running", s["reason"]
            servers[fmt] = s
        yield agent, servers
    finally:
        agent.stop()


def worker(s: dict[str, Any], path: str) -> str:
    return f"http://{HOST}:{s['port']}{path}"


@pytest.mark.parametrize("fmt", list(CLUSTERS))
def test_a_request_without_the_credential_is_refused(node: tuple[Agent, dict[str, dict[str, Any]]], fmt: str) -> None:
    _, servers = node
    s = servers[fmt]
    wrong = {"Authorization": "Bearer " + "x" * len(s["credential"])}
    for headers in ({}, wrong, {"Authorization": s["credential"]}, AUTH):  # none, wrong, no scheme, the agent's
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
            r = httpx.request(method, worker(s, path), headers=headers, json={**CHAT, "prompt": "x"}, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_worker_credential"
            assert r.headers["www-authenticate"].startswith("Bearer")
    health = "/v1/models" if fmt == "gguf" else "/health"
    assert httpx.get(worker(s, health), timeout=30).status_code == 401
    with socket.create_connection((HOST, s["port"]), timeout=30) as sock:  # nor a websocket upgrade
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: w\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        assert sock.recv(4096).split(b" ", 2)[1] in (b"401", b"403")


@pytest.mark.parametrize("fmt", list(CLUSTERS))
def test_with_the_credential_it_answers_naming_the_cluster(node: tuple[Agent, dict[str, dict[str, Any]]],
                                                          fmt: str) -> None:
    agent, servers = node
    s, cluster = servers[fmt], CLUSTERS[fmt]
    auth = {"Authorization": f"Bearer {s['credential']}"}
    models = httpx.get(worker(s, "/v1/models"), headers=auth, timeout=30)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [cluster], models.text
    one = httpx.get(worker(s, f"/v1/models/{cluster}"), headers=auth, timeout=30)
    assert one.status_code == 200 and one.json()["id"] == cluster
    # The client names no model, or another name: the answer still names the cluster.
    for asked in ({}, {"model": "something-else"}):
        streamed = httpx.post(worker(s, "/v1/chat/completions"), headers=auth, timeout=120,
                              json={**CHAT, **asked, "stream": True})
        assert streamed.status_code == 200, streamed.text
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert chunks and all(c["model"] == cluster for c in chunks), streamed.text
        for text in (streamed.text, models.text):
            assert str(agent.home) not in text and "/store/" not in text


@pytest.mark.parametrize("fmt", list(CLUSTERS))
def test_the_credential_is_not_on_the_command_line(node: tuple[Agent, dict[str, dict[str, Any]]], fmt: str) -> None:
    agent, servers = node
    s = servers[fmt]
    assert len(s["credential"]) >= 40  # token_urlsafe(32)
    cmdline = Path(f"/proc/{s['pid']}/cmdline").read_bytes()  # readable by every user on the machine
    assert s["credential"].encode() not in cmdline
    other = servers["gguf" if fmt == "safetensors" else "safetensors"]
    assert other["credential"] != s["credential"]  # one per server
    # The agent's API is where the credential is read, and it needs the cluster secret.
    assert httpx.get(f"{agent.url}/v1/state", timeout=10).status_code == 401


def test_the_router_relays_with_the_credential_from_the_agents_state(
        node: tuple[Agent, dict[str, dict[str, Any]]]) -> None:
    agent, servers = node
    state = agent.get("/v1/state").json()
    view = View(nodes={"srv": node_from_state("srv", state)}, online={"srv": True})
    # Only the router's view holds them: not the state kept for snapshots and the state store.
    kept = json.dumps(view.nodes["srv"].snapshot_entry())
    assert all(s["credential"] not in kept for s in servers.values()) and '"credential"' not in kept
    digest = "sha256:" + "0" * 64
    desired = Desired(1, ControlPlaneSpec("srv"), {"srv": NodeSpec("srv", HOST, agent.port)},
                      {"m": ModelSpec("m", "gguf", digest, "srv")}, (),
                      {cluster: ClusterSpec(cluster, "m", ("srv",), servers[fmt]["port"])
                       for fmt, cluster in CLUSTERS.items()})
    router = Router(desired, view)

    async def ask() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()), base_url="http://cp",
                                     timeout=120) as client:
            out = []
            for cluster in CLUSTERS.values():
                for stream in (False, True):
                    out.append(await client.post("/v1/chat/completions",
                                                 json={**CHAT, "model": cluster, "stream": stream}))
            return out

    answers = trio.run(ask)
    for r, (cluster, stream) in zip(answers, [(c, s) for c in CLUSTERS.values() for s in (False, True)]):
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]") and f'"model": "{cluster}"' in r.text.replace(
                '"model":"', '"model": "'), r.text
        else:
            assert r.json()["model"] == cluster


def test_a_worker_restarted_between_beats_is_asked_for_again(node: tuple[Agent, dict[str, dict[str, Any]]]) -> None:
    """The router holds the credential of the last beat; a member restarted since (a replace of a
    cluster of one, with no drain to tell serve) refuses it. The router asks that agent again, once
    for all the requests that found out together, and the requests are answered."""
    agent, servers = node
    stale = View(nodes={"srv": node_from_state("srv", agent.get("/v1/state").json())}, online={"srv": True})
    old = servers["gguf"]
    assert httpx.delete(f"{agent.url}/v1/servers/local@srv", headers=AUTH, timeout=60).status_code == 200
    r = httpx.post(f"{agent.url}/v1/servers", headers=AUTH, timeout=30, json={
        "id": "local@srv", "model": old["model"], "port": old["port"], "settings": old["settings"]})
    assert r.status_code == 202, r.text
    new = agent.wait_for("/v1/servers/local@srv", ("running", "failed"), timeout=200, every=0.2)
    assert new["state"] == "running" and new["credential"] != old["credential"], new["reason"]
    servers["gguf"] = new
    desired = Desired(1, ControlPlaneSpec("srv"), {"srv": NodeSpec("srv", HOST, agent.port)},
                      {"m": ModelSpec("m", "gguf", "sha256:" + "0" * 64, "srv")}, (),
                      {"local": ClusterSpec("local", "m", ("srv",), new["port"])})
    asked: list[list[str]] = []

    async def refresh(nodes: Any) -> None:
        asked.append(list(nodes))
        state = (await trio.to_thread.run_sync(lambda: agent.get("/v1/state"))).json()
        stale.nodes["srv"] = node_from_state("srv", state)

    async def ask(router: Router, streams: list[bool]) -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()), base_url="http://cp",
                                     timeout=120) as client:
            out: list[httpx.Response] = []

            async def one(stream: bool) -> None:
                out.append(await client.post("/v1/chat/completions", json={**CHAT, "model": "local", "stream": stream}))
            async with trio.open_nursery() as nursery:
                for stream in streams:
                    nursery.start_soon(one, stream)
            return out

    refused = trio.run(ask, Router(desired, stale), [True, False])  # nothing to ask with: said, not relayed
    assert [r.status_code for r in refused] == [502, 502], [r.text for r in refused]
    assert all("refused the credential" in r.text and r.json()["error"]["code"] == "no_member_answered"
               for r in refused)
    answered = trio.run(ask, Router(desired, stale, refresh=refresh), [True, False, True, False])
    assert [r.status_code for r in answered] == [200] * 4, [r.text for r in answered]
    assert asked == [["srv"]]  # once, for the four requests
