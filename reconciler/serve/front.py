"""The control plane's HTTP/1.1 front: an ASGI server, one trio task per connection, parsed by httptools.

Why not hypercorn here (the agent keeps it): measured on this project's 2-core machine, hypercorn
spent 0.8-1 ms of CPU on every request even for a three-message ASGI app (a bare trio socket loop:
0.07 ms), and tens of microseconds on every relayed chunk, so the router could not add less than
about a millisecond to a stream's first byte nor keep up with a worker streaming as fast as it
can. This front does what the router needs and no more: HTTP/1.1 with keep-alive and pipelining,
parsed by httptools (llhttp, the parser uvicorn uses); the app called in the connection's own
task; the response head held back until the first body bytes so that head and first chunk leave
in one write; chunks framed without a per-chunk event object; `http.disconnect` delivered the
moment the client goes away. No HTTP/2, websockets or lifespan: the router has none.
"""

from __future__ import annotations

import json
import logging
import math
import socket
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools
import trio
from starlette.types import ASGIApp, Message

from .. import sockio

log = logging.getLogger("fleet")

READ = 64 * 1024
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
# The stable code in the JSON error of each refusal (clients and alerts match on it, not the text).
CODES = {400: "bad_request", 408: "request_timeout", 413: "body_too_large", 431: "head_too_large",
         500: "internal_error"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Bounds on what one client may make the front hold or wait for."""

    max_head: int = 64 * 1024          # request line + headers (431 beyond)
    max_body: int = 32 * 1024 * 1024   # a prompt larger than this is refused with 413
    keep_alive: float = 60.0           # an idle connection is closed after this long
    read_timeout: float = 30.0         # a head must be whole, and a body keep arriving, within this (408)
    write_timeout: float = 60.0        # a client that takes no bytes for this long is dropped
    grace: float = 10.0                # on shutdown, requests in flight get this long to finish


class Refused(Exception):
    """The request cannot be served: answer `status` with `message`, then close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client closed its side; nothing more can be sent."""


@dataclass(slots=True)
class Request:
    method: bytes = b""
    target: bytes = b""
    version: str = "1.1"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    keep_alive: bool = True
    head_done: bool = False
    size: int = 0
    continued: bool = False  # a "100 Continue" was sent, or not needed


class Parser:
    """httptools callbacks gathered into whole requests, in arrival order (pipelining)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.parser = httptools.HttpRequestParser(self)
        self.ready: deque[Request] = deque()
        self.current: Request | None = None
        self.head_bytes = 0

    def feed(self, data: bytes) -> None:
        if self.current is None or not self.current.head_done:
            self.head_bytes += len(data)  # an upper bound until the head is complete
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise Refused(400, "protocol upgrades are not served here") from None
        except httptools.HttpParserCallbackError as exc:
            why = exc.__cause__ or exc.__context__  # what our callback raised
            if isinstance(why, Refused):
                raise why from None
            raise
        except httptools.HttpParserError as exc:
            raise Refused(400, f"malformed HTTP request: {exc}") from None
        if (self.current is None or not self.current.head_done) and self.head_bytes > self.limits.max_head:
            raise Refused(431, f"the request head is over {self.limits.max_head} bytes")

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.current = Request()

    def on_url(self, url: bytes) -> None:
        assert self.current is not None
        self.current.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        r = self.current
        assert r is not None
        r.head_done, self.head_bytes = True, 0
        if len(r.target) + sum(len(k) + len(v) + 4 for k, v in r.headers) > self.limits.max_head:
            raise Refused(431, f"the request head is over {self.limits.max_head} bytes")
        r.method, r.version, r.keep_alive = self.parser.get_method(), self.parser.get_http_version(), \
            self.parser.should_keep_alive()
        length = next((v for k, v in r.headers if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limits.max_body:
            raise Refused(413, f"the request body is over {self.limits.max_body} bytes")
        r.continued = not any(k == b"expect" and v.lower() == b"100-continue" for k, v in r.headers)

    def on_body(self, body: bytes) -> None:
        r = self.current
        assert r is not None
        r.size += len(body)
        if r.size > self.limits.max_body:
            raise Refused(413, f"the request body is over {self.limits.max_body} bytes")
        r.body.append(body)

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.ready.append(self.current)
        self.current = None


class Front:
    def __init__(self, app: ASGIApp, limits: Limits | None = None) -> None:
        self.app = app
        self.limits = limits or Limits()
        self.idle: set[trio.CancelScope] = set()  # connections waiting for their next request
        self.closing = False

    @staticmethod
    def listen(host: str, port: int) -> list[socket.socket]:
        """Bind first, outside any nursery, so that a port in use is a plain OSError for the caller."""
        return sockio.listen(host, port)

    async def serve(self, listeners: list[socket.socket], stop: trio.Event) -> None:
        """Serve until `stop` is set; then stop accepting, close idle connections, let in-flight
        requests finish within the grace period, and cut what is left."""
        try:
            async with trio.open_nursery() as connections:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept, listener, connections)
                    await stop.wait()
                    accepting.cancel_scope.cancel()
                for listener in listeners:
                    sockio.close(listener)
                self.closing = True
                for scope in list(self.idle):
                    scope.cancel()
                connections.cancel_scope.deadline = trio.current_time() + self.limits.grace
        finally:
            for listener in listeners:
                sockio.close(listener)

    async def _accept(self, listener: socket.socket, connections: trio.Nursery) -> None:
        while True:
            try:
                sock = await sockio.accept(listener)
            except OSError as exc:  # EMFILE and the like: say so, back off, keep serving
                log.warning("accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            connections.start_soon(self.connection, sock)

    async def connection(self, sock: socket.socket) -> None:
        parser = Parser(self.limits)
        try:
            while not self.closing:
                request = await self._next_request(sock, parser)
                if request is None:
                    return
                exchange = Exchange(self, sock, parser, request)
                await exchange.run()
                if not exchange.keep_alive:
                    return
        except Refused as exc:
            await refuse(sock, exc.status, str(exc))
        except trio.TooSlowError:
            await refuse(sock, 408, f"the request did not arrive within {self.limits.read_timeout:g}s")
        except (OSError, trio.ClosedResourceError, ClientGone):
            return
        finally:
            sockio.close(sock)

    async def _next_request(self, sock: socket.socket, parser: Parser) -> Request | None:
        head_deadline = math.inf
        while not parser.ready:
            current = parser.current
            if current is not None:
                # The head must be whole within read_timeout of its first byte (a client that
                # sends a byte now and then cannot hold a connection forever); a body must keep
                # arriving, a read at least every read_timeout.
                if not current.head_done and head_deadline == math.inf:
                    head_deadline = trio.current_time() + self.limits.read_timeout
                deadline = head_deadline if not current.head_done else trio.current_time() + self.limits.read_timeout
                with trio.fail_at(deadline):
                    data = await sockio.receive(sock, READ)
            else:
                # Idle between requests: closed after keep_alive, or at once on shutdown.
                with trio.move_on_after(self.limits.keep_alive) as idle:
                    self.idle.add(idle)
                    try:
                        data = await sockio.receive(sock, READ)
                    finally:
                        self.idle.discard(idle)
                if idle.cancelled_caught:
                    return None
            if not data:
                return None
            parser.feed(data)
            current = parser.current
            if current is not None and current.head_done and not current.continued:
                current.continued = True
                await sockio.send(sock, b"HTTP/1.1 100 Continue\r\n\r\n")
        return parser.ready.popleft()


async def refuse(sock: socket.socket, status: int, message: str) -> None:
    """Answer with a JSON error and `connection: close` (the caller closes)."""
    code = CODES.get(status, "bad_request" if status < 500 else "internal_error")
    body = json.dumps({"error": {"message": message, "type": "fleet_error", "code": code}}).encode()
    try:
        await sockio.send(sock, b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                b"connection: close\r\n\r\n%s" % (status, REASONS.get(status, b""), len(body), body))
    except (OSError, trio.ClosedResourceError):
        pass


class Exchange:
    """One request and its response: the ASGI scope, receive and send of a single call of the app."""

    def __init__(self, front: Front, sock: socket.socket, parser: Parser, request: Request) -> None:
        self.front, self.sock, self.parser, self.request = front, sock, parser, request
        self.keep_alive = request.keep_alive
        self.head: bytes | None = None
        self.started = False      # bytes of the response went out
        self.body_sent = False
        self.finished = False
        self.gone = False
        self.chunked = False
        self.no_body = request.method == b"HEAD"

    def scope(self) -> dict[str, Any]:
        path, _, query = self.request.target.partition(b"?")
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": self.request.version, "method": self.request.method.decode("latin-1"),
                "scheme": "http", "path": unquote(path.decode("latin-1")), "raw_path": path, "query_string": query,
                "root_path": "", "headers": self.request.headers,
                "client": tuple(self.sock.getpeername()[:2]), "server": tuple(self.sock.getsockname()[:2]),
                "state": {}}

    async def run(self) -> None:
        try:
            await self.front.app(self.scope(), self.receive, self.send)
        except ClientGone:
            raise
        except Exception:
            log.exception("error while answering %s %s", self.request.method.decode("latin-1"),
                          self.request.target.decode("latin-1"))
            if not self.started:
                self.keep_alive = False
                await refuse(self.sock, 500, "internal error in fleet serve (see its log)")
                return
        if not self.started:
            self.keep_alive = False
            await refuse(self.sock, 500, "fleet serve sent no response")
        elif not self.finished:
            raise ClientGone()  # a response cut short cannot be completed on this connection

    async def receive(self) -> Message:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": b"".join(self.request.body), "more_body": False}
        # After the body, receive() waits for the client to go away (ASGI apps use it to stop
        # work nobody will read). Bytes of a pipelined next request are parsed and kept.
        while not (self.gone or self.finished):
            try:
                data = await sockio.receive(self.sock, READ)
            except (OSError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.gone = True
                break
            try:
                self.parser.feed(data)
            except Refused:  # garbage after this request: finish nothing more on this connection
                self.gone = True
        return {"type": "http.disconnect"}

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b""))]
        has_length = False
        for name, value in headers:
            if b"\r" in name or b"\n" in name or b"\r" in value or b"\n" in value:
                raise ValueError(f"header {name!r} holds a line break")
            lower = name.lower()
            if lower == b"transfer-encoding" or lower == b"connection":
                continue  # framing and persistence are this server's to decide
            has_length = has_length or lower == b"content-length"
            lines.append(b"%s: %s\r\n" % (name, value))
        self.no_body = self.no_body or status in (204, 304) or status < 200
        if not (self.no_body or has_length):
            # A body of unknown length: chunked for HTTP/1.1, ended by closing for HTTP/1.0.
            if self.request.version == "1.1":
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            else:
                self.keep_alive = False
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        elif self.request.version == "1.0":
            lines.append(b"connection: keep-alive\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def send(self, message: Message) -> None:
        if self.gone:
            raise ClientGone()
        kind = message["type"]
        if kind == "http.response.start" and self.head is None:
            self.head = self._head(message["status"], message.get("headers", []))
            return
        if kind != "http.response.body" or self.head is None or self.finished:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        out = b"" if self.started else self.head  # the head leaves with the first body bytes
        data = message.get("body", b"")
        if data and not self.no_body:
            out += b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data
        if not message.get("more_body", False):
            self.finished = True
            if self.chunked:
                out += b"0\r\n\r\n"
        if out:
            self.started = True
            try:
                await sockio.send(self.sock, out, self.front.limits.write_timeout)
            except (OSError, trio.ClosedResourceError, trio.TooSlowError):
                self.gone = True
                raise ClientGone() from None
