"""Non-blocking stdlib sockets driven by trio's public low-level waits: the relay's hot path.

trio's SocketStream makes every operation look blocking: a receive first tries the call (an
exception when nothing is there), then waits, then calls again, and a send that succeeded at once
still yields to the scheduler. At thousands of relayed chunks a second those extra rounds were
most of the router's CPU. Here a receive waits for readiness once and reads once, and a send that
the kernel takes whole returns at once; the receive's wait is the loop's checkpoint, so a relay
loop still yields (and can be cancelled) on every turn."""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import socket

import trio


async def receive(sock: socket.socket, size: int) -> bytes:
    """Wait until `sock` is readable, then read what is there (b"" at end of stream)."""
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            return sock.recv(size)
        except BlockingIOError:  # a spurious wake-up: wait again
            continue


async def send(sock: socket.socket, data: bytes, stall: float = math.inf) -> None:
    """Send all of `data`; waits only while the kernel's buffer is full, and raises
    trio.TooSlowError if it stays full for `stall` seconds. Raises OSError (BrokenPipeError,
    ConnectionResetError) when the peer is gone."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            with trio.fail_after(stall):  # a scope only on this slow path
                await trio.lowlevel.wait_writable(sock)
            continue
        view = view[sent:]


def prepare(sock: socket.socket) -> socket.socket:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a token is never held for the next
    return sock


async def connect(host: str, port: int) -> socket.socket:
    """A connected TCP socket to host:port, trying each address the name resolves to."""
    family = numeric_family(host)
    if family is not None:  # an address already: no resolver, no wrapper object (most agents are named so)
        sock = prepare(socket.socket(family, socket.SOCK_STREAM))
        try:
            code = sock.connect_ex((host, port))
            if code == errno.EINPROGRESS:
                await trio.lowlevel.wait_writable(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
            return sock
        except BaseException:
            close(sock)
            raise
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"{host} resolves to no address")
    for family, kind, proto, _, address in infos:
        sock = prepare(socket.socket(family, kind, proto))
        try:
            await trio.socket.from_stdlib_socket(sock).connect(address)
            return sock
        except OSError as exc:
            close(sock)
            error = exc
        except BaseException:
            close(sock)
            raise
    raise error


def numeric_family(host: str) -> socket.AddressFamily | None:
    """AF_INET or AF_INET6 for an IP address written as one; None for a name to resolve."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return family
        except OSError:
            continue
    return None


async def accept(listener: socket.socket) -> socket.socket:
    while True:
        await trio.lowlevel.wait_readable(listener)
        try:
            sock, _ = listener.accept()
        except BlockingIOError:  # another waiter took it
            continue
        return prepare(sock)


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for host:port (every address the host resolves to)."""
    sockets = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                   flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(1024)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # an int: or-ing the flags (enums) each call cost more than the call


def idle_open(sock: socket.socket) -> bool:
    """Whether an idle kept connection is still usable: nothing to read on it (a close, or bytes
    nobody asked for, mean it is not). Plain connections only: TLS may have records in flight."""
    try:
        sock.recv(1, _PEEK)
    except BlockingIOError:
        return True  # nothing there: open and quiet
    except OSError:
        pass
    return False


def close(sock: socket.socket) -> None:
    """Close, first waking any task trio has waiting on it (it gets ClosedResourceError)."""
    if sock.fileno() != -1:
        trio.lowlevel.notify_closing(sock)
        sock.close()


def bound_address(listener: socket.socket) -> tuple[str, int] | None:
    """The address every connection accepted on `listener` has, where it is bound to one; None
    for a wildcard (0.0.0.0, ::), where each connection has its own."""
    address = listener.getsockname()[:2]
    try:
        return None if ipaddress.ip_address(address[0].split("%")[0]).is_unspecified else address
    except ValueError:
        return None
