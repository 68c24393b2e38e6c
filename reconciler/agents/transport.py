"""How an agent call travels: one seam (`Transport.exchange`: a request for a status and bytes), the
raw-socket transport production runs, and the reader every answer goes through (AgentAnswer, on
net/http1.py's codec); tests/memory_transport.py answers the same seam in memory, read by the same
reader, so that tests run the parsing code production runs."""

from __future__ import annotations

import errno
import os
import re
import socket
import ssl
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import httptools
import trio

from wire import live

from net import sockio
from net.http1 import HeadError, HeadTooLarge, ResponseReader, content_length, is_chunked
from net.tls import client_context
from reconciler.agents.errors import AgentProtocolError, NodeUnreachable
from reconciler.core.desired import NodeSpec

ANSWER_LIMIT = 64 << 20  # an agent's answer larger than this is refused, not buffered
READ = 65536
CLOSE_NOTIFY_S = 1.0  # a TLS connection is ended with close_notify, unless sending it takes longer

Receive = Callable[[int], Awaitable[bytes | bytearray]]  # up to n bytes of the answer; b"" once it has ended


@dataclass(frozen=True, slots=True)
class AgentRequest:
    method: str
    node: NodeSpec
    path: str
    body: bytes | None = None  # JSON
    secret: str = field(default="", repr=False)
    unless: str | None = None  # If-None-Match: the generation the caller holds (GET /v1/state)

    def encode(self, keep_alive: bool = False) -> bytes:
        """The request as it goes on the wire: one request per connection, closed after the answer
        (unless `keep_alive`: then the connection may carry the next request to that agent)."""
        node = self.node
        host = f"[{node.address}]" if ":" in node.address else node.address
        head = (f"{self.method} {self.path} HTTP/1.1\r\nHost: {host}:{node.agent_port}\r\n"
                f"Authorization: Bearer {self.secret}\r\n")
        if not keep_alive:
            head += "Connection: close\r\n"
        if self.unless is not None:
            head += f'If-None-Match: "{self.unless}"\r\n'
        if self.body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(self.body)}\r\n"
        return head.encode() + b"\r\n" + (self.body or b"")


class Transport(Protocol):
    async def exchange(self, request: AgentRequest) -> tuple[int, bytes]:
        """The answer's status and body (for a 304, its fleet-live header's value: read_response).
        Raises NodeUnreachable or AgentProtocolError for what the reader finds; OSError or
        trio.BrokenResourceError for the connection (the client names them); timeouts are the caller's."""
        ...


class SocketTransport:
    """Each call on a connection of its own over a plain non-blocking socket (TLS where the node
    says so). Through httpx each call cost about 1 ms of CPU, most of the heartbeat's budget at a
    thousand nodes (bench/heartbeat).

    `keep_alive` (the heartbeat's): a plain connection is kept after a GET for the next GET to that
    agent, up to `max_idle` of them. Setting up and tearing down a connection was most of a quiet
    beat's CPU at 10,000 agents once 304s spared the parsing; a kept one the agent closed meanwhile
    is noticed before use, or the GET is asked once more on a fresh connection."""

    def __init__(self, ca_file: str | None = None, *, keep_alive: bool = False, max_idle: int = 0) -> None:
        # ca_file: trust agents' certificates signed by this CA (or self-signed ones given directly),
        # for nodes that name no CA file of their own (NodeSpec.ca_file, from fleet.yaml).
        self._ca_file = ca_file
        # One context per CA file, made on the first TLS call to a node using it: loading the CAs
        # costs 0.1-0.2 s.
        self._ssl: dict[str | None, ssl.SSLContext] = {}
        self._keep, self._max_idle = keep_alive, max_idle
        self._idle: dict[tuple[str, int], socket.socket] = {}

    @property
    def keeps(self) -> bool:
        """Whether it keeps connections between calls (the heartbeat's)."""
        return self._keep

    async def exchange(self, request: AgentRequest) -> tuple[int, bytes]:
        node = request.node
        key = (node.address, node.agent_port)
        keep = self._keep and request.method == "GET" and not node.tls
        if keep:
            kept = self._idle.pop(key, None)
            if kept is not None and sockio.idle_open(kept):
                try:
                    return await self._plain(kept, request, key, True)
                except (OSError, NodeUnreachable):
                    pass  # closed by the agent meanwhile (a GET: asked again on a fresh connection)
            elif kept is not None:
                sockio.close(kept)
        sock = None if node.tls else _connecting(node, keep)
        if sock is None:
            sock = await sockio.connect(node.address, node.agent_port)
        if node.tls:
            return await self._exchange_tls(request, sock)
        return await self._plain(sock, request, key, keep)

    async def _plain(self, sock: socket.socket, request: AgentRequest, key: tuple[str, int],
                     keep: bool) -> tuple[int, bytes]:
        # The socket driven directly (sockio), without trio's SocketStream, whose every call tries,
        # waits and tries again: at 10,000 nodes a call's CPU was most of a plan's (bench/plan_scale).
        reusable = False
        try:
            await sockio.send(sock, request.encode(keep))
            await trio.lowlevel.wait_readable(sock)  # the answer's first bytes; the rest is mostly there then
            status, body, reusable = await read_response(request.node, lambda n: _receive(sock, n))
            return status, body
        finally:
            if keep and reusable and len(self._idle) < self._max_idle and key not in self._idle:
                self._idle[key] = sock
            else:
                # No other task ever waits on this socket, and this one waits no more: trio needs no
                # notify_closing, and the kernel drops the socket from trio's epoll as it closes it
                # (the explicit EPOLL_CTL_DEL was one of a plan's ten system calls per node).
                sock.close()

    def close(self) -> None:
        for sock in self._idle.values():
            sockio.close(sock)
        self._idle.clear()

    async def _exchange_tls(self, request: AgentRequest, sock: socket.socket) -> tuple[int, bytes]:
        node = request.node
        ca_file = node.ca_file or self._ca_file
        context = self._ssl.get(ca_file)
        if context is None:
            try:
                context = self._ssl[ca_file] = client_context(ca_file)
            except BaseException:  # the CA file gone since the fleet file was read: no socket left behind
                sockio.close(sock)
                raise
        # The certificate is checked against the name the node goes by (sent as SNI too); its address
        # is only where to connect. Not https_compatible: in that mode trio's aclose sends no
        # close_notify (an agent's answer always has a length, so a ragged end is never read).
        stream = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), context,
                                server_hostname=node.hostname or node.address)
        try:
            await stream.send_all(request.encode())
            return await read_answer(node, stream.receive_some)
        finally:
            await _close_tls(stream)


async def _close_tls(stream: trio.SSLStream[trio.SocketStream]) -> None:
    """End the connection as TLS means it to end: close_notify first (SSLStream.aclose), so the agent
    can tell an answer read whole from a connection cut; only then the socket. A peer that already
    went, or a close that takes too long, just closes the socket."""
    with trio.move_on_after(CLOSE_NOTIFY_S):
        try:
            await stream.aclose()
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    await trio.aclose_forcefully(stream)


def _connecting(node: NodeSpec, keep: bool = False) -> socket.socket | None:
    """A socket whose connection to a node named by its address has begun, without waiting for it:
    the request's send waits while it is still connecting (sockio.send), and fails as a connect
    would (the same errno). On loopback the handshake is done before connect returns, and the wait
    for writability was one of a call's two trips through trio's scheduler (bench/plan_scale).
    None for a host name, which sockio.connect resolves. Made non-blocking as it is created, and,
    unless `keep`, without TCP_NODELAY: its one request goes out in one send, which Nagle never
    holds back (two system calls fewer per node of a plan)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, node.address)
        except OSError:
            continue
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        if keep:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # later requests too go out at once
        code = sock.connect_ex((node.address, node.agent_port))
        if code in (0, errno.EINPROGRESS):
            return sock
        sock.close()
        raise OSError(code, os.strerror(code))
    return None


async def _receive(sock: socket.socket, size: int) -> bytes:
    """What is there already, else sockio.receive: an agent writes its answer's head and body
    apart, and the body has mostly arrived by the time the head is read; waiting for it through
    trio's scheduler cost as much as the rest of reading it. The caller waits for the first bytes
    itself, so that a heartbeat's 304 costs no read that finds nothing."""
    try:
        return sock.recv(size)
    except BlockingIOError:
        return await sockio.receive(sock, size)


async def read_answer(node: NodeSpec, receive: Receive) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response (Content-Length, or up to the connection's end)."""
    status, body, _ = await read_response(node, receive)
    return status, body


async def read_response(node: NodeSpec, receive: Receive) -> tuple[int, bytes, bool]:
    """read_answer, and whether the connection may carry another request (the answer was framed
    by its length, and the agent did not say it closes). A 304 has no body: in its place comes its
    fleet-live header's value (wire/live.py), the one part of its head the client reads."""
    more = bytes(await receive(READ))
    if (value := quiet_304(more)) is not None:
        return 304, value, True
    answer = AgentAnswer(node)
    while (got := answer.take(more)) is None:
        more = bytes(await receive(READ))
    return got


class AgentAnswer(ResponseReader):
    """One agent's answer read as it arrives (`take`), through net/http1.py's ResponseReader
    (llhttp): its body gathered up to ANSWER_LIMIT, every failure an AgentError naming the node.
    read_response and batch.py's calls both read through it."""

    def __init__(self, node: NodeSpec) -> None:
        super().__init__()
        self.node = node
        self.body: list[bytes] = []
        self.size = 0
        self.want: int | None = None  # the body's length; None: up to the connection's end
        self.ended = False  # the body ended by its framing
        self.reusable = False  # llhttp's verdict once the body ended (keep-alive, no close)

    def take(self, data: bytes | bytearray) -> tuple[int, bytes, bool] | None:
        """Feed what came (b"" at the connection's end): (status, body, whether the connection may
        carry another request) once the answer is whole, None while more is needed. A 304's body
        is its fleet-live header's value."""
        node = self.node
        if data and not self.ended:
            try:
                self.feed(bytes(data))  # what comes after the answer's end sets `after`
            except HeadTooLarge as exc:
                raise AgentProtocolError(node, str(exc) if self.head_whole else "an oversized response head") from None
            except HeadError as exc:
                raise AgentProtocolError(node, str(exc)) from None
            except httptools.HttpParserError as exc:
                if self.head_whole and is_chunked(self.headers):
                    raise AgentProtocolError(node, _CHUNKED) from None
                raise AgentProtocolError(node, f"a malformed answer (llhttp: {exc})") from None
        elif data:
            self.after = True  # bytes after the answer: the connection is not clean
        if not self.head_whole:
            if not data:
                raise NodeUnreachable(node, "the connection closed before an answer")
            return None
        if is_chunked(self.headers):  # fleet-agent always sends a length: something else answered
            raise AgentProtocolError(node, _CHUNKED)
        if max(self.size, self.want or 0) > ANSWER_LIMIT:
            raise AgentProtocolError(node, f"an answer over {ANSWER_LIMIT >> 20} MiB")
        if self.ended:
            reusable = self.reusable and not self.after
            if self.status == 304:
                return 304, self.headers.get(live.HEADER, "").encode("latin-1"), reusable
            return self.status, b"".join(self.body), reusable
        if not data:
            if self.want is None:  # the body ends with the connection
                return self.status, b"".join(self.body), False
            raise NodeUnreachable(node, f"the connection closed after {self.size} of {self.want} bytes")
        return None

    def head_done(self) -> None:
        if not is_chunked(self.headers):  # a chunked one is refused once llhttp's pass returns
            self.want = content_length(self.headers)  # a 204's or 304's is no body's: llhttp ends it at once

    def take_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size <= ANSWER_LIMIT:
            self.body.append(body)

    def body_done(self) -> None:
        self.ended = True
        self.reusable = self.parser.should_keep_alive()


_CHUNKED = "a chunked answer, which fleet-agent never sends (is a proxy in between?)"


# A quiet heartbeat's answer as fleet-agent writes it: a 304, then lower-case names and printable
# values, none of them a framing or connection header (a close is read by llhttp).
_QUIET = re.compile(rb"HTTP/1\.1 304 Not Modified\r\n"
                    rb"((?:(?!connection:|content-length:|transfer-encoding:)[a-z0-9-]+: [\x20-\x7e]*\r\n)*)\r\n")
_LIVE = b"\r\n" + live.HEADER.encode() + b": "


def quiet_304(data: bytes) -> bytes | None:
    """The fleet-live value (b"" when there is none) of `data` when it is exactly a quiet heartbeat's
    whole 304 as fleet-agent writes it, for a keep-alive connection; None for anything else, which
    AgentAnswer (llhttp) reads. llhttp's way costs a quiet beat several times this one's CPU an
    agent (bench/heartbeat, bench/RESULTS.md), and both read every such answer alike
    (tests/unit/test_batch.py)."""
    match = _QUIET.fullmatch(data)
    if match is None:
        return None
    lines = b"\r\n" + match.group(1)
    at = lines.find(_LIVE)
    if at < 0:
        return b""
    at += len(_LIVE)
    end = lines.index(b"\r\n", at)
    if lines.find(_LIVE, end) >= 0:
        return None  # twice: llhttp's reading decides
    return lines[at:end].strip()
