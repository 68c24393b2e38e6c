"""AgentClient turns every kind of bad answer into an error naming the node (and the field)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from reconciler.client import AgentClient, AgentHTTPError, AgentProtocolError, NodeUnreachable
from reconciler.model import NodeSpec

NODE = NodeSpec(name="gpu-a", address="10.0.0.2", agent_port=7070)

GOOD: dict[str, Any] = {
    "identity": {"id": "b" * 32, "name": "gpu-a", "enrolled_at": "2026-01-01T00:00:00+00:00"},
    "agent_version": "0.1.0", "variant": {"accelerator": "cpu"},
    "inventory": {"cores": {"logical": 2, "usable": 2}, "memory": {"total_bytes": 1, "available_bytes": 1},
                  "disk": {"free_bytes": 1, "total_bytes": 2}, "gpus": [], "simulated": False},
    "availability": {"windows": [], "inside": True}, "observed_at": "2026-01-01T00:00:00+00:00",
    "weights": [], "servers": [],
}


def call(handler: Any) -> Any:
    async def go() -> Any:
        async with AgentClient("x" * 16, transport=httpx.MockTransport(handler)) as client:
            return await client.state(NODE)
    return trio.run(go)


def test_good_state_passes() -> None:
    assert call(lambda req: httpx.Response(200, json=GOOD))["identity"]["name"] == "gpu-a"


def test_sends_the_secret_as_a_bearer_token() -> None:
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen["auth"] = req.headers["authorization"]
        return httpx.Response(200, json=GOOD)

    call(handler)
    assert seen["auth"] == "Bearer " + "x" * 16


def test_not_json_is_a_protocol_error_naming_the_node() -> None:
    with pytest.raises(AgentProtocolError, match="gpu-a.*10.0.0.2:7070.*not JSON"):
        call(lambda req: httpx.Response(200, content=b"<html>proxy error</html>"))


@pytest.mark.parametrize("path, field", [
    (("identity",), "identity"),
    (("inventory", "memory"), "inventory.memory"),
    (("inventory", "gpus"), "inventory.gpus"),
])
def test_missing_field_is_named(path: tuple[str, ...], field: str) -> None:
    state = json.loads(json.dumps(GOOD))
    parent = state
    for part in path[:-1]:
        parent = parent[part]
    del parent[path[-1]]
    with pytest.raises(AgentProtocolError) as info:
        call(lambda req: httpx.Response(200, json=state))
    assert info.value.field == field and field in str(info.value)


def test_wrong_type_is_named() -> None:
    state = json.loads(json.dumps(GOOD))
    state["inventory"]["cores"]["logical"] = "two"
    with pytest.raises(AgentProtocolError) as info:
        call(lambda req: httpx.Response(200, json=state))
    assert info.value.field == "inventory.cores.logical"


def test_server_error_is_retryable_and_names_the_node() -> None:
    with pytest.raises(AgentHTTPError) as info:
        call(lambda req: httpx.Response(503, json={"error": {"code": "busy", "message": "disk full"}}))
    assert info.value.retryable and "gpu-a" in str(info.value) and "disk full" in str(info.value)


def test_timeout_is_unreachable() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("read timed out", request=req)

    with pytest.raises(NodeUnreachable, match="gpu-a.*timed out"):
        call(handler)
