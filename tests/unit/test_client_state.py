"""AgentClient's calls over a connection of their own, against a raw stand-in agent on loopback
that answers with exactly the bytes given: each bad answer is an error naming the node."""

from __future__ import annotations

import functools
import json
from typing import Any, Awaitable, Callable

import pytest
import trio

from reconciler.agents.client import AgentClient, AgentHTTPError, AgentProtocolError, NodeAuthRejected, NodeUnreachable
from reconciler.core.desired import NodeSpec
from tests.unit.test_client import GOOD

HOST = "127.0.0.1"


def fetch(answer: bytes, *, timeout: float = 5.0, close: bool = True,
          call: Callable[[AgentClient, NodeSpec], Awaitable[Any]] | None = None) -> tuple[Any, bytes]:
    """(what `call` returned, by default the state, or the error it raised; the request the
    stand-in received, body included)."""
    seen: list[bytes] = []

    async def agent(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        length = int(request.partition(b"Content-Length: ")[2].split(b"\r\n")[0] or 0)
        while len(request.partition(b"\r\n\r\n")[2]) < length:
            request += await stream.receive_some(65536)
        seen.append(request)
        await stream.send_all(answer)
        if not close:
            await trio.sleep_forever()
        await stream.aclose()

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, agent, 0, host=HOST))
            node = NodeSpec("gpu-a", HOST, listeners[0].socket.getsockname()[1])
            async with AgentClient("s" * 16, timeout=timeout) as client:
                try:
                    result: Any = await (call(client, node) if call else client.state(node))
                except Exception as exc:  # the error is the result under test
                    result = exc
            nursery.cancel_scope.cancel()
            return result
    result = trio.run(main)
    return result, seen[0] if seen else b""


def answer(status: str, body: bytes, headers: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{headers}".encode() + \
        (b"content-length: %d\r\n\r\n" % len(body) if "content-length" not in headers else b"\r\n") + body


def test_a_good_state_and_the_request_that_asked_for_it() -> None:
    state, request = fetch(answer("200 OK", json.dumps(GOOD).encode()))
    assert state == GOOD
    assert request.startswith(b"GET /v1/state HTTP/1.1\r\n") and b"Authorization: Bearer " + b"s" * 16 in request


def test_a_body_without_length_ends_with_the_connection() -> None:
    state, _ = fetch(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + json.dumps(GOOD).encode())
    assert state == GOOD


@pytest.mark.parametrize("raw, kind, words", [
    (answer("401 Unauthorized", b'{"error": {"message": "wrong secret"}}'), NodeAuthRejected, "wrong secret"),
    (answer("500 Internal Server Error", b'{"error": {"message": "disk on fire"}}'), AgentHTTPError,
     "HTTP 500: disk on fire"),
    (answer("200 OK", b"<html>proxy</html>"), AgentProtocolError, "not JSON"),
    (b"HTTX/1.1 twohundred\r\n\r\n", AgentProtocolError, "malformed HTTP status line"),
    (answer("200 OK", b"{}", "content-length: 12x\r\n"), AgentProtocolError, "malformed Content-Length"),
    (answer("200 OK", b'{"a": 1', "content-length: 100\r\n"), NodeUnreachable, "closed after 7 of 100 bytes"),
    (b"", NodeUnreachable, "closed before an answer"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", AgentProtocolError,
     "a chunked answer"),
], ids=["401", "500", "not-json", "bad-status-line", "bad-length", "truncated", "no-answer", "chunked"])
def test_bad_answers_are_errors_naming_the_node(raw: bytes, kind: type[Exception], words: str) -> None:
    error, _ = fetch(raw)
    assert isinstance(error, kind) and words in str(error) and "'gpu-a'" in str(error)


def test_an_agent_that_never_finishes_is_a_timeout() -> None:
    error, _ = fetch(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{", timeout=0.3, close=False)
    assert isinstance(error, NodeUnreachable) and "timed out (no answer within 0.3s)" in str(error)
    assert error.retryable


def test_a_call_with_a_json_body_sends_it_whole() -> None:
    body = {"id": "chat@gpu-a", "model": "sha256:" + "ab" * 32, "port": 9001, "settings": {"threads": 1}}
    result, request = fetch(answer("201 Created", b'{"state": "starting"}'),
                            call=lambda client, node: client.start_server(node, body))
    head, _, sent = request.partition(b"\r\n\r\n")
    assert result == {"state": "starting"}
    assert head.startswith(b"POST /v1/servers HTTP/1.1\r\n") and b"Content-Type: application/json" in head
    assert json.loads(sent) == body and f"Content-Length: {len(sent)}".encode() in head


def test_a_404_is_none_where_absence_is_an_answer() -> None:
    result, request = fetch(answer("404 Not Found", b'{"error": {"message": "no such server"}}'),
                            call=lambda client, node: client.server(node, "chat@gpu-a"))
    assert result is None and request.startswith(b"GET /v1/servers/chat@gpu-a HTTP/1.1")
