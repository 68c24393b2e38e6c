"""A streaming HTTP/1.1 POST to a worker over a plain trio socket, for the router's relay.

Through httpx every chunk the worker wrote becomes one event and one send to the client, so the
relay's cost grows with the worker's chunk rate. Reading the socket directly yields everything
that has arrived in one piece: when the relay falls behind, chunks coalesce instead of queueing,
and nothing waits for more bytes than are there. The body's framing (chunked, Content-Length, or
to the end of the connection) is decoded by httptools' response parser (llhttp, the parser of the
front and of uvicorn), fed each read as it arrives: a chunk-size line, an extension or a trailer is
taken or refused exactly as llhttp takes or refuses it (tests/unit/test_upstream.py holds each
form against httptools' verdict), and nothing of a framing line is buffered here."""

from __future__ import annotations

import socket
from typing import AsyncIterator

import httptools
import trio

from wire.http import HeadError, HeadTooLarge, content_length, is_chunked, split_head

from net import sockio

READ = 64 * 1024
CONNECT_TIMEOUT = 5.0


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
    """The answer to one POST: `data` is everything read so far, its head included (split_head
    gave `status` and `headers`); llhttp is fed all of it and frames the body."""

    def __init__(self, sock: socket.socket, status: int, headers: dict[str, str], data: bytes,
                 pool: Pool | None = None, key: tuple[str, int] = ("", 0)) -> None:
        self.sock, self.status, self.headers = sock, status, headers
        self.pool, self.key = pool, key
        self.reusable = False  # set when the body ended cleanly on a keep-alive connection
        self.chunked = is_chunked(headers)
        self._left = None if self.chunked else content_length(headers)  # MalformedHead for anything but digits
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._done = self._complete = False
        self._after_chunk_header = False  # a chunk's size line came and none of its data yet
        self._probing = False
        try:
            self._feed(data)
        except UpstreamError as exc:  # nothing of the body was relayed yet: another member may be tried
            raise UpstreamError(str(exc), started=False) from None

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
        """The next part of the body: everything that has arrived, de-chunked; b"" once the body
        has ended."""
        while True:
            if self._body or self._done:
                out, self._body = b"".join(self._body), []
                return out
            try:
                more = await sockio.receive(self.sock, READ)
            except (trio.ClosedResourceError, OSError) as exc:
                raise UpstreamError(f"connection broke: {exc}", started=True) from None
            if not more:
                self._end_of_stream()
            else:
                self._feed(more)

    def _feed(self, data: bytes) -> None:
        if self._complete:
            self.reusable = False  # bytes after the answer: the connection is not clean
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._complete:  # the answer ended and more came after it
                self.reusable = False
                return
            what = "malformed chunked framing" if self.chunked else "a malformed answer"
            raise UpstreamError(f"the worker sent {what} (llhttp: {exc})", started=True) from None

    def _end_of_stream(self) -> None:
        self._done = True
        if self._complete:
            return
        if self.chunked:
            # A last chunk without its final empty line (llhttp waits for it): taken, as the whole
            # body has come, but the connection is not reused. Told apart from a chunk whose data
            # never came by feeding that line: a last chunk completes, a data chunk takes it as data.
            if self._after_chunk_header:
                self._probing = True
                try:
                    self._parser.feed_data(b"\r\n")
                except httptools.HttpParserError:
                    pass
                self._probing = False
                if self._complete:
                    self.reusable = False
                    return
            raise UpstreamError("the worker closed the connection in the middle of its answer", started=True)
        if self._left is not None:
            raise UpstreamError(f"connection closed {self._left} bytes before the end", started=True)
        # A body that ends where the connection ends.

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._complete:  # bytes of another answer after this one: the connection is not clean
            self.reusable = False

    def on_chunk_header(self) -> None:
        self._after_chunk_header = True

    def on_body(self, body: bytes) -> None:
        if self._probing:
            self._complete = False
            raise UpstreamError("probe", started=True)  # the final line was taken as data: cut short
        self._after_chunk_header = False
        if self._left is not None:
            self._left -= len(body)
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._probing:
            self._complete = True
            return
        self._complete = self._done = True
        self.reusable = self._parser.should_keep_alive()


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
        head, _ = split
        return UpstreamResponse(sock, head.status, head.headers, buf, pool, key)
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
