"""A blob answer's body on real sockets (agent/blobs.py). It lifts its connection's
TCP_NOTSENT_LOWAT while the body is sent: trio sets 16 KiB on every connection, which behind a
1 Gbit/s link cost the sender 2 CPU-s per GiB in event-loop wake-ups; the connection is found by its
two addresses and given its own value back after the body. A request that asks to close the
connection after the answer (as agent/peerhttp.py asks) gets its body with sendfile, the others in
ASGI messages: a real agent answers both byte for byte, and the second keeps its connection."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest

from agent.blobs import BULK_LOWAT, bulk_sending, connection_socket
from tests.agents import SECRET, Agent, free_port
from tests.fleets import import_model

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


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, str, bytes]]:
    """A real agent holding one blob of 8 MiB and a bit: (agent, its sha256, its bytes)."""
    base = tmp_path_factory.mktemp("blob-socket")
    data = b"GGUF" + os.urandom((8 << 20) + 4093)
    (base / "m.gguf").write_bytes(data)
    agent = Agent("node-s", "127.0.0.2", free_port("127.0.0.2"), base / "s").start()
    try:
        digest = import_model(agent, base / "m.gguf")
        sha = json.loads(agent.get(f"/v1/manifests/{digest}").content)["files"][0]["sha256"]
        yield agent, str(sha), data
    finally:
        agent.stop()


def ask(sock: socket.socket, agent: Agent, path: str, extra: str) -> tuple[bytes, bytes]:
    """One GET on an open connection: (the head, the body of its Content-Length)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {agent.address}\r\nAuthorization: Bearer {SECRET}\r\n"
                 f"{extra}\r\n".encode())
    got = b""
    while b"\r\n\r\n" not in got:
        more = sock.recv(65536)
        assert more, f"the connection closed before the head: {got!r}"
        got += more
    head, body = got.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        more = sock.recv(1 << 20)
        assert more, f"the connection closed after {len(body)} of {length} bytes"
        body += more
    return head, body


@pytest.mark.e2e
def test_a_body_by_sendfile_is_whole_and_ends_with_its_connection(served: tuple[Agent, str, bytes]) -> None:
    agent, sha, data = served
    with socket.create_connection((agent.address, agent.port), timeout=10) as sock:
        head, body = ask(sock, agent, f"/v1/blobs/{sha}", "Range: bytes=3-\r\nConnection: close\r\n")
        assert head.startswith(b"HTTP/1.1 206") and body == data[3:]
        assert sock.recv(1) == b""  # the connection ends with the answer


@pytest.mark.e2e
def test_a_body_on_a_kept_connection_is_whole_and_the_connection_serves_on(served: tuple[Agent, str, bytes]) -> None:
    agent, sha, data = served
    with socket.create_connection((agent.address, agent.port), timeout=10) as sock:
        head, body = ask(sock, agent, f"/v1/blobs/{sha}", "Range: bytes=0-\r\n")
        assert head.startswith(b"HTTP/1.1 206") and body == data
        head, body = ask(sock, agent, f"/v1/blobs/{sha}", "Range: bytes=5-9\r\n")
        assert head.startswith(b"HTTP/1.1 206") and body == data[5:10]
