"""A streaming HTTP/1.1 POST to a worker over a plain trio socket, for the router's relay.

Through httpx every chunk the worker wrote becomes one event and one send to the client, so the
relay's cost grows with the worker's chunk rate. Reading the socket directly and decoding the
chunked framing here yields everything that has arrived in one piece: when the relay falls
behind, chunks coalesce instead of queueing, and nothing waits for more bytes than are there."""

from __future__ import annotations

from typing import AsyncIterator

import trio

from agent.peerhttp import parse_head

READ = 64 * 1024
MAX_HEAD = 64 * 1024


class UpstreamError(Exception):
    """`started` is false when nothing was received, so another member may be tried."""

    def __init__(self, message: str, *, started: bool) -> None:
        super().__init__(message)
        self.started = started


class Pool:
    """Idle keep-alive connections per worker address: a new TCP connection for every request
    added a connection set-up in the worker's server to every time-to-first-byte."""

    def __init__(self, per_host: int = 16) -> None:
        self.idle: dict[tuple[str, int], list[trio.SocketStream]] = {}
        self.per_host = per_host

    def take(self, key: tuple[str, int]) -> trio.SocketStream | None:
        streams = self.idle.get(key)
        return streams.pop() if streams else None

    async def give(self, key: tuple[str, int], stream: trio.SocketStream) -> None:
        streams = self.idle.setdefault(key, [])
        if len(streams) < self.per_host:
            streams.append(stream)
        else:
            await stream.aclose()


class UpstreamResponse:
    def __init__(self, stream: trio.SocketStream, status: int, headers: dict[str, str], rest: bytes,
                 pool: Pool | None = None, key: tuple[str, int] = ("", 0)) -> None:
        self.stream, self.status, self.headers, self._rest = stream, status, headers, rest
        self.pool, self.key = pool, key
        self.reusable = False  # set when the body ended cleanly on a keep-alive connection

    async def aclose(self) -> None:
        if self.reusable and self.pool is not None and self.headers.get("connection", "").lower() != "close":
            await self.pool.give(self.key, self.stream)
        else:
            await self.stream.aclose()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: de-chunked, each piece everything complete so far."""
        if "chunked" not in self.headers.get("transfer-encoding", "").lower():
            left = int(self.headers["content-length"]) if "content-length" in self.headers else None
            data = self._rest
            while True:
                if data:
                    if left is not None:
                        data = data[:left]
                        left -= len(data)
                    yield data
                if left == 0:
                    self.reusable = True
                    return
                data = await self._read()
                if not data:
                    if left:
                        raise UpstreamError(f"connection closed {left} bytes before the end", started=True)
                    return
        buf, mode, need = self._rest, "size", 0
        while True:
            out: list[bytes] = []
            progress = True
            while progress:
                progress = False
                if mode == "data":
                    take = buf[:need]
                    if take:
                        out.append(take)
                        need -= len(take)
                        buf = buf[len(take):]
                    if need == 0:
                        mode, progress = "crlf", True
                elif mode == "crlf" and len(buf) >= 2:
                    buf, mode, progress = buf[2:], "size", True
                elif mode == "size" and (end := buf.find(b"\r\n")) >= 0:
                    try:
                        size = int(buf[:end].split(b";")[0], 16)
                    except ValueError:
                        raise UpstreamError("the worker sent malformed chunked framing", started=True) from None
                    buf = buf[end + 2:]
                    if size == 0:
                        if out:
                            yield b"".join(out)
                        # Trailers end with an empty line; a clean end leaves the connection reusable.
                        while b"\r\n" not in buf:
                            more = await self._read()
                            if not more:
                                return
                            buf += more
                        self.reusable = buf == b"\r\n"
                        return
                    mode, need, progress = "data", size, True
            if out:
                yield b"".join(out)
            more = await self._read()
            if not more:
                raise UpstreamError("the worker closed the connection in the middle of its answer", started=True)
            buf += more

    async def _read(self) -> bytes:
        try:
            return await self.stream.receive_some(READ)
        except (trio.BrokenResourceError, OSError) as exc:
            raise UpstreamError(f"connection broke: {exc}", started=True) from None


async def post(host: str, port: int, path: str, body: bytes, pool: Pool | None = None) -> UpstreamResponse:
    """POST and read the response head. A pooled connection the worker closed meanwhile is
    retried once on a fresh one; `started=False` errors mean nothing was received."""
    key = (host, port)
    pooled = pool.take(key) if pool is not None else None
    if pooled is not None:
        try:
            return await _exchange(pooled, host, port, path, body, pool, key)
        except UpstreamError as exc:
            if exc.started:
                raise
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise UpstreamError(f"cannot connect to {host}:{port}: {exc.strerror or exc}", started=False) from None
    return await _exchange(stream, host, port, path, body, pool, key)


async def _exchange(stream: trio.SocketStream, host: str, port: int, path: str, body: bytes, pool: Pool | None,
                    key: tuple[str, int]) -> UpstreamResponse:
    try:
        await stream.send_all(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\nAccept: text/event-stream\r\n\r\n"
                              % (path.encode(), host.encode(), port, len(body)) + body)
        buf = b""
        while b"\r\n\r\n" not in buf:
            more = await stream.receive_some(READ)
            if not more:
                raise UpstreamError(f"{host}:{port} closed the connection without answering", started=False)
            buf += more
            if len(buf) > MAX_HEAD and b"\r\n\r\n" not in buf:
                raise UpstreamError(f"{host}:{port} sent an oversized response head", started=False)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        await stream.aclose()
        raise UpstreamError(f"{host}:{port}: {exc}", started=False) from None
    except BaseException:
        await stream.aclose()
        raise
    head, _, rest = buf.partition(b"\r\n\r\n")
    parsed = parse_head(head)
    if parsed is None:
        await stream.aclose()
        raise UpstreamError(f"{host}:{port} sent a malformed status line", started=False)
    status, headers = parsed
    return UpstreamResponse(stream, status, headers, rest, pool, key)
