"""A minimal HTTP/1.1 GET over plain trio sockets, for bulk bytes between agents.

httpx's streaming body reader moves about 120-130 MB/s on this kind of machine, slower than the
disk and the hash (docs/ARCHITECTURE.md); reading the socket directly into the hasher and the file is the
fewest steps that still verify and store. Only what our own agents send is supported: one request
per connection, a Content-Length body, no chunking, no redirects."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import time
from typing import Callable
from urllib.parse import urlsplit

import trio

from net.tls import client_context
from wire.floor import FLOOR_S, Floor, pace
from wire.http import MAX_HEAD, HeadTooLarge, MalformedHead, ResponseHead, split_head

RECV = 1 << 20
BLOCK = 512 << 10  # a bulk body is handed on in blocks of this size (bounded by FILL_S): see _fill
FILL_S = 0.1
# Behind a 1 Gbit/s link a receiver woken per arrival reads ~64-90 KiB a call: 0.7-1.0 CPU-s per GiB
# here; napping 2 ms when a read brought less than 256 KiB: 0.4-0.5 CPU-s, at the same wall time. A
# faster link fills the socket within the nap, reads come back large and it naps no more.
NAP_BELOW = 256 << 10
NAP_S = 0.002
BULK = 8 << 20  # bodies larger than this are received in a worker thread
PATIENCE = FLOOR_S  # the connection, the answer's head, and each floor's worth of its body (wire/floor.py)


def _too_slow(floor: Floor, base: str, path: str, before: int = 0) -> PeerError:
    """The fetch gives up on a body under the floor (`before`: what came with the answer's head)."""
    return PeerError(f"peer {base} sent {pace(floor.patience)} of {path} "
                     f"({before + floor.have:,} of {before + floor.want:,} bytes so far)",
                     resumable=True, code="peer_too_slow")


def _blocking_receive(fd: int, want: int, on_data: Callable[[bytes | bytearray | memoryview], None],
                      base: str, path: str, patience: float, before: int = 0) -> int:
    """Receive up to `want` bytes on a duplicate of `fd`, blocking; returns how many arrived."""
    # A duplicate descriptor: closing it leaves trio's socket open. Both share O_NONBLOCK, which
    # Python's timeout mode expects anyway (it polls, then reads).
    sock = socket.socket(fileno=os.dup(fd))
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
        raise _too_slow(floor, base, path, before) from None
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


class PeerError(Exception):
    """A failed transfer. `resumable` is true when what was received so far is good to keep; `code` is
    the stable code the fetch fails with, `answer_code` the one the peer's error answer carried."""

    def __init__(self, message: str, *, status: int | None = None, resumable: bool = False,
                 code: str = "fetch_failed", answer_code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.resumable = resumable
        self.code = code
        self.answer_code = answer_code


async def _connect(base: str, ssl_context: ssl.SSLContext | None,
                   server_hostname: str | None = None) -> tuple[trio.abc.Stream, str]:
    parts = urlsplit(base)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise PeerError(f"cannot connect to peer {base}: {exc.strerror or exc}", resumable=True) from None
    if parts.scheme == "https":
        # As the control plane checks an agent (reconciler/agents/transport.py): the certificate against the
        # name the peer goes by in fleet.yaml (sent as SNI too); its address is only where to connect.
        name = server_hostname or host
        tls = trio.SSLStream(stream, ssl_context or client_context(), server_hostname=name)
        try:
            await tls.do_handshake()
        except (trio.BrokenResourceError, OSError) as exc:
            await trio.aclose_forcefully(tls)
            refused = _tls_error(exc)
            if refused is None:  # the connection broke, not the trust: worth asking again
                raise PeerError(f"connection to peer {base} broke during the TLS handshake: {exc}",
                                resumable=True) from None
            why = (f"certificate verify failed: {refused.verify_message}"
                   if isinstance(refused, ssl.SSLCertVerificationError) else str(refused))
            # Final: asking again meets the same certificate.
            raise PeerError(f"TLS with peer {base} (checked as {name!r}) failed: {why}",
                            code="peer_tls_failed") from None
        stream = tls
    return stream, f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"


def _tls_error(exc: BaseException | None) -> ssl.SSLError | None:
    """The TLS error under a failed handshake (trio raises BrokenResourceError from it) when asking
    again meets it again: the peer's certificate, or a peer that does not speak TLS (or no version
    we do). None for the rest: a peer that closes mid-handshake (SSLEOFError: restarting,
    overloaded) or a connection that broke is worth asking again."""
    while exc is not None and not isinstance(exc, ssl.SSLError):
        exc = exc.__cause__ or exc.__context__
    if isinstance(exc, ssl.SSLCertVerificationError) or (
            type(exc) is ssl.SSLError and exc.reason in _TLS_MISMATCH):
        return exc
    return None


_TLS_MISMATCH = frozenset({"WRONG_VERSION_NUMBER", "UNSUPPORTED_PROTOCOL", "TLSV1_ALERT_PROTOCOL_VERSION",
                           "NO_PROTOCOLS_AVAILABLE", "VERSION_TOO_LOW", "VERSION_TOO_HIGH"})


async def get(base: str, path: str, secret: str, on_data: Callable[[bytes | bytearray | memoryview], None], *,
              start: int | None = None, end: int | None = None,
              ssl_context: ssl.SSLContext | None = None, server_hostname: str | None = None,
              patience: float = PATIENCE) -> int:
    """GET base+path (bytes start..end inclusive when given), feeding the body to `on_data` as it
    arrives. Returns the status (200 or 206). Raises PeerError with the peer's own message. Over
    TLS the peer's certificate is checked against `server_hostname` (else the URL's host). Every
    wait is bounded: the connection and the answer's head within `patience` seconds, then the body
    at FLOOR_BYTES every `patience` (a peer that stalls or drips is given up on; the fetch resumes)."""
    connected = None
    with trio.move_on_after(patience):
        connected = await _connect(base, ssl_context, server_hostname)
    if connected is None:
        raise PeerError(f"peer {base} did not take a connection for {path} within {patience:g} s",
                        resumable=True, code="peer_too_slow")
    stream, hostport = connected
    async with stream:
        range_header = f"Range: bytes={start}-{'' if end is None else end}\r\n" if start is not None else ""
        request = (f"GET {path} HTTP/1.1\r\nHost: {hostport}\r\nAuthorization: Bearer {secret}\r\n"
                   f"{range_header}Connection: close\r\nUser-Agent: fleet-agent\r\n\r\n")
        try:
            split = None
            with trio.move_on_after(patience):
                split = await _ask(stream, request.encode(), base, path)
            if split is None:
                raise PeerError(f"peer {base} sent no whole answer head for {path} within {patience:g} s",
                                resumable=True, code="peer_too_slow")
            head, body = split
            try:
                length = head.content_length()
            except MalformedHead as exc:
                raise PeerError(f"peer {base} sent a {exc} for {path}") from None
            if length is None:
                raise PeerError(f"peer {base} sent no Content-Length for {path}")
            status = head.status
            if status not in (200, 206):
                with trio.move_on_after(patience):  # the error's text, if it comes: a bounded wait
                    while len(body) < min(length, MAX_HEAD):
                        more = await stream.receive_some(RECV)
                        if not more:
                            break
                        body += more
                raise PeerError(f"peer {base} answered {status} for {path}: {_message(body)}", status=status,
                                resumable=status >= 500, answer_code=_code(body))
            if start is not None and start > 0 and status != 206:
                raise PeerError(f"peer {base} ignored the Range request for {path}")
            _check_range(head, length, start, end, base, path)
            got = 0
            if body:
                on_data(body[:length])
                got = min(len(body), length)
            if isinstance(stream, trio.SocketStream) and length - got > BULK:
                # Plain TCP bulk: a blocking socket in a worker thread, receiving into one reusable
                # buffer, as the reference receiver does. Through trio's non-blocking recv the same
                # loop ran about 20% slower (smaller reads, an event-loop pass per read).
                # abandon_on_cancel: a shutting-down agent does not wait for the transfer to end.
                got += await trio.to_thread.run_sync(_blocking_receive, stream.socket.fileno(), length - got,
                                                     on_data, base, path, patience, got,
                                                     abandon_on_cancel=True)
            else:  # small bodies, and everything over TLS
                floor = Floor(length - got, patience, trio.current_time)
                while floor.have < floor.want:
                    chunk = None
                    with trio.move_on_after(max(0.0, floor.left())):
                        chunk = await stream.receive_some(min(RECV, floor.want - floor.have))
                    if chunk is None:
                        raise _too_slow(floor, base, path, got)
                    if not chunk:
                        break
                    on_data(chunk)
                    floor.got(len(chunk))
                got += floor.have
            if got < length:
                raise PeerError(f"peer {base} closed the connection after {got} of {length} bytes of {path}",
                                resumable=True)
            return status
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise PeerError(f"connection to peer {base} broke during {path}: {exc}", resumable=True) from None


async def _ask(stream: trio.abc.Stream, request: bytes, base: str, path: str) -> tuple[ResponseHead, bytes]:
    """Send the request and read the answer's head: (head, the body bytes that came with it)."""
    await stream.send_all(request)
    buf = b""
    try:
        while (split := split_head(buf)) is None:
            chunk = await stream.receive_some(RECV)
            if not chunk:
                raise PeerError(f"peer {base} closed the connection before answering {path}", resumable=True)
            buf += chunk
    except HeadTooLarge:
        raise PeerError(f"peer {base} sent an oversized response head for {path}") from None
    except MalformedHead as exc:
        raise PeerError(f"peer {base} sent a {exc} for {path}") from None
    return split


def _check_range(head: ResponseHead, length: int, start: int | None, end: int | None, base: str, path: str) -> None:
    """A body of exactly the bytes asked for, and a 206 that says it holds them: a peer that answers
    more (which a receiver would write before any digest could refuse it) or other bytes is refused."""
    first = start or 0
    if end is not None and length != end - first + 1:
        raise PeerError(f"peer {base} answered {length:,} bytes for bytes {first:,}-{end:,} of {path} "
                        f"({end - first + 1:,} asked)", resumable=True, code="peer_bad_answer")
    if head.status == 206:
        said = head.headers.get("content-range", "")
        held = _CONTENT_RANGE.fullmatch(said)
        if held is None or int(held[1]) != first or int(held[2]) != first + length - 1:
            raise PeerError(f"peer {base} answered {said[:60]!r} ({length:,} bytes) of {path} for bytes "
                            f"{first:,}-{'' if end is None else f'{end:,}'}", resumable=True, code="peer_bad_answer")


_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/(?:[0-9]{1,19}|\*)")


async def get_bytes(base: str, path: str, secret: str, *, limit: int = 64 << 20,
                    ssl_context: ssl.SSLContext | None = None, server_hostname: str | None = None,
                    patience: float = PATIENCE) -> bytes:
    parts: list[bytes] = []
    size = 0

    def take(chunk: bytes | bytearray | memoryview) -> None:
        nonlocal size
        size += len(chunk)
        if size > limit:
            raise PeerError(f"peer {base} sent more than {limit} bytes for {path}")
        parts.append(bytes(chunk))  # the view is reused for the next read

    await get(base, path, secret, take, ssl_context=ssl_context, server_hostname=server_hostname, patience=patience)
    return b"".join(parts)


def _code(body: bytes) -> str | None:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return code if isinstance(code, str) else None


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return body[:200].decode("utf-8", "replace") or "(no body)"
