"""fleet's one HTTP/1.1 client: connect (plain or TLS, a bounded wait), send a request, read the
answer's head (bounded), then its body by its framing (chunked, Content-Length or to the end of the
connection), all of it in one pass of httptools' response parser (llhttp, net/http1.py's
ResponseReader, the codec of the server side too), fed each read as it arrives.

Modes: a `Response` yields the body as it arrives (`read`: everything that has arrived, in one
piece, so chunks coalesce when the reader is behind instead of queueing; the router's relay),
whole within a bound (`whole`), or in bulk into a sink at a floor's pace (`into`: weights between
agents, a large body over plain TCP received by a blocking loop in a worker thread); `fetch` is
the one-shot whole-body call; a `Pool` keeps idle connections per host for the next request.
Plain sockets are driven by net/sockio.py (a receive waits for readiness once and reads once: the
relay's hot path, bench/relay); TLS goes through trio's SSLStream.

A chunk-size line, an extension or a trailer is taken or refused exactly as llhttp takes or
refuses it (tests/unit/test_net_client.py holds each form against httptools' verdict), and nothing
of a framing line is buffered here."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol, Sequence
from urllib.parse import urlsplit

import httptools
import trio

from wire.floor import Floor, pace
from net import sockio
from net.http1 import MAX_HEAD, HeadError, HeadTooLarge, ResponseReader, content_length, is_chunked
from net.tls import client_context

READ = 64 * 1024
CONNECT_TIMEOUT = 5.0
WHOLE_LIMIT = 64 << 20  # a whole answer larger than this is refused, not buffered (fetch's default)
# Bulk bodies (Response.into): read this much at a time on the event loop; bodies larger than BULK
# over plain TCP are received in a worker thread (receive_blocking).
BULK_READ = 1 << 20
BULK = 8 << 20
BLOCK = 512 << 10  # a bulk body is handed on in blocks of this size (bounded by FILL_S): see _fill
FILL_S = 0.1
# Behind a 1 Gbit/s link a receiver woken per arrival reads ~64-90 KiB a call: 0.7-1.0 CPU-s per GiB
# here; napping 2 ms when a read brought less than 256 KiB: 0.4-0.5 CPU-s, at the same wall time. A
# faster link fills the socket within the nap, reads come back large and it naps no more.
NAP_BELOW = 256 << 10
NAP_S = 0.002


class ClientError(Exception):
    """The exchange failed. `started` is false when nothing of the answer was received (so the
    request may be tried elsewhere), true once any of it was. `__cause__` is what failed beneath
    (an OSError, net/http1.py's HeadError, the TLS error), for callers that class failures."""

    def __init__(self, message: str, *, started: bool) -> None:
        super().__init__(message)
        self.started = started


class TlsFailed(ClientError):
    """The TCP connection was made and the TLS handshake on it failed (`__cause__` says how)."""


class Closed(ClientError):
    """The server closed the connection before the whole head of an answer came."""


class Stalled(ClientError):
    """A body came slower than its floor (wire/floor.py): `floor` says how much of it, `before`
    how many bytes came ahead of the floor's count (with the head)."""

    def __init__(self, message: str, floor: Floor, before: int) -> None:
        super().__init__(message, started=True)
        self.floor, self.before = floor, before


class Connection:
    """One connection to host:port: a non-blocking socket, wrapped in TLS when `tls` is set."""

    __slots__ = ("sock", "tls", "key")

    def __init__(self, sock: socket.socket, key: tuple[str, int] = ("", 0),
                 tls: trio.SSLStream[trio.SocketStream] | None = None) -> None:
        self.sock, self.key, self.tls = sock, key, tls

    async def receive(self, size: int) -> bytes:
        if self.tls is not None:
            return bytes(await self.tls.receive_some(size))
        return await sockio.receive(self.sock, size)

    async def send(self, data: bytes) -> None:
        if self.tls is not None:
            await self.tls.send_all(data)
        else:
            await sockio.send(self.sock, data)

    def close(self) -> None:
        sockio.close(self.sock)


class Pool:
    """Idle keep-alive connections per host:port, at most `per_host` of each and `most` in all (what
    a server's reserve of descriptors counts on: reconciler/serve/front.py): a new TCP connection
    for every request added a connection set-up in the server to every time-to-first-byte."""

    def __init__(self, per_host: int = 16, most: int = 100) -> None:
        self.idle: dict[tuple[str, int], list[Connection]] = {}
        self.per_host, self.most = per_host, most
        self.count = 0  # idle connections in all

    def take(self, key: tuple[str, int]) -> Connection | None:
        """An idle connection to `key`, newest first; plain ones the server closed meanwhile are
        noticed (sockio.idle_open) and dropped before a request is sent on them."""
        conns = self.idle.get(key)
        while conns:
            conn = conns.pop()
            self.count -= 1
            if not conns:
                del self.idle[key]  # a worker gone for good leaves no entry behind
            if conn.tls is not None or sockio.idle_open(conn.sock):
                return conn
            conn.close()
        return None

    def give(self, conn: Connection) -> None:
        conns = self.idle.setdefault(conn.key, [])
        if len(conns) < self.per_host and self.count < self.most:
            conns.append(conn)
            self.count += 1
        else:
            if not conns:
                del self.idle[conn.key]
            conn.close()

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()
        self.count = 0


class Response(ResponseReader):
    """The answer to one request, read by llhttp (ResponseReader): `send` feeds it until its head
    is whole (`status`, and `headers` with names lower-cased), the same pass goes on into the body.
    `peer` names the other end in errors ("the worker")."""

    def __init__(self, conn: Connection, pool: Pool | None = None, peer: str = "the server",
                 max_head: int = MAX_HEAD) -> None:
        super().__init__(max_head)
        self.conn, self.pool, self.peer = conn, pool, peer
        self.reusable = False  # set when the body ended cleanly on a keep-alive connection
        self.chunked = False
        self._left: int | None = None
        self.length: int | None = None  # the body's Content-Length (None: chunked, or to the end of the connection)
        self._body: list[bytes] = []
        self._done = self._complete = False
        self._after_chunk_header = False  # a chunk's size line came and none of its data yet
        self._probing = False

    def head_done(self) -> None:
        self.chunked = is_chunked(self.headers)
        self._left = self.length = None if self.chunked else content_length(self.headers)

    @property
    def sock(self) -> socket.socket:
        return self.conn.sock

    def close(self) -> None:
        """Back to the pool after a clean end on a keep-alive connection; closed otherwise."""
        if self.reusable and self.pool is not None and self.headers.get("connection", "").lower() != "close":
            self.pool.give(self.conn)
        else:
            self.conn.close()

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
            conn = self.conn
            try:
                # Plain: sockio directly, no coroutine of Connection's between (the relay's hot path).
                more = await (sockio.receive(conn.sock, READ) if conn.tls is None else conn.receive(READ))
            except (trio.ClosedResourceError, trio.BrokenResourceError, OSError) as exc:
                raise ClientError(f"connection broke: {exc}", started=True) from None
            if not more:
                self._end_of_stream()
            else:
                self.take(more)

    async def whole(self, limit: int = WHOLE_LIMIT) -> bytes:
        """The whole body; ClientError once it is known to exceed `limit` bytes (from its
        Content-Length before a byte of it is read)."""
        if self._left is not None and self._left > limit:
            raise ClientError(f"{self.peer} answered with {self._left} bytes, over the {limit} taken", started=True)
        parts, size = [], 0
        while piece := await self.read():
            size += len(piece)
            if size > limit:
                raise ClientError(f"{self.peer} answered with over {limit} bytes", started=True)
            parts.append(piece)
        return b"".join(parts)

    async def into(self, on_data: Callable[[bytes | bytearray | memoryview], None], *, patience: float) -> int:
        """The bulk mode: a Content-Length body handed to `on_data` as it arrives, returning how
        many bytes came (fewer than the length when the server closed early; the caller judges).
        The body must keep a floor's pace (wire/floor.py, `patience`), or Stalled. Past what came
        with the head the framing is a count, so llhttp is left out: over plain TCP a body of more
        than BULK bytes is received in a worker thread into one reused buffer (receive_blocking),
        the rest on the event loop. The connection is not reused after."""
        if self.length is None:
            raise ClientError(f"{self.peer} sent no Content-Length", started=True)
        self.reusable = False
        taken = 0
        for piece in self._body:
            on_data(piece)
            taken += len(piece)
        self._body = []
        left = self._left or 0
        if self._done or left <= 0:
            return taken
        try:
            if self.conn.tls is None and left > BULK:
                # The thread gets a duplicate descriptor of its own, made here: made in the thread, a
                # caller cancelled before it ran would close the connection's number, which anything
                # opened meanwhile may take. abandon_on_cancel: a caller shutting down does not wait
                # for the transfer to end; the connection is shut down under the thread, whose read
                # then ends at once (else it would read on, up to `patience` from a silent peer).
                own = socket.socket(fileno=os.dup(self.conn.sock.fileno()))
                hand_over = threading.Lock()
                state = {"started": False, "abandoned": False}

                def receive() -> int:
                    with hand_over:
                        if state["abandoned"]:
                            return 0
                        state["started"] = True
                    return receive_blocking(own, left, on_data, patience, taken, self.peer)
                try:
                    got: int = await trio.to_thread.run_sync(receive, abandon_on_cancel=True, limiter=_bulk_threads())
                except trio.Cancelled:
                    with hand_over:
                        state["abandoned"] = True
                        if not state["started"]:
                            own.close()  # the thread never ran (or will find it abandoned)
                    try:
                        self.conn.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    raise
                return taken + got
            floor = Floor(left, patience, trio.current_time)
            while floor.have < floor.want:
                chunk = None
                with trio.move_on_after(max(0.0, floor.left())):
                    chunk = await self.conn.receive(min(BULK_READ, floor.want - floor.have))
                if chunk is None:
                    raise _stalled(floor, taken, self.peer)
                if not chunk:
                    break
                on_data(chunk)
                floor.got(len(chunk))
            return taken + floor.have
        except (trio.ClosedResourceError, trio.BrokenResourceError, OSError) as exc:
            raise ClientError(f"connection broke: {exc}", started=True) from exc

    def take(self, data: bytes) -> None:
        """Feed what arrived (ResponseReader.feed), failures as ClientError (HeadError while the head is
        not whole: send reports it); bytes after the answer leave the connection unclean."""
        if self._complete:
            self.reusable = False  # bytes after the answer: the connection is not clean
            return
        try:
            self.feed(data)  # HeadError while the head is not whole: send's to report
        except HeadError as exc:
            if not self.head_whole:
                raise
            raise ClientError(f"{self.peer} sent {exc}", started=True) from exc  # framing or trailers past the bound
        except httptools.HttpParserError as exc:
            what = "malformed chunked framing" if self.chunked else "a malformed answer"
            raise ClientError(f"{self.peer} sent {what} (llhttp: {exc})", started=True) from exc
        if self.after:  # bytes after the answer: the connection is not clean
            self.reusable = False

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
                    self.parser.feed_data(b"\r\n")
                except httptools.HttpParserError:
                    pass
                self._probing = False
                if self._complete:
                    self.reusable = False
                    return
            raise ClientError(f"{self.peer} closed the connection in the middle of its answer", started=True)
        if self._left is not None:
            raise ClientError(f"connection closed {self._left} bytes before the end", started=True)
        # A body that ends where the connection ends.

    # httptools callbacks

    def on_chunk_header(self) -> None:
        self._after_chunk_header = True

    def take_body(self, body: bytes) -> None:
        if self._probing:
            self._complete = False
            raise ClientError("probe", started=True)  # the final line was taken as data: cut short
        self._after_chunk_header = False
        if self._left is not None:
            self._left -= len(body)
        self._body.append(body)

    def body_done(self) -> None:
        if self._probing:
            self._complete = True
            return
        self._complete = self._done = True
        self.reusable = self.parser.should_keep_alive()


def _stalled(floor: Floor, before: int, peer: str) -> Stalled:
    return Stalled(f"{peer} sent {pace(floor.patience)} ({before + floor.have:,} of {before + floor.want:,} "
                   "bytes so far)", floor, before)


_BULK_THREADS = trio.lowlevel.RunVar[trio.CapacityLimiter]("bulk_threads")
BULK_THREADS = 32  # bulk receives at once; apart from trio's default limiter, which they would hold


def _bulk_threads() -> trio.CapacityLimiter:
    """The bulk receives' own limiter: a peer trickling just above its floor holds a thread for
    hours, and 40 of them on trio's default limiter stopped every other `to_thread` of the agent
    (opening parts, hashing, installing)."""
    try:
        return _BULK_THREADS.get()
    except LookupError:
        limiter = trio.CapacityLimiter(BULK_THREADS)
        _BULK_THREADS.set(limiter)
        return limiter


def receive_blocking(sock: socket.socket, want: int, on_data: Callable[[bytes | bytearray | memoryview], None],
                     patience: float, before: int = 0, peer: str = "the server") -> int:
    """Receive up to `want` bytes on `sock`, blocking (run it in a worker thread), and close it;
    returns how many arrived. `sock` is a duplicate of the connection's descriptor (closing it
    leaves the connection open; both share O_NONBLOCK, which Python's timeout mode expects anyway:
    it polls, then reads). Through trio's non-blocking recv the same loop ran about 20% slower
    (smaller reads, an event-loop pass per read): bench/replication, bench/fanout."""
    floor = Floor(want, patience, time.monotonic)
    try:
        view = memoryview(bytearray(BLOCK))
        while floor.have < want:
            if (left := floor.left()) <= 0:
                raise TimeoutError
            sock.settimeout(left)
            n, ended = _fill(sock, view, min(BLOCK, want - floor.have))
            if n:
                on_data(view[:n])
                floor.got(n)
            if ended:
                break
        return floor.have
    except TimeoutError:
        raise _stalled(floor, before, peer) from None
    finally:
        sock.close()


def _fill(sock: socket.socket, view: memoryview, size: int) -> tuple[int, bool]:
    """Receive into view[:size] until it is full, or FILL_S after the first byte: (bytes, the peer
    closed). The first read waits as long as the socket's timeout says (TimeoutError after it).
    The consumer's per-call cost (two hashes started, a write, a thread handed a block) is paid
    once a block, not once a recv; the bound keeps a slow link's bytes flowing on. A block the
    size of a core's L2 cache (512 KiB here) is hashed and written while it is still there, and
    holds the socket up briefly: a chain of three behind 1 Gbit/s links ran 9.7-9.8 s a GiB with
    it, 11.5-11.7 s with 4 MiB blocks (CPU per GiB within the runs' noise)."""
    timeout = sock.gettimeout()
    n = sock.recv_into(view[:size])  # TimeoutError: the peer is idle
    if not n:
        return 0, True
    filled, until = n, time.monotonic() + FILL_S
    try:
        while filled < size:
            left = until - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                n = sock.recv_into(view[filled:size])
            except TimeoutError:
                break
            if not n:
                return filled, True
            filled += n
            if n < NAP_BELOW:  # faster than the link: let it fill the socket a moment, not wake per segment
                time.sleep(min(NAP_S, max(0.0, until - time.monotonic())))
    finally:
        sock.settimeout(timeout)
    return filled, False


@dataclass(frozen=True, slots=True)
class Whole:
    """An answer read whole (fetch)."""

    status: int
    headers: dict[str, str]
    content: bytes


class Fetch(Protocol):
    """The one-shot seam (fetch's signature): a caller that takes one can be handed an in-process
    stand-in in tests."""

    async def __call__(self, method: str, host: str, port: int, target: str, *, body: bytes = b"",
                       headers: Sequence[tuple[str, str]] = ()) -> Whole:
        ...


def encode(method: str, host: str, port: int, target: str, body: bytes, headers: Sequence[tuple[str, str]],
           keep_alive: bool) -> bytes:
    """The request's bytes: Host, the caller's headers, Content-Length where a body goes (or the
    method is one that carries one), `Connection: close` unless the connection is to be kept."""
    name = f"[{host}]" if ":" in host else host
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {name}:{port}\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in headers]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}\r\n")
    if not keep_alive:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1") + body


async def connect(host: str, port: int, *, tls: ssl.SSLContext | None = None, server_hostname: str | None = None,
                  timeout: float = CONNECT_TIMEOUT) -> Connection:
    """A connection to host:port within `timeout` seconds (the TLS handshake included, the
    certificate checked against `server_hostname`, else `host`); ClientError(started=False) when
    there is none, TlsFailed when the handshake failed."""
    try:
        with trio.fail_after(timeout):
            sock = await sockio.connect(host, port)
            if tls is None:
                return Connection(sock, (host, port))
            try:
                stream = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), tls,
                                        server_hostname=server_hostname or host, https_compatible=True)
                await stream.do_handshake()
            except (trio.BrokenResourceError, OSError) as exc:
                sockio.close(sock)
                raise TlsFailed(f"TLS with {host}:{port} failed: {exc}", started=False) from exc
            except BaseException:
                sockio.close(sock)
                raise
            return Connection(sock, (host, port), stream)
    except trio.TooSlowError:
        raise ClientError(f"cannot connect to {host}:{port}: timed out", started=False) from None
    except OSError as exc:
        raise ClientError(f"cannot connect to {host}:{port}: {exc.strerror or exc}", started=False) from exc


async def request(method: str, host: str, port: int, target: str, *, body: bytes = b"",
                  headers: Sequence[tuple[str, str]] = (), pool: Pool | None = None,
                  tls: ssl.SSLContext | None = None, peer: str = "the server", max_head: int = MAX_HEAD,
                  connect_timeout: float = CONNECT_TIMEOUT) -> Response:
    """Send the request and read the answer's head; the body is the caller's to read (Response),
    then `close()` the response. With a `pool`, an idle connection to host:port is used first (one
    the server closed meanwhile is noticed and the request sent once more on a fresh one) and a
    clean one goes back to it. ClientError(started=False) when nothing of an answer was received."""
    pooled = pool.take((host, port)) if pool is not None else None
    if pooled is not None:
        try:
            return await send(pooled, method, target, body=body, headers=headers, pool=pool, peer=peer,
                              max_head=max_head)
        except ClientError as exc:
            # Sent again only where the kept connection had gone (closed, reset): not where the
            # server answered, however badly (a POST it took must not be sent twice).
            if exc.started or isinstance(exc.__cause__, (HeadError, httptools.HttpParserError)):
                raise
    conn = await connect(host, port, tls=tls, timeout=connect_timeout)
    return await send(conn, method, target, body=body, headers=headers, pool=pool, peer=peer, max_head=max_head)


async def send(conn: Connection, method: str, target: str, *, body: bytes = b"",
               headers: Sequence[tuple[str, str]] = (), pool: Pool | None = None, peer: str = "the server",
               max_head: int = MAX_HEAD) -> Response:
    """Send a request on `conn` and read the answer's head (request's second half, for a caller
    that connects itself); the connection is closed on any failure. Kept alive only with a pool."""
    host, port = conn.key
    try:
        await conn.send(encode(method, host, port, target, body, headers, pool is not None))
        response = Response(conn, pool, peer, max_head)
        while not response.head_whole:
            more = await conn.receive(READ)
            if not more:
                raise Closed(f"{host}:{port} closed the connection without answering", started=False)
            try:
                response.take(more)
            except ClientError as exc:  # the body's framing, in the read that ended the head: nothing of it taken yet
                raise ClientError(str(exc), started=False) from exc.__cause__
        return response
    except (trio.ClosedResourceError, trio.BrokenResourceError, OSError) as exc:
        conn.close()
        raise ClientError(f"{host}:{port}: {exc}", started=False) from exc
    except HeadError as exc:
        conn.close()
        why = "an oversized response head" if isinstance(exc, HeadTooLarge) else str(exc)
        raise ClientError(f"{host}:{port} sent {why}", started=False) from exc
    except BaseException:
        conn.close()
        raise


async def fetch(method: str, host: str, port: int, target: str, *, body: bytes = b"",
                headers: Sequence[tuple[str, str]] = (), pool: Pool | None = None,
                tls: ssl.SSLContext | None = None, peer: str = "the server",
                limit: int = WHOLE_LIMIT) -> Whole:
    """One request, its answer read whole (at most `limit` bytes of body): the one-shot mode.
    Timeouts are the caller's (trio.fail_after around the call); ClientError for the rest."""
    response = await request(method, host, port, target, body=body, headers=headers, pool=pool, tls=tls, peer=peer)
    try:
        content = await response.whole(limit)
    except BaseException:
        response.reusable = False
        raise
    finally:
        response.close()
    return Whole(response.status, response.headers, content)


def split_url(url: str) -> tuple[str, int, str, bool]:
    """(host, port, target, tls) of an http:// or https:// URL; ValueError for anything else."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, parts.port or (443 if tls else 80), target, tls


async def get(url: str, *, headers: Sequence[tuple[str, str]] = (), tls: ssl.SSLContext | None = None,
              limit: int = WHOLE_LIMIT) -> Whole:
    """GET a URL on a connection of its own (a health check, a readiness probe)."""
    host, port, target, secure = split_url(url)
    if secure and tls is None:
        tls = client_context()
    return await fetch("GET", host, port, target, headers=headers, tls=tls if secure else None, limit=limit)
