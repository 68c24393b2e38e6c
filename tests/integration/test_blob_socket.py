"""A blob answer lifts its connection's TCP_NOTSENT_LOWAT while its body is sent (agent/blobs.py),
on real TCP sockets: trio sets 16 KiB on every connection, which behind a 1 Gbit/s link cost the
sender 2 CPU-s per GiB in event-loop wake-ups; the connection is found by its two addresses and
given its own value back after the body."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from agent.blobs import BULK_LOWAT, bulk_sending, connection_socket

TRIO_LOWAT = 1 << 14

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="no TCP_NOTSENT_LOWAT here")


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the server's end, the client's end) of a loopback connection, the server's end set as trio sets it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, TRIO_LOWAT)
    with server, client:
        yield server, client


def lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)


def test_the_connection_is_found_by_its_addresses_and_given_its_value_back(
        connection: tuple[socket.socket, socket.socket]) -> None:
    server, client = connection
    scope = {"type": "http", "server": server.getsockname(), "client": server.getpeername()}
    with bulk_sending(scope):
        assert lowat(server) == BULK_LOWAT
        assert lowat(client) != BULK_LOWAT  # the other end, in this same process, is left alone
    assert lowat(server) == TRIO_LOWAT


def test_a_connection_not_found_leaves_every_socket_alone(connection: tuple[socket.socket, socket.socket]) -> None:
    server, client = connection
    gone = {"type": "http", "server": server.getsockname(), "client": ("127.0.0.1", 1)}
    assert connection_socket(gone) is None
    assert connection_socket({"type": "http", "server": None, "client": None}) is None
    with bulk_sending(gone):
        assert lowat(server) == TRIO_LOWAT
