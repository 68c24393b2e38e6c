"""A lean HTTP/1.1 server for simulated agents (agent/simulation/simulate.py): thousands of agent apps in one
process, each on its own loopback address, each request handed to the real agent's ASGI app.

Through hypercorn a request cost the simulation about 2.5 ms of CPU, so at 10,000 simulated
agents on one machine the benches measured hypercorn instead of the control plane (a real agent
pays that cost on its own machine). Here a request costs a read, a split and a write around the
app; the app itself (routing, the secret, the handlers, JSON) is the real agent's."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import unquote

import trio
from starlette.types import ASGIApp, Message

MAX_HEAD = 64 * 1024
READ = 65536


async def _receive(sock: socket.socket) -> bytes:
    # Read first, wait only when nothing is there: a client's request is most often in the socket
    # by the time its connection is accepted, and a wait is a trip through trio's epoll.
    while True:
        try:
            return sock.recv(READ)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def _send(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


def _close(sock: socket.socket) -> None:
    if sock.fileno() != -1:
        trio.lowlevel.notify_closing(sock)
        sock.close()


def listener(address: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve(app: ASGIApp, listeners: list[socket.socket]) -> None:
    """Accept on every listener until cancelled; each connection in a task of its own."""
    async with trio.open_nursery() as nursery:
        for sock in listeners:
            nursery.start_soon(_accept, app, sock, nursery)


async def _accept(app: ASGIApp, listening: socket.socket, nursery: trio.Nursery) -> None:
    local = listening.getsockname()[:2]
    while True:
        try:
            sock, peer = listening.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listening)  # waits only once the backlog is empty
            continue
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nursery.start_soon(_connection, app, sock, local, peer[:2])


async def _connection(app: ASGIApp, sock: socket.socket, local: tuple[str, int], peer: tuple[str, int]) -> None:
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                if len(buf) > MAX_HEAD:
                    return
                more = await _receive(sock)
                if not more:
                    return
                buf += more
            head, _, buf = buf.partition(b"\r\n\r\n")
            line, *fields = head.decode("latin-1").split("\r\n")
            method, target, version = line.split(" ", 2)
            headers = [(k.strip().lower(), v.strip()) for k, _, v in (f.partition(":") for f in fields)]
            named = dict(headers)
            length = int(named.get("content-length", "0") or 0)
            while len(buf) < length:
                more = await _receive(sock)
                if not more:
                    return
                buf += more
            body, buf = buf[:length], buf[length:]
            keep = version == "HTTP/1.1" and named.get("connection", "").lower() != "close"
            path, _, query = target.partition("?")
            scope: dict[str, Any] = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": version[5:], "method": method,
                "scheme": "http", "path": unquote(path), "raw_path": path.encode(), "query_string": query.encode(),
                "root_path": "", "server": local, "client": peer,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]}
            if not await _exchange(app, sock, scope, body, keep):
                return
    except (OSError, ValueError):
        return  # a client that went away or sent nonsense: its connection ends, the agent goes on
    finally:
        _close(sock)


async def _exchange(app: ASGIApp, sock: socket.socket, scope: dict[str, Any], body: bytes, keep: bool) -> bool:
    """Run the app for one request, writing its answer as it comes; whether the connection lives on."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    complete = trio.Event()
    start: dict[str, Any] = {}
    chunked = False

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await complete.wait()  # a streaming response listens for the client going away meanwhile
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal chunked
        if message["type"] == "http.response.start":
            start.update(message)
            return
        if message["type"] != "http.response.body":
            return
        data, more = message.get("body", b""), message.get("more_body", False)
        if start:
            status, headers = start.pop("status"), list(start.pop("headers", []))
            chunked = not any(k.lower() == b"content-length" for k, _ in headers) and status not in (204, 304)
            lines = [b"HTTP/1.1 %d X" % status] + [k + b": " + v for k, v in headers]
            lines += [b"transfer-encoding: chunked"] if chunked else []
            lines += [] if keep else [b"connection: close"]
            head = b"\r\n".join(lines) + b"\r\n\r\n"
            if chunked or more:
                await _send(sock, head)
            else:
                data = head + data  # a whole answer in one message goes out in one write
        if chunked:
            await _send(sock, (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"" if more else b"0\r\n\r\n"))
        elif data:
            await _send(sock, data)
        if not more:
            complete.set()

    await app(scope, receive, send)
    return keep and complete.is_set()
