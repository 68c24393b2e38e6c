"""Serving blobs to peers, stored or being fetched (agent/transfer/forward.py): single-range HTTP with large reads.

Starlette's FileResponse moves 64 KiB per ASGI message and tops out near 130 MB/s here (see
docs/ARCHITECTURE.md); 4 MiB messages cut the per-message cost of h11 and the ASGI hop to noise, which is
what lets replication run near the disk-and-hash limit on one port.

A body over plain HTTP/1.x is sent with sendfile on the connection's own socket, which the server that
accepted it hands over in the scope (net/server.py's SOCKET_EXTENSION), its head saying `connection: close`
(agent/transfer/peerhttp.py's requests ask for it anyway): the server sends the head and never sees the
body, which ends with the connection. Behind a 1 Gbit/s tbf, a sender moved a GiB for 0.16 CPU-s by
sendfile against 1.9-2.1 through trio's send_all, whose 16 KiB TCP_NOTSENT_LOWAT (set on every
connection) woke the event loop for every 16 KiB the link drained. Answers over TLS keep the ASGI
messages, with that low-water mark lifted on their connection while the body is sent (0.73-0.81).
sendfile runs on the event loop, not in a worker thread, which a peer that stops reading would hold:
bench/hopcpu.py on loopback, the source's CPU-s per GiB: ASGI messages 0.67, sendfile from a thread
0.21, on the loop 0.33 (the same ~600 wake-ups a GiB cost more through trio's scheduler)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Awaitable, Callable, Iterator

import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from net.server import SOCKET_EXTENSION
from wire.floor import FLOOR_BYTES, FLOOR_S, Floor, pace

log = logging.getLogger("fleet-agent")

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
                    ready: Callable[[int], Awaitable[int]] | None = None,
                    sending: Callable[[int], None] | None = None,
                    watch: trio.CancelScope | None = None, idle_s: float = FLOOR_S) -> None:
    """Bytes start..start+length-1 of the file `fd` in ASGI messages of CHUNK (of FLOOR_BYTES under
    a watchdog, which then cuts a reader at the floor's own pace and holds less). `ready(pos)` waits
    until byte `pos` may be sent and says how far the file may be read (a partial file's verified
    prefix; None: the whole file may be); `sending(n)` is told of each n bytes once handed on.
    `watch` (send_range's watchdog) gets a deadline of `idle_s` for each message, then of
    FLOOR_BYTES: the server's send is shielded, so a reader too slow is cut by its watchdog (the
    floor of wire/floor.py, a message at a time)."""
    step = CHUNK if watch is None else FLOOR_BYTES
    pos, left = start, length
    while left:
        n = min(step, left) if ready is None else min(step, left, await ready(pos) - pos)
        # A blocking read from the page cache takes about a millisecond per 4 MiB; a thread hop
        # per chunk would cost more than it saves.
        chunk = os.pread(fd, n, pos)
        if len(chunk) != n:
            raise FileShrank(f"the file shrank while being served ({len(chunk)} of {n} bytes at {pos:,})")
        pos, left = pos + n, left - n
        if watch is not None:
            watch.deadline = trio.current_time() + idle_s
        await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
        if watch is not None:
            if watch.cancel_called:
                raise ReaderCut(f"the peer took {pace(idle_s)}")
            watch.deadline = math.inf
        if sending is not None:
            sending(n)


class FileShrank(OSError):
    """A file served ended before the length its answer's head promised (cut, replaced, a bug)."""


class ReaderCut(Exception):
    """The watchdog cut an answer whose reader was too slow (logged and hung up already)."""


class SourceEnded(Exception):
    """What feeds an answer ended before its body did (forward.UpstreamEnded: the fetch of a file
    being forwarded failed or stalled): the answer is cut on purpose, logged with a stable code."""


def answer_headers(scope: Scope, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A blob answer's headers, with `connection: close` where the body goes by sendfile (plain
    HTTP/1.x): a body the server never sees ends with the connection, so every such answer is held
    to send_direct's floor, a keep-alive reader's too (through ASGI messages it held a 4 MiB chunk
    in a send that nothing times out)."""
    if scope.get("scheme") == "http" and scope.get("http_version") in ("1.0", "1.1"):
        return headers + [(b"connection", b"close")]
    return headers


async def send_range(scope: Scope, send: Send, fd: int, start: int, length: int,
                     ready: Callable[[int], Awaitable[int]] | None = None,
                     sending: Callable[[int], None] | None = None, idle_s: float = FLOOR_S) -> None:
    """The body of a blob answer whose head is sent: with sendfile on the connection's own socket
    over plain HTTP/1.x (the head said connection: close: answer_headers), else (TLS) in ASGI
    messages (send_body) under a watchdog. Same `ready` and `sending`; `idle_s` is the window for
    FLOOR_BYTES on both paths (wire/floor.py). An answer cut here (a reader too slow, a file that shrank, the
    fetch feeding it ended) is logged with a stable code, the peer and the blob, never a traceback:
    the peer only sees its connection end."""
    sock = _direct_socket(scope)
    if sock is None:
        ended: FileShrank | SourceEnded | None = None
        with bulk_sending(scope):
            async with trio.open_nursery() as nursery:
                watch = await nursery.start(_watchdog, scope, idle_s)
                try:
                    await send_body(send, fd, start, length, ready, sending, watch, idle_s)
                except ReaderCut:
                    pass  # logged and hung up by the watchdog
                except (FileShrank, SourceEnded) as exc:
                    _cut(scope, "blob_shrank" if isinstance(exc, FileShrank) else "blob_source_ended", exc)
                    ended = exc
                finally:
                    nursery.cancel_scope.cancel()
        # The body is short of its Content-Length: the connection ends, hung up here, or (its socket
        # not found) by the server the error reaches.
        if ended is not None and not _hang_up(scope):
            raise ended
        return
    # The head (which said connection: close) leaves now, before the body goes on the socket.
    await send({"type": "http.response.body", "body": b"", "more_body": True})
    whole = False
    try:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, BULK_LOWAT)
        await send_direct(sock, fd, start, length, ready, sending, idle_s)
        whole = True
    except (BrokenPipeError, ConnectionResetError):
        pass  # the peer went away: it resumes from what it verified
    except TimeoutError as exc:  # it stopped reading, or reads too slowly to ever finish
        _cut(scope, "blob_reader_too_slow", exc)
    except FileShrank as exc:
        _cut(scope, "blob_shrank", exc)
    except SourceEnded as exc:
        _cut(scope, "blob_source_ended", exc)
    finally:
        if not whole:
            # A cut answer (UpstreamEnded, an error) ends the connection early, as a cut ASGI body
            # does: the server, whose socket it is, closes it once the app returns unfinished.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    if whole:
        # The server never saw this body: the answer ends (and, as its head said, the connection).
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _watchdog(scope: Scope, idle_s: float,
                    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
    """Cut the connection when the deadline send_body puts on each message passes."""
    with trio.CancelScope() as watch:
        task_status.started(watch)
        await trio.sleep_forever()
    if watch.cancelled_caught:
        _cut(scope, "blob_reader_too_slow", TimeoutError(f"the peer took {pace(idle_s)}"))
        _hang_up(scope)


def _hang_up(scope: Scope) -> bool:
    """End the connection under the server: its shielded send fails, and the peer sees the answer
    end. False where the connection's socket is not found."""
    sock = connection_socket(scope)
    if sock is None:
        return False
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    return True


def _cut(scope: Scope, code: str, exc: Exception) -> None:
    client = scope.get("client") or ("?", 0)
    log.warning("[%s] the answer to %s:%s for %s was cut after its head: %s", code, client[0], client[1],
                scope.get("path", "?"), exc)


def _direct_socket(scope: Scope) -> socket.socket | None:
    if scope.get("scheme") != "http" or scope.get("http_version") not in ("1.0", "1.1"):
        return None  # TLS is the server's to write; HTTP/2 multiplexes the connection
    return connection_socket(scope)  # the head said connection: close (answer_headers)


async def send_direct(sock: socket.socket, fd: int, pos: int, left: int,
                      ready: Callable[[int], Awaitable[int]] | None = None,
                      sending: Callable[[int], None] | None = None, idle_s: float = FLOOR_S) -> None:
    """Send bytes pos..pos+left-1 of `fd` on the non-blocking `sock` by sendfile, on the event loop:
    no worker thread, which a stalled peer would hold (trio's 40 are shared with the store's work).
    The peer must take FLOOR_BYTES (or the rest) in every `idle_s` it is waited for, else
    TimeoutError: one reading nothing, or a byte a minute, is cut, so an answer's life is bounded by
    its length. Time spent in `ready` (the upstream's, bounded by forward.py) is not the peer's.
    `sending(n)` is told of the n bytes each sendfile handed to the socket."""
    floor = Floor(left, idle_s, trio.current_time)
    while left:
        n = left
        if ready is not None:
            before = trio.current_time()
            n = min(left, await ready(pos) - pos)
            floor.pause(trio.current_time() - before)
        while n:
            ask = min(n, CHUNK)  # a read from a cold disk holds the loop as long as send_body's pread does
            try:
                sent: int | None = os.sendfile(sock.fileno(), fd, pos, ask)
            except BlockingIOError:
                sent = None
            if sent == 0:
                raise FileShrank(f"the file shrank while being served (at {pos:,}, {n:,} bytes to go)")
            if sent:
                if sending is not None:
                    sending(sent)
                pos, n, left = pos + sent, n - sent, left - sent
                floor.got(sent)
            if sent == ask:
                await trio.lowlevel.checkpoint()  # a peer that keeps up never blocks: let the others run
                continue
            # The buffer is full (a retry now would get EAGAIN). It turns writable with a third of it
            # free and, TCP_NOTSENT_LOWAT lifted, under BULK_LOWAT unsent: about 600 wake-ups a GiB.
            with trio.move_on_at(floor.due):
                await trio.lowlevel.wait_writable(sock)
                continue
            raise TimeoutError(f"the peer took {pace(idle_s)}")


def connection_socket(scope: Scope) -> socket.socket | None:
    """The TCP socket a request came on, as the server that accepted it hands it over (net's
    SOCKET_EXTENSION); None under a server that gives none. The server owns it: it is written on,
    its options set and shut down here, never closed."""
    extension = (scope.get("extensions") or {}).get(SOCKET_EXTENSION)
    sock = extension.get("socket") if isinstance(extension, dict) else None
    return sock if isinstance(sock, socket.socket) else None


@contextmanager
def bulk_sending(scope: Scope) -> Iterator[None]:
    """Lift the connection's TCP_NOTSENT_LOWAT for a bulk body; set it back after (the connection
    may carry other answers). Where the socket is not found, the body is sent all the same."""
    sock = connection_socket(scope)
    if sock is None or not hasattr(socket, "TCP_NOTSENT_LOWAT"):
        yield
        return
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
            await send({"type": "http.response.start", "status": status, "headers": answer_headers(scope, headers)})
            if scope["method"] == "HEAD" or length == 0:
                await send({"type": "http.response.body", "body": b""})
                return
            await send_range(scope, send, fh.fileno(), start, length)
