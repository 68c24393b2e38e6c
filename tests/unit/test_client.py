"""AgentClient turns every kind of bad answer into an error naming the node (and the field). The
answers travel in memory (MemoryTransport) but are read, at every cut, by the reader production
runs on its sockets; tests/unit/test_client_state.py sends the same over loopback."""

from __future__ import annotations

import errno
import json
from typing import Any

import pytest
import trio
import trio.testing
from starlette.responses import JSONResponse, Response, StreamingResponse

from reconciler.agents.client import AgentClient, AgentHTTPError, AgentProtocolError, NodeAuthRejected, NodeUnreachable
from reconciler.core.desired import NodeSpec
from reconciler.agents.transport import ANSWER_LIMIT
from tests.memory_transport import Answer, MemoryTransport, asgi

NODE = NodeSpec(name="gpu-a", address="10.0.0.2", agent_port=7070)

GOOD: dict[str, Any] = {
    "identity": {"id": "b" * 32, "name": "gpu-a", "enrolled_at": "2026-01-01T00:00:00+00:00"},
    "agent_version": "0.1.0", "variant": {"accelerator": "cpu"},
    "inventory": {"cores": {"logical": 2, "usable": 2}, "memory": {"total_bytes": 1, "available_bytes": 1},
                  "disk": {"free_bytes": 1, "total_bytes": 2}, "gpus": [], "simulated": False},
    "availability": {"windows": [], "inside": True}, "observed_at": "2026-01-01T00:00:00+00:00",
    "weights": [], "servers": [],
}

PIECES = [1, 5, 65536]  # the answer read a byte at a time, in odd pieces, and whole


def call(answer: Answer, *, piece: int = 65536, timeout: float = 10.0) -> Any:
    async def go() -> Any:
        async with AgentClient("x" * 16, timeout=timeout, transport=MemoryTransport(answer, piece=piece)) as client:
            return await client.state(NODE)
    return trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))


def raw(data: bytes) -> Answer:
    async def answer(request: bytes) -> bytes:
        return data
    return answer


def state_with(change: Any) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(json.dumps(GOOD))
    change(state)
    return state


@pytest.mark.parametrize("piece", PIECES)
def test_good_state_passes(piece: int) -> None:
    assert call(asgi(JSONResponse(GOOD)), piece=piece) == GOOD


def test_sends_the_secret_as_a_bearer_token_on_a_request_of_its_own() -> None:
    seen: list[bytes] = []

    async def answer(request: bytes) -> bytes:
        seen.append(request)
        return await asgi(JSONResponse(GOOD))(request)

    call(answer)
    head = seen[0].split(b"\r\n")
    assert head[0] == b"GET /v1/state HTTP/1.1"
    assert b"Authorization: Bearer " + b"x" * 16 in head and b"Connection: close" in head


def test_not_json_is_a_protocol_error_naming_the_node() -> None:
    with pytest.raises(AgentProtocolError, match="gpu-a.*10.0.0.2:7070.*not JSON"):
        call(asgi(Response(b"<html>proxy error</html>")))


@pytest.mark.parametrize("path, field", [
    (("identity",), "identity"),
    (("inventory", "memory"), "inventory.memory"),
    (("inventory", "gpus"), "inventory.gpus"),
])
def test_missing_field_is_named(path: tuple[str, ...], field: str) -> None:
    def drop(state: dict[str, Any]) -> None:
        parent = state
        for part in path[:-1]:
            parent = parent[part]
        del parent[path[-1]]

    with pytest.raises(AgentProtocolError) as info:
        call(asgi(JSONResponse(state_with(drop))))
    assert info.value.field == field and field in str(info.value)


def test_wrong_type_is_named() -> None:
    with pytest.raises(AgentProtocolError) as info:
        call(asgi(JSONResponse(state_with(lambda s: s["inventory"]["cores"].update(logical="two")))))
    assert info.value.field == "inventory.cores.logical"


def test_server_error_is_retryable_and_names_the_node() -> None:
    with pytest.raises(AgentHTTPError) as info:
        call(asgi(JSONResponse({"error": {"code": "busy", "message": "disk full"}}, status_code=503)))
    assert info.value.retryable and "gpu-a" in str(info.value) and "disk full" in str(info.value)


def test_a_rejected_secret_is_final() -> None:
    with pytest.raises(NodeAuthRejected) as info:
        call(asgi(JSONResponse({"error": {"code": "bad_secret", "message": "wrong secret"}}, status_code=401)))
    assert not info.value.retryable and "wrong secret" in str(info.value)


def test_no_answer_in_time_is_unreachable_and_retryable() -> None:
    async def answer(request: bytes) -> bytes:
        await trio.sleep_forever()
        raise AssertionError

    with pytest.raises(NodeUnreachable, match="gpu-a.*timed out \\(no answer within 2s\\)") as info:
        call(answer, timeout=2)
    assert info.value.retryable and info.value.code == "node_unreachable"


def test_a_refused_connection_is_named() -> None:
    async def answer(request: bytes) -> bytes:
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    with pytest.raises(NodeUnreachable, match="connection refused \\(is fleet-agent running there\\?\\)"):
        call(answer)


def _answer(status: str, body: bytes, headers: str = "") -> bytes:
    length = "" if "content-length" in headers else f"content-length: {len(body)}\r\n"
    return f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{headers}{length}\r\n".encode() + body


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("data, kind, words", [
    (_answer("200 OK", b"<html>proxy</html>"), AgentProtocolError, "not JSON"),
    (b"HTTX/1.1 twohundred\r\n\r\n", AgentProtocolError, "malformed HTTP status line"),
    (_answer("200 OK", b"{}", "content-length: 12x\r\n"), AgentProtocolError, "malformed Content-Length"),
    (_answer("200 OK", b'{"a": 1', "content-length: 100\r\n"), NodeUnreachable, "closed after 7 of 100 bytes"),
    (b"", NodeUnreachable, "closed before an answer"),
    (_answer("200 OK", b"", f"content-length: {ANSWER_LIMIT + 1}\r\n"), AgentProtocolError, "an answer over 64 MiB"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", AgentProtocolError,
     "a chunked answer"),
], ids=["not-json", "bad-status-line", "bad-length", "truncated", "no-answer", "huge-body", "chunked"])
def test_bad_answers_are_errors_naming_the_node(data: bytes, kind: type[Exception], words: str, piece: int) -> None:
    with pytest.raises(kind, match="'gpu-a'") as info:
        call(raw(data), piece=piece)
    assert words in str(info.value)


def test_an_oversized_head_is_refused() -> None:
    with pytest.raises(AgentProtocolError, match="'gpu-a'.*an oversized response head"):
        call(raw(b"HTTP/1.1 200 OK\r\nx-pad: " + b"a" * 70000), piece=4096)


@pytest.mark.parametrize("piece", PIECES)
def test_a_body_without_length_ends_with_the_answer(piece: int) -> None:
    data = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + json.dumps(GOOD).encode()
    assert call(raw(data), piece=piece) == GOOD


def test_an_app_that_streams_is_framed_as_a_server_would_and_refused() -> None:
    async def parts() -> Any:
        yield json.dumps(GOOD).encode()

    with pytest.raises(AgentProtocolError, match="a chunked answer"):
        call(asgi(StreamingResponse(parts(), media_type="application/json")))


def test_a_json_body_reaches_the_app_whole() -> None:
    got: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        got.append((scope["method"], scope["path"], json.loads(message["body"])))
        await JSONResponse({"state": "starting"}, status_code=202)(scope, receive, send)

    body = {"id": "chat@gpu-a", "model": "sha256:" + "ab" * 32, "port": 9001, "settings": {"threads": 1}}

    async def go() -> Any:
        async with AgentClient("x" * 16, transport=MemoryTransport(asgi(app))) as client:
            return await client.start_server(NODE, body)

    assert trio.run(go) == {"state": "starting"}
    assert got == [("POST", "/v1/servers", body)]
