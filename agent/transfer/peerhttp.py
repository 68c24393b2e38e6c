"""A bulk HTTP/1.1 GET between agents, through net/client.py's bulk mode (`Response.into`).

httpx's streaming body reader moves about 120-130 MB/s on this kind of machine, slower than the
disk and the hash (docs/ARCHITECTURE.md); reading the socket directly into the hasher and the file
is the fewest steps that still verify and store. What is this module's own: the request (a
secret, a Range), what our agents' answers must be (one request per connection, a Content-Length
body of exactly the bytes asked for), the patience on every wait, and each failure classed as
resumable or final (PeerError)."""

from __future__ import annotations

import json
import math
import re
import ssl
from typing import Callable
from urllib.parse import urlsplit

import trio

from net import client
from net.http1 import MAX_HEAD, HeadTooLarge, MalformedHead
from net.tls import client_context
from wire.floor import FLOOR_S, pace

BULK = client.BULK  # bodies larger than this are received in a worker thread (over plain TCP)
PATIENCE = FLOOR_S  # the connection, the answer's head, and each floor's worth of its body (wire/floor.py)


def _too_slow(exc: client.Stalled, base: str, path: str) -> PeerError:
    """The fetch gives up on a body under the floor (what came with the answer's head counts in it)."""
    floor, before = exc.floor, exc.before
    return PeerError(f"peer {base} sent {pace(floor.patience)} of {path} "
                     f"({before + floor.have:,} of {before + floor.want:,} bytes so far)",
                     resumable=True, code="peer_too_slow")


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
                   server_hostname: str | None = None) -> client.Connection:
    parts = urlsplit(base)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    # Over TLS, as the control plane checks an agent (reconciler/agents/transport.py): the
    # certificate against the name the peer goes by in fleet.yaml (sent as SNI too); its address is
    # only where to connect.
    tls = (ssl_context or client_context()) if parts.scheme == "https" else None
    try:
        return await client.connect(host, port, tls=tls, server_hostname=server_hostname, timeout=math.inf)
    except client.TlsFailed as exc:
        refused = _tls_error(exc.__cause__)
        if refused is None:  # the connection broke, not the trust: worth asking again
            raise PeerError(f"connection to peer {base} broke during the TLS handshake: {exc.__cause__}",
                            resumable=True) from None
        why = (f"certificate verify failed: {refused.verify_message}"
               if isinstance(refused, ssl.SSLCertVerificationError) else str(refused))
        # Final: asking again meets the same certificate.
        raise PeerError(f"TLS with peer {base} (checked as {server_hostname or host!r}) failed: {why}",
                        code="peer_tls_failed") from None
    except client.ClientError as exc:
        cause = exc.__cause__
        reason = cause.strerror or cause if isinstance(cause, OSError) else exc
        raise PeerError(f"cannot connect to peer {base}: {reason}", resumable=True) from None


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
    conn = None
    with trio.move_on_after(patience):
        conn = await _connect(base, ssl_context, server_hostname)
    if conn is None:
        raise PeerError(f"peer {base} did not take a connection for {path} within {patience:g} s",
                        resumable=True, code="peer_too_slow")
    headers = [("Authorization", f"Bearer {secret}")]
    if start is not None:
        headers.append(("Range", f"bytes={start}-{'' if end is None else end}"))
    headers.append(("User-Agent", "fleet-agent"))
    response = None
    try:
        with trio.move_on_after(patience):
            response = await client.send(conn, "GET", path, headers=headers, peer=f"peer {base}")
        if response is None:
            raise PeerError(f"peer {base} sent no whole answer head for {path} within {patience:g} s",
                            resumable=True, code="peer_too_slow")
        length, status = response.length, response.status
        if length is None:
            raise PeerError(f"peer {base} sent no Content-Length for {path}")
        if status not in (200, 206):
            body = b""
            with trio.move_on_after(patience):  # the error's text, if it comes: a bounded wait
                while len(body) < min(length, MAX_HEAD) and (piece := await response.read()):
                    body += piece
            raise PeerError(f"peer {base} answered {status} for {path}: {_message(body)}", status=status,
                            resumable=status >= 500, answer_code=_code(body))
        if start is not None and start > 0 and status != 206:
            raise PeerError(f"peer {base} ignored the Range request for {path}")
        _check_range(status, response.headers, length, start, end, base, path)
        got = await response.into(on_data, patience=patience)
        if got < length:
            raise PeerError(f"peer {base} closed the connection after {got} of {length} bytes of {path}",
                            resumable=True)
        return status
    except client.Stalled as exc:
        raise _too_slow(exc, base, path) from None
    except client.ClientError as exc:
        raise _failed(exc, base, path) from None
    finally:
        conn.close()


def _failed(exc: client.ClientError, base: str, path: str) -> PeerError:
    """What a failed exchange means for the fetch: a connection that broke or closed is resumable; a
    head the client could not use is final."""
    cause = exc.__cause__
    if isinstance(exc, client.Closed):
        return PeerError(f"peer {base} closed the connection before answering {path}", resumable=True)
    if isinstance(cause, HeadTooLarge):
        return PeerError(f"peer {base} sent an oversized response head for {path}")
    if isinstance(cause, MalformedHead):
        return PeerError(f"peer {base} sent {cause} for {path}")
    if isinstance(cause, (OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
        return PeerError(f"connection to peer {base} broke during {path}: {cause}", resumable=True)
    return PeerError(f"{exc} for {path}")


def _check_range(status: int, headers: dict[str, str], length: int, start: int | None, end: int | None, base: str,
                 path: str) -> None:
    """A body of exactly the bytes asked for, and a 206 that says it holds them: a peer that answers
    more (which a receiver would write before any digest could refuse it) or other bytes is refused."""
    first = start or 0
    if end is not None and length != end - first + 1:
        raise PeerError(f"peer {base} answered {length:,} bytes for bytes {first:,}-{end:,} of {path} "
                        f"({end - first + 1:,} asked)", resumable=True, code="peer_bad_answer")
    if status == 206:
        said = headers.get("content-range", "")
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
