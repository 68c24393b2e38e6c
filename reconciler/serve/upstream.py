"""A streaming HTTP/1.1 POST to a worker over a plain trio socket, for the router's relay.

Through httpx every chunk the worker wrote becomes one event and one send to the client, so the
relay's cost grows with the worker's chunk rate. Reading the socket directly and decoding the
chunked framing here yields everything that has arrived in one piece: when the relay falls
behind, chunks coalesce instead of queueing, and nothing waits for more bytes than are there."""

from __future__ import annotations

from typing import AsyncIterator

import trio

READ = 64 * 1024
MAX_HEAD = 64 * 1024


class UpstreamError(Exception):
    """`started` is false when nothing was received, so another member may be tried."""

    def __init__(self, message: str, *, started: bool) -> None:
        super().__init__(message)
        self.started = started


class UpstreamResponse:
    def __init__(self, stream: trio.SocketStream, status: int, headers: dict[str, str], rest: bytes) -> None:
        self.stream, self.status, self.headers, self._rest = stream, status, headers, rest

    async def aclose(self) -> None:
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


async def post(host: str, port: int, path: str, body: bytes) -> UpstreamResponse:
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise UpstreamError(f"cannot connect to {host}:{port}: {exc.strerror or exc}", started=False) from None
    try:
        await stream.send_all(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n"
                              % (path.encode(), host.encode(), port, len(body)) + body)
        buf = b""
        while b"\r\n\r\n" not in buf:
            more = await stream.receive_some(READ)
            if not more:
                raise UpstreamError(f"{host}:{port} closed the connection without answering", started=False)
            buf += more
            if len(buf) > MAX_HEAD and b"\r\n\r\n" not in buf:
                raise UpstreamError(f"{host}:{port} sent an oversized response head", started=False)
    except (trio.BrokenResourceError, OSError) as exc:
        await stream.aclose()
        raise UpstreamError(f"{host}:{port}: {exc}", started=False) from None
    except BaseException:
        await stream.aclose()
        raise
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        await stream.aclose()
        raise UpstreamError(f"{host}:{port} sent a malformed status line", started=False) from None
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return UpstreamResponse(stream, status, headers, rest)
