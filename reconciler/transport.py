"""How an agent call travels: one seam (`Transport.exchange`: a request for a status and bytes), a
raw-socket transport for production and an in-memory one for tests, both answering through the
same HTTP/1.1 reader, so that tests run the parsing code production runs."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Awaitable, Callable, Protocol
from urllib.parse import unquote

import trio
from starlette.types import ASGIApp, Message

from wire.http import HeadTooLarge, MalformedHead, split_head

from . import sockio
from .agent_errors import AgentProtocolError, NodeUnreachable
from .model import NodeSpec

ANSWER_LIMIT = 64 << 20  # an agent's answer larger than this is refused, not buffered
READ = 65536

Receive = Callable[[int], Awaitable[bytes | bytearray]]  # up to n bytes of the answer; b"" once it has ended


@dataclass(frozen=True, slots=True)
class AgentRequest:
    method: str
    node: NodeSpec
    path: str
    body: bytes | None = None  # JSON
    secret: str = field(default="", repr=False)
    unless: str | None = None  # If-None-Match: the generation the caller holds (GET /v1/state)

    def encode(self) -> bytes:
        """The request as it goes on the wire: one request per connection, closed after the answer."""
        node = self.node
        host = f"[{node.address}]" if ":" in node.address else node.address
        head = (f"{self.method} {self.path} HTTP/1.1\r\nHost: {host}:{node.agent_port}\r\n"
                f"Authorization: Bearer {self.secret}\r\nConnection: close\r\n")
        if self.unless is not None:
            head += f'If-None-Match: "{self.unless}"\r\n'
        if self.body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(self.body)}\r\n"
        return head.encode() + b"\r\n" + (self.body or b"")


class Transport(Protocol):
    async def exchange(self, request: AgentRequest) -> tuple[int, bytes]:
        """The answer's status and body. Raises NodeUnreachable or AgentProtocolError for what the
        reader finds; OSError or trio.BrokenResourceError for the connection (the client names
        them); timeouts are the caller's."""
        ...


class SocketTransport:
    """Each call on a connection of its own over a plain non-blocking socket (TLS where the node
    says so). Through httpx each call cost about 1 ms of CPU, most of the heartbeat's budget at a
    thousand nodes (bench/heartbeat)."""

    def __init__(self, ca_file: str | None = None) -> None:
        # ca_file: trust agents' certificates signed by this CA (or self-signed ones given directly).
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()

    async def exchange(self, request: AgentRequest) -> tuple[int, bytes]:
        node = request.node
        sock = await sockio.connect(node.address, node.agent_port)
        stream: trio.abc.Stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        try:
            if node.tls:
                stream = trio.SSLStream(stream, self._ssl, server_hostname=node.address, https_compatible=True)
            await stream.send_all(request.encode())
            return await read_answer(node, stream.receive_some)
        finally:
            await trio.aclose_forcefully(stream)


async def read_answer(node: NodeSpec, receive: Receive) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response (Content-Length, or up to the connection's end)."""
    buf = b""
    try:
        while (split := split_head(buf)) is None:
            more = await receive(READ)
            if not more:
                raise NodeUnreachable(node, "the connection closed before an answer")
            buf += more
        head, body = split
        if head.chunked:
            # fleet-agent always sends a length; something else answered in its place.
            raise AgentProtocolError(node, "a chunked answer, which fleet-agent never sends (is a proxy in between?)")
        # None: the body ends with the connection. A 204 or 304 has none, whatever its head says.
        want = 0 if head.status in (204, 304) else head.content_length()
    except HeadTooLarge:
        raise AgentProtocolError(node, "an oversized response head") from None
    except MalformedHead as exc:
        raise AgentProtocolError(node, f"a {exc}") from None
    if (want or 0) > ANSWER_LIMIT:
        raise AgentProtocolError(node, f"an answer over {ANSWER_LIMIT >> 20} MiB")
    while want is None or len(body) < want:
        more = await receive(READ)
        if not more:
            break
        body += more
        if len(body) > ANSWER_LIMIT:
            raise AgentProtocolError(node, f"an answer over {ANSWER_LIMIT >> 20} MiB")
    if want is not None and len(body) < want:
        raise NodeUnreachable(node, f"the connection closed after {len(body)} of {want} bytes")
    return head.status, body if want is None else body[:want]


Answer = Callable[[bytes], Awaitable[bytes]]  # a request's bytes → the raw bytes of the response


class MemoryTransport:
    """In-process, for tests: the request's bytes go to `answer` (an ASGI app through `asgi`, or
    a handler that writes raw bytes) and its response is read by `read_answer`, `piece` bytes at a
    time, as a socket's is. A handler raising OSError is a connection that failed."""

    def __init__(self, answer: Answer, *, piece: int = READ) -> None:
        self.answer, self.piece = answer, piece

    async def exchange(self, request: AgentRequest) -> tuple[int, bytes]:
        raw = await self.answer(request.encode())
        at = 0

        async def receive(n: int) -> bytes:
            nonlocal at
            await trio.lowlevel.checkpoint()
            out = raw[at:at + min(n, self.piece)]
            at += len(out)
            return out
        return await read_answer(request.node, receive)


def asgi(app: ASGIApp) -> Answer:
    """An ASGI app (the agent's) as an Answer: the request parsed into a scope, the response
    written as an HTTP/1.1 server would write it (chunked when the app gives no length)."""

    async def answer(request: bytes) -> bytes:
        head, _, body = request.partition(b"\r\n\r\n")
        line, *lines = head.decode("latin-1").split("\r\n")
        method, target, _ = line.split(" ", 2)
        path, _, query = target.partition("?")
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": unquote(path), "raw_path": path.encode(), "query_string": query.encode(),
            "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
            "headers": [(k.strip().lower().encode("latin-1"), v.strip().encode("latin-1"))
                        for k, _, v in (h.partition(":") for h in lines)]}
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        complete = trio.Event()
        status, headers, parts = 500, [], []

        async def receive() -> Message:
            if pending:
                return pending.pop()
            await complete.wait()  # a streaming response listens for the client going away meanwhile
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status, headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    complete.set()

        await app(scope, receive, send)
        content = b"".join(parts)
        out = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
        out += [k + b": " + v for k, v in headers]
        if not any(k.lower() == b"content-length" for k, _ in headers):
            out.append(b"transfer-encoding: chunked")
            content = (b"%x\r\n%s\r\n" % (len(content), content) if content else b"") + b"0\r\n\r\n"
        return b"\r\n".join(out) + b"\r\n\r\n" + content

    return answer
