"""The agent's and the workers' doors in process: what reaches the app behind them, and what a
request or a websocket without the right bearer gets instead."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from agent.auth import BearerAuth, WorkerAuth

SECRET = b"s" * 32


def knock(door_for: Any, scope_type: str, path: str, authorization: bytes | None) -> tuple[bool, list[dict[str, Any]]]:
    reached: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    headers = [(b"authorization", authorization)] if authorization is not None else []
    scope = {"type": scope_type, "path": path, "headers": headers}
    trio.run(door_for(app), scope, receive, send)
    return bool(reached), sent


DOORS = {"agent": lambda app: BearerAuth(app, SECRET), "worker": lambda app: WorkerAuth(app, SECRET.decode())}


@pytest.mark.parametrize("door", DOORS)
def test_the_right_bearer_reaches_the_app_over_http_and_websocket(door: str) -> None:
    for kind in ("http", "websocket"):
        reached, sent = knock(DOORS[door], kind, "/v1/state", b"Bearer " + SECRET)
        assert reached and not sent


@pytest.mark.parametrize("door, code", [("agent", "secret_wrong"), ("worker", "invalid_worker_credential")])
def test_a_wrong_bearer_is_a_401_with_a_json_code(door: str, code: str) -> None:
    reached, sent = knock(DOORS[door], "http", "/v1/state", b"Bearer nope")
    assert not reached and sent[0]["status"] == 401
    assert json.loads(sent[1]["body"])["error"]["code"] == code


@pytest.mark.parametrize("door", DOORS)
def test_a_websocket_without_the_bearer_is_closed_before_the_app(door: str) -> None:
    reached, sent = knock(DOORS[door], "websocket", "/v1/state", None)
    assert not reached and sent == [{"type": "websocket.close", "code": 1008}]


def test_the_agents_health_stays_public_and_lifespan_passes() -> None:
    assert knock(DOORS["agent"], "http", "/healthz", None)[0]
    assert knock(DOORS["agent"], "lifespan", "", None)[0]
