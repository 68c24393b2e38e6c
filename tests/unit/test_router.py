"""The router in-process (httpx's ASGI transport in front, an ASGI stand-in for the worker behind
through the router's fetch seam): member choice, 503 reasons, API keys, metrics. The upstream is a
tiny ASGI app standing in for a worker."""

from __future__ import annotations

import json
from typing import Any, Sequence

import httpx
import pytest
import trio
import trio.testing
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from net.client import ClientError, Fetch, Whole
from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
from reconciler.core.observed import node_from_state
from reconciler.serve.heartbeat import View
from reconciler.serve.router import RENEW_EVERY_S, Router

DIGEST = "sha256:" + "1" * 64
HOME = {"a": "/srv/a-home", "b": "/srv/b-home"}


def desired() -> Desired:
    nodes = {"cp": NodeSpec("cp", "10.0.0.1"), "a": NodeSpec("a", "10.0.0.2"), "b": NodeSpec("b", "10.0.0.3")}
    return Desired(1, ControlPlaneSpec("cp"), nodes, {"m": ModelSpec("m", "safetensors", DIGEST, "cp")}, (),
                   {"chat": ClusterSpec("chat", "m", ("a", "b"), 9001)})


def view(states: dict[str, str | None]) -> View:
    v = View()
    for node, state in states.items():
        v.online[node] = state != "offline"
        servers = [] if state in (None, "offline") else [{"id": f"chat@{node}", "state": state, "model": DIGEST,
                                                           "reason": "exited with code 1\nTraceback..."}]
        v.nodes[node] = node_from_state(node, {"servers": servers, "inventory": {"disk": {"path": HOME[node]}},
                                               "weights": [{"digest": DIGEST, "path": HOME[node] + "/store/models/abc"}]})
    return v


def asgi_fetch(app: Any) -> Fetch:
    """A worker stood in by an ASGI app, in the shape of net/client.py's one-shot fetch (the router's seam)."""
    transport = httpx.ASGITransport(app=app)

    async def fetch(method: str, host: str, port: int, target: str, *, body: bytes = b"",
                    headers: Sequence[tuple[str, str]] = ()) -> Whole:
        request = httpx.Request(method, f"http://{host}:{port}{target}", content=body, headers=list(headers))
        response = await transport.handle_async_request(request)
        return Whole(response.status_code, dict(response.headers), await response.aread())
    return fetch


def upstream() -> Fetch:
    async def completions(request: Request) -> JSONResponse:
        node = "a" if request.url.hostname == "10.0.0.2" else "b"
        return JSONResponse({"model": HOME[node] + "/store/models/abc", "served_by": node})
    return asgi_fetch(Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])]))


def call(router: Router, path: str = "/v1/completions", body: Any = None, headers: dict[str, str] | None = None,
         method: str = "POST") -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()), base_url="http://cp") as c:
            return await c.request(method, path, json=body, headers=headers or {})
    return trio.run(go)


def test_routes_to_a_running_member_and_scrubs_its_paths() -> None:
    router = Router(desired(), view({"a": "failed", "b": "running"}), transport=upstream())
    r = call(router, body={"model": "chat", "prompt": "x"})
    assert r.status_code == 200 and r.json() == {"model": "chat", "served_by": "b"}


def test_model_name_also_finds_its_cluster() -> None:
    router = Router(desired(), view({"a": "running", "b": "running"}), transport=upstream())
    assert call(router, body={"model": "m", "prompt": "x"}).json()["served_by"] == "a"


def test_no_running_member_is_503_with_every_reason() -> None:
    router = Router(desired(), view({"a": "offline", "b": "failed"}), transport=upstream())
    r = call(router, body={"model": "chat", "prompt": "x"})
    assert r.status_code == 503
    message = r.json()["error"]["message"]
    assert "'chat'" in message and "a: node offline" in message and "b: server failed (exited with code 1\nTraceback...)" in message


def test_api_keys_are_required_when_configured() -> None:
    router = Router(desired(), view({"a": "running", "b": "running"}), transport=upstream(), api_keys=["k-123"])
    assert call(router, body={"model": "chat"}).status_code == 401
    assert call(router, body={"model": "chat"}, headers={"Authorization": "Bearer k-124"}).status_code == 401
    ok = call(router, body={"model": "chat", "prompt": "x"}, headers={"Authorization": "Bearer k-123"})
    assert ok.status_code == 200
    assert call(router, "/v1/models", method="GET").status_code == 401


def test_metrics_count_requests_and_node_health() -> None:
    router = Router(desired(), view({"a": "running", "b": "offline"}), transport=upstream())
    call(router, body={"model": "chat", "prompt": "x"})
    call(router, body={"model": "nope", "prompt": "x"})
    text = call(router, "/metrics", method="GET").text
    assert 'fleet_requests_total{cluster="chat",status="200"} 1.0' in text
    assert 'fleet_requests_total{cluster="-",status="404"} 1.0' in text
    assert 'fleet_node_up{node="a"} 1.0' in text and 'fleet_node_up{node="b"} 0.0' in text
    assert json.loads(call(router, "/v1/models", method="GET").text)["data"][0]["id"] == "chat"


def test_a_member_that_does_not_answer_is_skipped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    inner = upstream()

    async def dead_a(method: str, host: str, port: int, target: str, *, body: bytes = b"",
                     headers: Sequence[tuple[str, str]] = ()) -> Whole:
        if host == "10.0.0.2":
            raise ClientError(f"cannot connect to {host}:{port}: Connection refused", started=False)
        return await inner(method, host, port, target, body=body, headers=headers)

    router = Router(desired(), view({"a": "running", "b": "running"}), transport=dead_a)
    r = call(router, body={"model": "chat", "prompt": "x"})
    assert r.status_code == 200 and r.json()["served_by"] == "b"
    assert "cluster chat: the member on a did not answer: cannot connect to 10.0.0.2:9001: Connection refused" in caplog.text


def test_no_member_answering_is_502_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def dead(method: str, host: str, port: int, target: str, *, body: bytes = b"",
                   headers: Sequence[tuple[str, str]] = ()) -> Whole:
        raise ClientError(f"cannot connect to {host}:{port}: Connection refused", started=False)

    router = Router(desired(), view({"a": "running", "b": "running"}), transport=dead)
    r = call(router, body={"model": "chat", "prompt": "x"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "no_member_answered"
    assert "no member of 'chat' answered: a: cannot connect to 10.0.0.2:9001" in caplog.text


def test_a_body_nested_too_deep_is_a_400_not_a_traceback() -> None:
    router = Router(desired(), view({"a": "running", "b": "running"}), transport=upstream())

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()), base_url="http://cp") as c:
            return await c.post("/v1/completions", content=b"[" * 100_000,
                                headers={"content-type": "application/json"})
    r = trio.run(go)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


def credentialed(credential: str) -> View:
    v = view({"a": "running", "b": "running"})
    v.nodes["a"] = node_from_state("a", {"servers": [{"id": "chat@a", "state": "running", "model": DIGEST,
                                                      "credential": credential}]})
    return v


def test_a_worker_that_keeps_refusing_asks_its_agent_at_most_once_an_interval() -> None:
    asked: list[str] = []
    router = Router(desired(), credentialed("old"), transport=upstream())

    async def refresh(nodes: list[str]) -> None:
        asked.extend(nodes)  # the agent reports the same credential: the worker still refuses it

    router.refresh = refresh
    clock = trio.testing.MockClock()

    async def go() -> None:
        for _ in range(20):
            assert await router.renewed("a", "chat@a", "old") is None
        assert asked == ["a"]
        clock.jump(RENEW_EVERY_S)
        assert await router.renewed("a", "chat@a", "old") is None
        assert asked == ["a", "a"]
    trio.run(go, clock=clock)


def test_a_client_that_leaves_does_not_cancel_the_renewal_others_wait_on() -> None:
    router = Router(desired(), credentialed("old"), transport=upstream())

    async def refresh(nodes: list[str]) -> None:
        await trio.sleep(0.05)
        router.view.nodes["a"] = credentialed("new").nodes["a"]

    router.refresh = refresh
    got: list[str | None] = []
    leaver = trio.CancelScope()

    async def asker() -> None:  # the request that asks the agent, whose client then hangs up
        with leaver:
            await router.renewed("a", "chat@a", "old")

    async def waiter() -> None:
        got.append(await router.renewed("a", "chat@a", "old"))

    async def go() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(asker)
            await trio.sleep(0.01)
            nursery.start_soon(waiter)
            await trio.sleep(0.01)
            leaver.cancel()
    trio.run(go)
    assert got == ["new"]
