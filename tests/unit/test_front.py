"""The control plane's HTTP front on real loopback sockets: keep-alive, pipelining, framing for
HTTP/1.0 and HEAD, limits and the errors they give, 100-continue, a client leaving mid-stream,
an app that fails, and shutdown with a grace period."""

from __future__ import annotations

import functools
import json
import socket
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import pytest
import trio
from starlette.types import Message, Receive, Scope, Send

from reconciler.serve.front import Front, Limits

HOST = "127.0.0.1"


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with what it was asked: method, path, query and body, as JSON with a length."""
    body = (await receive())["body"]
    out = json.dumps({"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
                      "body": body.decode(), "version": scope["http_version"]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


async def stream(scope: Scope, receive: Receive, send: Send) -> None:
    """Three SSE events of unknown total length."""
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(3):
        await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@asynccontextmanager
async def served(app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 limits: Limits | None = None) -> AsyncIterator[tuple[int, trio.Event, Front]]:
    front = Front(app, limits)
    listeners = front.listen(HOST, 0)
    port = listeners[0].getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.serve, listeners, stop)
        yield port, stop, front
        stop.set()


async def exchange(port: int, data: bytes, *, timeout: float = 5) -> bytes:
    """Send raw bytes, return everything received until the server closes (or the timeout)."""
    stream = await trio.open_tcp_stream(HOST, port)
    await stream.send_all(data)
    got = b""
    with trio.move_on_after(timeout):
        while chunk := await stream.receive_some(65536):
            got += chunk
    await stream.aclose()
    return got


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return trio.run(fn)


def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    async def main() -> None:
        async with served(echo) as (port, _, _):
            async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}") as client:
                for i in range(3):
                    r = await client.post(f"/v1/x%20y?n={i}", content=b"hello")
                    assert r.status_code == 200
                    assert r.json() == {"method": "POST", "path": "/v1/x y", "query": f"n={i}", "body": "hello",
                                        "version": "1.1"}
    run(main)


def test_pipelined_requests_are_answered_in_order() -> None:
    async def main() -> None:
        async with served(echo) as (port, _, _):
            two = (b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n1"
                   b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\n2")
            got = await exchange(port, two)
            assert got.count(b"HTTP/1.1 200 OK") == 2
            assert got.index(b'"path": "/a"') < got.index(b'"path": "/b"')
            assert b"connection: close" in got  # the second asked for it, and the server closed
    run(main)


def test_streams_are_chunked_for_http11_and_close_delimited_for_http10() -> None:
    async def main() -> None:
        async with served(stream) as (port, _, _):
            got = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head, _, body = got.partition(b"\r\n\r\n")
            assert b"transfer-encoding: chunked" in head
            assert body == b"9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
            got = await exchange(port, b"GET / HTTP/1.0\r\n\r\n")
            head, _, body = got.partition(b"\r\n\r\n")
            assert b"transfer-encoding" not in head and b"connection: close" in head
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    run(main)


def test_head_gets_the_headers_without_the_body() -> None:
    async def main() -> None:
        async with served(echo) as (port, _, _):
            got = await exchange(port, b"HEAD /h HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: " in head and body == b""
    run(main)


def error_of(got: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"connection: close" in head
    return int(head.split(b" ")[1]), json.loads(body)["error"]


@pytest.mark.parametrize("request_bytes, status, words", [
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed HTTP request"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n", 413, "over 1000 bytes"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"200\r\n" + b"x" * 512 + b"\r\n" * 1
     + b"200\r\n" + b"x" * 512 + b"\r\n", 413, "over 1000 bytes"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 3000 + b"\r\n\r\n", 431, "head is over 2048 bytes"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", 400, "upgrades"),
], ids=["garbage", "content-length-too-big", "chunked-body-too-big", "head-too-big", "upgrade"])
def test_bad_requests_get_a_json_error_and_the_connection_closes(request_bytes: bytes, status: int,
                                                                 words: str) -> None:
    async def main() -> None:
        async with served(echo, Limits(max_body=1000, max_head=2048)) as (port, _, _):
            got_status, error = error_of(await exchange(port, request_bytes))
            assert got_status == status and words in error["message"] and error["type"] == "fleet_error"
            assert error["code"] == {400: "bad_request", 413: "body_too_large", 431: "head_too_large"}[status]
    run(main)


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def main() -> None:
        async with served(echo) as (port, _, _):
            stream = await trio.open_tcp_stream(HOST, port)
            await stream.send_all(b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
            with trio.fail_after(5):
                assert await stream.receive_some(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
            await stream.send_all(b"abc")
            got = b""
            with trio.fail_after(5):
                while b'"body": "abc"' not in got:
                    got += await stream.receive_some(65536)
            await stream.aclose()
    run(main)


def test_an_app_that_fails_gives_500_and_the_log_says_why(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("the bug")

    async def main() -> None:
        async with served(broken) as (port, _, _):
            status, error = error_of(await exchange(port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert status == 500 and error["code"] == "internal_error"
    run(main)
    assert "error while answering GET /boom" in caplog.text and "the bug" in caplog.text


def test_a_client_leaving_mid_stream_is_seen_by_the_app_at_once() -> None:
    seen: list[str] = []

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        message: Message = await receive()  # blocks until the client goes away
        seen.append(message["type"])

    async def main() -> None:
        async with served(slow) as (port, _, _):
            stream = await trio.open_tcp_stream(HOST, port)
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"first" in await stream.receive_some(65536)
            await stream.aclose()
            with trio.fail_after(5):
                while not seen:
                    await trio.sleep(0.01)
    run(main)
    assert seen == ["http.disconnect"]


def test_slow_and_idle_clients_are_cut_off() -> None:
    async def main() -> None:
        async with served(echo, Limits(read_timeout=0.3, keep_alive=0.3)) as (port, _, _):
            with trio.fail_after(3):  # half a request, then silence: 408 after read_timeout
                status, error = error_of(await exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Len"))
                assert status == 408 and "within 0.3s" in error["message"] and error["code"] == "request_timeout"
            with trio.fail_after(3):  # a kept-alive connection with nothing more to ask: closed after keep_alive
                got = await exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                assert got.startswith(b"HTTP/1.1 200 OK")

            # A head trickled a byte at a time, each within read_timeout: cut off all the same.
            stream = await trio.open_tcp_stream(HOST, port)
            start = trio.current_time()
            got = b""
            with trio.fail_after(3):
                for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 100:
                    try:
                        await stream.send_all(bytes([byte]))
                    except trio.BrokenResourceError:
                        break
                    with trio.move_on_after(0.1):
                        got += await stream.receive_some(65536)
                    if got:
                        break
            assert got.startswith(b"HTTP/1.1 408") and trio.current_time() - start < 1.0
            await stream.aclose()
    run(main)


def test_shutdown_closes_idle_connections_and_lets_a_running_request_finish() -> None:
    release = trio.Event()

    async def waits(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"done"})

    async def main() -> None:
        async with served(waits, Limits(grace=5)) as (port, stop, _):
            idle = await trio.open_tcp_stream(HOST, port)
            busy = await trio.open_tcp_stream(HOST, port)
            await busy.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(0.05)
            stop.set()
            with trio.fail_after(3):
                assert await idle.receive_some(100) == b""  # closed at once
            release.set()
            got = b""
            with trio.fail_after(3):
                while chunk := await busy.receive_some(65536):
                    got += chunk
            assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"done")
            with pytest.raises(OSError):
                socket.create_connection((HOST, port), timeout=1).close()  # no longer listening
    run(main)


def test_a_port_in_use_is_a_plain_oserror() -> None:
    taken = socket.socket()
    taken.bind((HOST, 0))
    taken.listen()
    try:
        with pytest.raises(OSError):
            Front.listen(HOST, taken.getsockname()[1])
    finally:
        taken.close()


@asynccontextmanager
async def relayed(worker: Callable[[trio.SocketStream], Awaitable[None]],
                  timeout: float = 300.0) -> AsyncIterator[tuple[trio.SocketStream, Any]]:
    """The router behind the front, its one cluster served by `worker` (a raw stand-in on
    loopback whose node's home is /srv/home, holding /srv/home/store/models/abc); yields a
    client connection that has sent a streamed chat request, and the router."""
    from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
    from reconciler.core.observed import node_from_state
    from reconciler.serve.heartbeat import View
    from reconciler.serve.router import Router

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, worker, 0, host=HOST))
        digest = "sha256:" + "1" * 64
        desired = Desired(1, ControlPlaneSpec("w"), {"w": NodeSpec("w", HOST)},
                          {"m": ModelSpec("m", "safetensors", digest, "w")}, (),
                          {"chat": ClusterSpec("chat", "m", ("w",), listeners[0].socket.getsockname()[1])})
        state = {"servers": [{"id": "chat@w", "state": "running", "model": digest}],
                 "inventory": {"disk": {"path": "/srv/home"}},
                 "weights": [{"digest": digest, "path": "/srv/home/store/models/abc"}]}
        view = View(nodes={"w": node_from_state("w", state)}, online={"w": True})
        router = Router(desired, view, timeout=timeout)
        async with served(router.app()) as (port, _, _):
            client = await trio.open_tcp_stream(HOST, port)
            body = b'{"model": "chat", "stream": true}'
            await client.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                                  % (len(body), body))
            yield client, router
            await client.aclose()
        nursery.cancel_scope.cancel()


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_a_client_leaving_a_relayed_stream_closes_the_workers_connection() -> None:
    """The worker streams an event every 20 ms until its connection closes: it must see it
    closed soon after the client goes away, and the member's count of requests drop to 0."""
    worker_saw_close = trio.Event()

    async def worker(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(SSE_HEAD)
        try:
            while True:
                await stream.send_all(b"9\r\ndata: x\n\n\r\n")
                await trio.sleep(0.02)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            worker_saw_close.set()

    async def main() -> None:
        async with relayed(worker) as (client, router):
            got = b""
            with trio.fail_after(5):
                while b"data: x" not in got:
                    got += await client.receive_some(65536)
            await client.aclose()
            with trio.fail_after(3):
                await worker_saw_close.wait()
            assert router.in_flight("chat@w") == 0
    run(main)


def test_each_event_reaches_the_client_whole_before_the_next_is_made() -> None:
    """The worker sends one event naming its store path and makes the next only once the client
    holds that event, scrubbed and complete to its blank line: a relay that waited for more (a
    buffer, the next event) would never get it there, and the test ends at its deadline."""
    client_has_it = trio.Event()

    async def worker(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        first = b'data: {"model": "/srv/home/store/models/abc", "text": "a"}\n\n'
        await stream.send_all(SSE_HEAD + b"%x\r\n%s\r\n" % (len(first), first))
        await client_has_it.wait()
        await stream.send_all(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")

    async def main() -> None:
        async with relayed(worker) as (client, _):
            got = b""
            with trio.fail_after(10):
                while not got.endswith(b'data: {"model": "chat", "text": "a"}\n\n\r\n'):
                    got += await client.receive_some(65536)
            client_has_it.set()
            with trio.fail_after(10):
                while not got.endswith(b"0\r\n\r\n"):
                    got += await client.receive_some(65536)
            assert got.count(b"data: ") == 2 and b"[DONE]" in got
    run(main)


@pytest.mark.parametrize("stall", ["before-the-head", "mid-stream"])
def test_a_worker_that_goes_silent_is_given_up_on(stall: str, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing waits forever: a member silent for the router's timeout ends the request, with a
    503 naming it when nothing was sent yet, or an error event naming it mid-stream."""
    async def worker(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        if stall == "mid-stream":
            await stream.send_all(SSE_HEAD + b"9\r\ndata: x\n\n\r\n")
        await trio.sleep_forever()

    async def main() -> bytes:
        async with relayed(worker, timeout=0.3) as (client, _):
            got = b""
            with trio.fail_after(5):
                while not got.endswith((b"0\r\n\r\n", b"}}")):  # a stream's end, or a JSON error's
                    got += await client.receive_some(65536)
            return got
    got = run(main)
    if stall == "mid-stream":
        assert b"data: x" in got and b"member_failed_mid_stream" in got and b"sent nothing for 0.3s" in got
        assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    else:
        assert got.startswith(b"HTTP/1.1 502") and b"w: no answer within 0.3s" in got
    assert "the member on w" in caplog.text


def test_a_client_that_stops_reading_is_dropped_after_write_timeout() -> None:
    """A stream to a client that reads nothing fills the socket buffers; after write_timeout
    the front gives up on it, and the app's send raises instead of waiting forever."""
    outcome: list[str] = []

    async def firehose(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            while True:
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        except Exception as exc:
            outcome.append(type(exc).__name__)
            raise

    async def main() -> None:
        async with served(firehose, Limits(write_timeout=0.3)) as (port, _, _):
            stream = await trio.open_tcp_stream(HOST, port)
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            with trio.fail_after(5):
                while not outcome:
                    await trio.sleep(0.05)
            await stream.aclose()
    run(main)
    assert outcome == ["ClientGone"]


@pytest.mark.parametrize("head, status", [
    (b"GET / HTTP/1.1\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: a/b@c\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: [::1]:8080\r\nConnection: close\r\n\r\n", 200),
    (b"GET / HTTP/1.1\r\nHost: fleet.example:443\r\nConnection: close\r\n\r\n", 200),
    (b"GET / HTTP/1.0\r\n\r\n", 200),
], ids=["no-host-1.1", "two-hosts", "two-hosts-1.0", "host-not-a-host", "ipv6-literal", "name-and-port",
        "no-host-1.0"])
def test_host_header_per_rfc9112(head: bytes, status: int) -> None:
    """RFC 9112 3.2: an HTTP/1.1 request without Host, any request with two, or a Host that is
    not host[:port] gets 400 with the stable code invalid_host."""
    async def main() -> None:
        async with served(echo) as (port, _, _):
            got = await exchange(port, head)
            if status == 200:
                assert got.startswith(b"HTTP/1.1 200 OK"), got
            else:
                got_status, error = error_of(got)
                assert got_status == 400 and error["code"] == "invalid_host", error
    run(main)


def test_requests_pipelined_behind_a_running_stream_wait_and_are_all_answered_in_order() -> None:
    """While a response is in flight the front reads only a bounded amount of what follows
    (Limits.read_ahead), unparsed; everything is still answered, in order, once it ends."""
    release = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = (await receive())["body"]
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await release.wait()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        out = b"%s:%d" % (scope["path"].encode(), len(body))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    big = b"x" * 200_000  # more than read_ahead: reading stops inside it until the stream ends
    following = b"".join(b"POST /p%d HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc" % i for i in range(50))
    following += b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)
    following += b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"

    async def main() -> None:
        async with served(app, Limits(read_ahead=4096)) as (port, _, _):
            stream = await trio.open_tcp_stream(HOST, port)
            await stream.send_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            with trio.fail_after(5):
                while b"first" not in got:
                    got += await stream.receive_some(65536)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, following)
                await trio.sleep(0.3)
                release.set()
                with trio.fail_after(10):
                    while chunk := await stream.receive_some(65536):
                        got += chunk
            await stream.aclose()
        answers = [b"/p%d:3" % i for i in range(50)] + [b"/big:%d" % len(big), b"/last:0"]
        positions = [got.index(a) for a in answers]
        assert positions == sorted(positions) and got.count(b"HTTP/1.1 200 OK") == 53
    run(main)


def test_at_the_cap_the_connection_idle_longest_makes_room() -> None:
    drops: list[str] = []

    async def main() -> None:
        front = Front(echo, Limits(max_connections=2), on_drop=drops.append)
        listeners = front.listen(HOST, 0)
        port = listeners[0].getsockname()[1]
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(front.serve, listeners, stop)
            oldest = await trio.open_tcp_stream(HOST, port)
            await trio.sleep(0.05)
            younger = await trio.open_tcp_stream(HOST, port)
            await trio.sleep(0.05)
            got = await exchange(port, b"GET /new HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 200 OK")
            with trio.fail_after(3):
                assert await oldest.receive_some(100) == b""  # closed to make room
            await younger.send_all(b"GET /still HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            with trio.fail_after(3):
                assert (await younger.receive_some(65536)).startswith(b"HTTP/1.1 200 OK")
            stop.set()
    run(main)
    assert drops == ["evicted"]


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503_and_is_closed() -> None:
    drops: list[str] = []
    release = trio.Event()

    async def waits(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> None:
        front = Front(waits, Limits(max_connections=2), on_drop=drops.append)
        listeners = front.listen(HOST, 0)
        port = listeners[0].getsockname()[1]
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(front.serve, listeners, stop)
            busy = [await trio.open_tcp_stream(HOST, port) for _ in range(2)]
            for stream in busy:
                await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(0.1)
            status, error = error_of(await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert status == 503 and error["code"] == "too_many_connections" and "limit of 2" in error["message"]
            release.set()
            for stream in busy:  # the requests in flight were not disturbed
                with trio.fail_after(3):
                    assert (await stream.receive_some(65536)).endswith(b"ok")
            stop.set()
    run(main)
    assert drops == ["refused"]


def test_the_connection_cap_follows_the_descriptor_limit() -> None:
    from net.server import LINGER_MAX
    from reconciler.serve.front import RESERVED_FDS, connection_cap

    assert connection_cap(1024) == (1024 - RESERVED_FDS - LINGER_MAX) // 2 == 382 and connection_cap(65536) > 32000
    assert connection_cap(100) == 16  # never none at all
