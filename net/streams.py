"""A server's client connections as byte streams: plain sockets on fleet's own fast path, or TLS
through trio.SSLStream with a certificate that SIGHUP can replace without a restart."""

from __future__ import annotations

import logging
import math
import socket
import ssl
from dataclasses import dataclass
from typing import Protocol

import trio

from net import sockio

log = logging.getLogger("fleet")


class ByteStream(Protocol):
    scheme: str
    sock: socket.socket  # the connection's own socket (the server's: never closed by an app)
    handshakes: bool  # whether start() has anything to do (a TLS handshake)

    async def start(self, timeout: float) -> None:
        """Whatever must happen before the first request (the TLS handshake); OSError if it fails."""

    async def receive(self, size: int) -> bytes:
        """Up to `size` bytes; b"" once the client has closed (or broken) its side."""

    def receive_now(self, size: int) -> bytes | None:
        """What `receive` would give without waiting: None when nothing is there yet (or the
        stream cannot tell without waiting). Not a checkpoint."""

    async def send(self, data: bytes, stall: float = math.inf) -> None:
        """All of `data`; OSError if the client is gone, trio.TooSlowError if it takes nothing for `stall` s."""

    def addresses(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """(client, server) addresses."""

    def end_send(self) -> None:
        """Nothing more will be sent (a FIN after the last answer, where the stream can say so)."""

    def close(self) -> None:
        """Close now, waking any task waiting on the connection."""


class PlainStream:
    scheme = "http"
    handshakes = False

    def __init__(self, sock: socket.socket, peer: tuple[str, int] | None = None,
                 local: tuple[str, int] | None = None) -> None:
        """`peer` and `local`: the addresses where the caller knows them already (accept gives the
        peer's; a listener bound to one address, every connection's own), else asked of the socket once."""
        self.sock = sock
        self._peer, self._local = peer, local

    async def start(self, timeout: float) -> None:
        pass

    async def receive(self, size: int) -> bytes:
        return await sockio.receive(self.sock, size)

    def receive_now(self, size: int) -> bytes | None:
        try:
            return self.sock.recv(size)
        except BlockingIOError:
            return None

    async def send(self, data: bytes, stall: float = math.inf) -> None:
        await sockio.send(self.sock, data, stall)

    def addresses(self) -> tuple[tuple[str, int], tuple[str, int]]:
        if self._peer is None:
            self._peer = tuple(self.sock.getpeername()[:2])
        if self._local is None:
            self._local = tuple(self.sock.getsockname()[:2])
        return self._peer, self._local

    def end_send(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the client is gone already

    def close(self) -> None:
        sockio.close(self.sock)


class TlsStream(PlainStream):
    """trio.SSLStream over the accepted socket; its errors are mapped to the plain stream's (a
    broken TLS stream is a client gone), so the front handles both alike."""

    scheme = "https"
    handshakes = True

    def __init__(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        super().__init__(sock)
        self.tls = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), context,
                                  server_side=True, https_compatible=True)

    async def start(self, timeout: float) -> None:
        try:
            with trio.fail_after(timeout):
                await self.tls.do_handshake()
        except trio.TooSlowError:
            raise TimeoutError(f"no TLS handshake within {timeout:g}s") from None
        except trio.BrokenResourceError as exc:
            raise ConnectionAbortedError(f"TLS handshake failed: {exc.__cause__ or exc}") from None

    async def receive(self, size: int) -> bytes:
        try:
            data = await self.tls.receive_some(size)
        except trio.BrokenResourceError:
            return b""
        return data if isinstance(data, bytes) else bytes(data)

    def receive_now(self, size: int) -> bytes | None:
        return None  # what the socket holds is not yet what the client sent

    async def send(self, data: bytes, stall: float = math.inf) -> None:
        try:
            with trio.fail_after(stall):
                await self.tls.send_all(data)
        except trio.BrokenResourceError as exc:
            raise ConnectionResetError(str(exc.__cause__ or exc)) from None

    def end_send(self) -> None:
        pass  # a FIN under TLS would be a truncation to the client: the close that follows ends it


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: str  # PEM: the certificate, then any intermediates
    key: str   # PEM: its private key


class ServerTls:
    """The server's TLS context, loaded from `files`; `reload` loads them again (on SIGHUP) and
    keeps the old context if the new files do not load, so a bad renewal never takes the port
    down. Connections already open keep the certificate they were started with."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.context = self.load()  # OSError or ssl.SSLError: the caller refuses to start

    def load(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.files.cert, self.files.key)
        context.set_alpn_protocols(["http/1.1"])
        return context

    def reload(self) -> bool:
        try:
            self.context = self.load()
        except (OSError, ssl.SSLError) as exc:
            log.error("TLS: %s or %s did not load (%s); still serving the previous certificate",
                      self.files.cert, self.files.key, exc)
            return False
        log.info("TLS: reloaded %s", self.files.cert)
        return True

    def wrap(self, sock: socket.socket) -> TlsStream:
        return TlsStream(sock, self.context)
