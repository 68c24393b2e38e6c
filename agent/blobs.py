"""Serving blobs to peers, stored or being fetched (agent/forward.py): single-range HTTP with large reads.

Starlette's FileResponse moves 64 KiB per ASGI message and tops out near 130 MB/s here (see
docs/ARCHITECTURE.md); 4 MiB messages cut the per-message cost of h11 and the ASGI hop to noise, which is
what lets replication run near the disk-and-hash limit on one port.

trio gives every connection TCP_NOTSENT_LOWAT = 16 KiB (low latency for small answers): a bulk
body then wakes the event loop for every 16 KiB the link drains. Measured here behind a 1 Gbit/s
tbf: 1.9-2.1 CPU-s per GiB for the sender, 0.73-0.81 with the limit lifted, 0.16 with sendfile
(which the ASGI body messages rule out). So a blob answer lifts it on its own connection while its
body is sent, and sets it back after."""

from __future__ import annotations

import json
import os
import re
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Awaitable, Callable, Iterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

CHUNK = 4 << 20
BULK_LOWAT = 4 << 20  # unsent bytes a bulk answer lets the kernel hold before its socket is writable
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)\Z")
# A position of more digits than this is past the end of any file. Python refuses int() of more
# than 4,300 digits (ValueError, a 500 with a traceback), so long ones are never converted.
_DIGITS = 19
_FAR = 1 << 64


def _position(digits: str) -> int:
    return int(digits) if len(digits) <= _DIGITS else _FAR


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(start, end inclusive), None for the whole file, or "unsatisfiable"."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None  # RFC 9110: an unparseable Range is ignored
    if not m.group(1):  # suffix: the last N bytes
        n = _position(m.group(2))
        return (max(0, size - n), size - 1) if n and size else "unsatisfiable"
    start = _position(m.group(1))
    end = min(_position(m.group(2)), size - 1) if m.group(2) else size - 1
    if start >= size or end < start:
        return "unsatisfiable"
    return start, end


def head_of(rng: tuple[int, int] | None, size: int) -> tuple[int, list[tuple[bytes, bytes]], int, int]:
    """An answer's status, headers, first byte and length, for a range parse_range accepted."""
    start, end = rng if rng is not None else (0, size - 1)
    length = end - start + 1 if size else 0
    headers = [(b"content-type", b"application/octet-stream"), (b"accept-ranges", b"bytes"),
               (b"content-length", str(length).encode())]
    if rng is not None:
        headers.append((b"content-range", f"bytes {start}-{end}/{size}".encode()))
    return (206 if rng is not None else 200), headers, start, length


async def send_error(send: Send, status: int, code: str, message: str,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": (extra or []) + [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_unsatisfiable(send: Send, range_header: str | None, size: int) -> None:
    await send_error(send, 416, "range_not_satisfiable", f"the range asked ({(range_header or '')[:64]}) is "
                     f"outside the blob's {size} bytes", [(b"content-range", f"bytes */{size}".encode())])


async def send_body(send: Send, fd: int, start: int, length: int,
                    ready: Callable[[int], Awaitable[int]] | None = None) -> None:
    """Bytes start..start+length-1 of the file `fd`, CHUNK at a time: the one body loop of a stored
    blob and of a file being fetched. `ready(pos)` waits until byte `pos` may be sent and says how
    far the file may be read (a partial file's verified prefix); None: the whole file may be."""
    pos, left = start, length
    while left:
        n = min(CHUNK, left) if ready is None else min(CHUNK, left, await ready(pos) - pos)
        # A blocking read from the page cache takes about a millisecond per 4 MiB; a thread hop
        # per chunk would cost more than it saves.
        chunk = os.pread(fd, n, pos)
        if len(chunk) != n:
            raise OSError(f"the file shrank while being served ({len(chunk)} of {n} bytes at {pos:,})")
        pos, left = pos + n, left - n
        await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})


def connection_socket(scope: Scope) -> socket.socket | None:
    """A duplicate of the TCP socket a request came on, found by its two addresses among this
    process's descriptors (Linux /proc); None where it is not found. The ASGI server keeps its
    socket to itself: this is the one way to it that depends on no server's internals."""
    server, client = scope.get("server"), scope.get("client")
    if not server or not client:
        return None
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue  # closed meanwhile
        try:
            if (sock.type == socket.SOCK_STREAM and tuple(sock.getsockname()[:2]) == tuple(server)
                    and tuple(sock.getpeername()[:2]) == tuple(client)):
                return sock
        except OSError:
            pass  # a listener, or a socket not connected
        sock.close()
    return None


@contextmanager
def bulk_sending(scope: Scope) -> Iterator[None]:
    """Lift the connection's TCP_NOTSENT_LOWAT for a bulk body; set it back after (the connection
    may carry other answers). Where the socket is not found, the body is sent all the same."""
    sock = connection_socket(scope)
    if sock is None or not hasattr(socket, "TCP_NOTSENT_LOWAT"):
        yield
        return
    with sock:
        try:
            before = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, BULK_LOWAT)
        except OSError:
            before = None
        try:
            yield
        finally:
            if before is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, before)
                except OSError:
                    pass  # the connection is gone


class BlobResponse(Response):
    def __init__(self, path: Path, range_header: str | None) -> None:
        self.path = path
        self.range_header = range_header
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            rng = parse_range(self.range_header, size)
            if rng == "unsatisfiable":
                await send_unsatisfiable(send, self.range_header, size)
                return
            status, headers, start, length = head_of(rng if isinstance(rng, tuple) else None, size)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if scope["method"] == "HEAD" or length == 0:
                await send({"type": "http.response.body", "body": b""})
                return
            with bulk_sending(scope):
                await send_body(send, fh.fileno(), start, length)
