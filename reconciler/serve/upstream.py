"""A streaming HTTP/1.1 POST to a worker over a plain trio socket, for the router's relay.

Through httpx every chunk the worker wrote becomes one event and one send to the client, so the
relay's cost grows with the worker's chunk rate. Reading the socket directly and decoding the
chunked framing here yields everything that has arrived in one piece: when the relay falls
behind, chunks coalesce instead of queueing, and nothing waits for more bytes than are there."""

from __future__ import annotations

import re
import socket
from typing import AsyncIterator

import trio

from wire.http import HeadError, HeadTooLarge, content_length, is_chunked, split_head

from reconciler.agents import sockio

READ = 64 * 1024
CONNECT_TIMEOUT = 5.0
# A chunk-size line as llhttp takes it (RFC 9112 7.1): hex digits, at most 16 after any leading
# zeros (llhttp refuses a size past 64 bits), then extensions, each `;name` or `;name=value` (a
# token or a quoted string); no sign, no `0x`, no `_`, no space, no bare CR or LF. int(..., 16)
# took `-5` (which left the decoder's count negative), `+5`, `0x5`, `1_0` and spaces.
# (tests/unit/test_upstream.py holds each form; llhttp's own lenient `;a=` and `;=b` are refused.)
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
_CHUNK_SIZE = re.compile(rb"0*([0-9A-Fa-f]{1,16})(?:;" + _TOKEN + rb"(?:=(?:" + _TOKEN + rb"|" + _QUOTED + rb"))?)*")
SIZE_LINE_MAX = 4096  # a size line (extensions included) longer than this is refused, not buffered


class UpstreamError(Exception):
    """`started` is false when nothing was received, so another member may be tried."""

    def __init__(self, message: str, *, started: bool) -> None:
        super().__init__(message)
        self.started = started


class Pool:
    """Idle keep-alive connections per worker address: a new TCP connection for every request
    added a connection set-up in the worker's server to every time-to-first-byte."""

    def __init__(self, per_host: int = 16) -> None:
        self.idle: dict[tuple[str, int], list[socket.socket]] = {}
        self.per_host = per_host

    def take(self, key: tuple[str, int]) -> socket.socket | None:
        socks = self.idle.get(key)
        return socks.pop() if socks else None

    def give(self, key: tuple[str, int], sock: socket.socket) -> None:
        socks = self.idle.setdefault(key, [])
        if len(socks) < self.per_host:
            socks.append(sock)
        else:
            sockio.close(sock)


class UpstreamResponse:
    def __init__(self, sock: socket.socket, status: int, headers: dict[str, str], rest: bytes,
                 pool: Pool | None = None, key: tuple[str, int] = ("", 0)) -> None:
        self.sock, self.status, self.headers = sock, status, headers
        self.pool, self.key = pool, key
        self.reusable = False  # set when the body ended cleanly on a keep-alive connection
        self._buf, self._done, self._need = rest, False, 0
        if is_chunked(headers):
            self._mode, self._left = "size", None
        else:
            self._mode = "plain"
            self._left = content_length(headers)  # MalformedHead for anything but digits
            self._done = self._left == 0
            self.reusable = self._done

    def close(self) -> None:
        if self.reusable and self.pool is not None and self.headers.get("connection", "").lower() != "close":
            self.pool.give(self.key, self.sock)
        else:
            sockio.close(self.sock)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, piece by piece (see read)."""
        while piece := await self.read():
            yield piece

    async def read(self) -> bytes:
        """The next part of the body: everything complete that has arrived, de-chunked; b"" once
        the body has ended."""
        while True:
            out = self._decode()
            if out or self._done:
                return out
            try:
                more = await sockio.receive(self.sock, READ)
            except (trio.ClosedResourceError, OSError) as exc:
                raise UpstreamError(f"connection broke: {exc}", started=True) from None
            if not more:
                self._end_of_stream()
                return b""
            self._buf += more

    def _end_of_stream(self) -> None:
        self._done = True
        if self._mode == "trailer" or (self._mode == "plain" and self._left is None):
            return  # a body that ends where the connection ends, or a missing final line
        if self._mode == "plain":
            raise UpstreamError(f"connection closed {self._left} bytes before the end", started=True)
        raise UpstreamError("the worker closed the connection in the middle of its answer", started=True)

    def _decode(self) -> bytes:
        buf = self._buf
        if self._mode == "plain":
            body, self._buf = buf, b""
            if self._left is not None:
                body = body[:self._left]
                self._left -= len(body)
                if self._left == 0:
                    self._done = self.reusable = True
            return body
        out: list[bytes] = []
        while True:
            if self._mode == "data":
                take = buf[:self._need]
                if take:
                    out.append(take)
                    self._need -= len(take)
                    buf = buf[len(take):]
                if self._need:
                    break
                self._mode = "crlf"
            elif self._mode == "crlf":
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise UpstreamError("the worker sent malformed chunked framing (no CRLF after a chunk's data)",
                                        started=True)
                buf, self._mode = buf[2:], "size"
            elif self._mode == "size":
                end = buf.find(b"\r\n", 0, SIZE_LINE_MAX)
                if end < 0:
                    if len(buf) >= SIZE_LINE_MAX:
                        raise UpstreamError(f"the worker sent a chunk-size line over {SIZE_LINE_MAX} bytes",
                                            started=True)
                    break
                size_line = _CHUNK_SIZE.fullmatch(buf, 0, end)
                if size_line is None:
                    raise UpstreamError(f"the worker sent malformed chunked framing (chunk size "
                                        f"{bytes(buf[:min(end, 40)])!r})", started=True)
                buf = buf[end + 2:]
                size = int(size_line.group(1), 16)
                self._mode, self._need = ("trailer", 0) if size == 0 else ("data", size)
            else:  # trailer: headers after the last chunk end with an empty line
                if b"\r\n" in buf:
                    # A clean end leaves the connection reusable.
                    self._done, self.reusable = True, buf == b"\r\n"
                break
        self._buf = buf
        return b"".join(out)


async def post(host: str, port: int, path: str, body: bytes, pool: Pool | None = None,
               credential: str = "") -> UpstreamResponse:
    """POST and read the response head. A pooled connection the worker closed meanwhile is
    retried once on a fresh one; `started=False` errors mean nothing was received. `credential`,
    when given, is the worker's (sent as a bearer token: workers answer no one else)."""
    auth = b"Authorization: Bearer %s\r\n" % credential.encode() if credential else b""
    key = (host, port)
    pooled = pool.take(key) if pool is not None else None
    if pooled is not None:
        try:
            return await _exchange(pooled, host, port, path, body, pool, key, auth)
        except UpstreamError as exc:
            if exc.started:
                raise
    try:
        with trio.fail_after(CONNECT_TIMEOUT):
            sock = await sockio.connect(host, port)
    except (OSError, trio.TooSlowError) as exc:
        why = "timed out" if isinstance(exc, trio.TooSlowError) else exc.strerror or exc
        raise UpstreamError(f"cannot connect to {host}:{port}: {why}", started=False) from None
    return await _exchange(sock, host, port, path, body, pool, key, auth)


async def _exchange(sock: socket.socket, host: str, port: int, path: str, body: bytes, pool: Pool | None,
                    key: tuple[str, int], auth: bytes) -> UpstreamResponse:
    try:
        await sockio.send(sock, b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                                b"Content-Length: %d\r\nAccept: text/event-stream\r\n%s\r\n"
                          % (path.encode(), host.encode(), port, len(body), auth) + body)
        buf = b""
        while (split := split_head(buf)) is None:
            more = await sockio.receive(sock, READ)
            if not more:
                raise UpstreamError(f"{host}:{port} closed the connection without answering", started=False)
            buf += more
        head, rest = split
        return UpstreamResponse(sock, head.status, head.headers, rest, pool, key)
    except (trio.ClosedResourceError, OSError) as exc:
        sockio.close(sock)
        raise UpstreamError(f"{host}:{port}: {exc}", started=False) from None
    except HeadError as exc:
        sockio.close(sock)
        why = "an oversized response head" if isinstance(exc, HeadTooLarge) else f"a {exc}"
        raise UpstreamError(f"{host}:{port} sent {why}", started=False) from None
    except BaseException:
        sockio.close(sock)
        raise
