"""A blob answer's body on real sockets (agent/transfer/blobs.py). It lifts its connection's
TCP_NOTSENT_LOWAT while the body is sent: trio sets 16 KiB on every connection, which behind a
1 Gbit/s link cost the sender 2 CPU-s per GiB in event-loop wake-ups; the connection's socket is the
server's own, handed over in the scope (net/server.py's SOCKET_EXTENSION: it was found by scanning
/proc/self/fd and duplicated), and is given its own value back after the body. A request that asks to close the
connection after the answer (as agent/transfer/peerhttp.py asks) gets its body with sendfile on that socket,
never through the server's messages, the others in ASGI messages: a real agent answers both byte for
byte, and the second keeps its connection. The sendfile path runs on the event loop, not in a worker
thread: a peer that stops reading is cut, and fifty of them do not stop the agent's other work; a file
being fetched goes the same way as its pieces are verified, and its answer is cut where they end."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
from starlette.types import Message

from agent.transfer.blobs import BULK_LOWAT, bulk_sending, connection_socket, send_direct, send_range
from agent.transfer.forward import Partial, PartialBlobResponse, UpstreamEnded
from tests.agents import SECRET, Agent, free_port
from tests.fleets import import_model
from net.server import SOCKET_EXTENSION
from tests.models import random_gguf
from wire.floor import FLOOR_BYTES

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


def handed(sock: socket.socket) -> dict[str, object]:
    """The scope's extensions as net's server sets them: the connection's own socket."""
    return {SOCKET_EXTENSION: {"socket": sock}}


def test_the_connection_from_the_server_is_given_its_value_back(connection: tuple[socket.socket, socket.socket]) -> None:
    server, client = connection
    scope = {"type": "http", "extensions": handed(server)}
    with bulk_sending(scope):
        assert lowat(server) == BULK_LOWAT
        assert lowat(client) != BULK_LOWAT  # the other end, in this same process, is left alone
    assert lowat(server) == TRIO_LOWAT
    assert server.fileno() != -1  # the server's socket: never closed by the answer


def test_a_scope_without_the_socket_leaves_every_socket_alone(connection: tuple[socket.socket, socket.socket]) -> None:
    server, client = connection
    # The addresses alone are not enough any more: no descriptor is searched for.
    bare = {"type": "http", "server": server.getsockname(), "client": server.getpeername()}
    assert connection_socket(bare) is None
    assert connection_socket({"type": "http", "extensions": {SOCKET_EXTENSION: {"socket": None}}}) is None
    with bulk_sending(bare):
        assert lowat(server) == TRIO_LOWAT


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, str, bytes, str]]:
    """A real agent holding one blob of 8 MiB and a bit: (agent, its sha256, its bytes, its model's digest)."""
    base = tmp_path_factory.mktemp("blob-socket")
    data = random_gguf((8 << 20) + 4097)
    (base / "m.gguf").write_bytes(data)
    agent = Agent("node-s", "127.0.0.2", free_port("127.0.0.2"), base / "s").start()
    try:
        digest = import_model(agent, base / "m.gguf")
        sha = json.loads(agent.get(f"/v1/manifests/{digest}").content)["files"][0]["sha256"]
        yield agent, str(sha), data, digest
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
def test_a_body_by_sendfile_is_whole_and_ends_with_its_connection(served: tuple[Agent, str, bytes, str]) -> None:
    agent, sha, data, _ = served
    with socket.create_connection((agent.address, agent.port), timeout=10) as sock:
        head, body = ask(sock, agent, f"/v1/blobs/{sha}", "Range: bytes=3-\r\nConnection: close\r\n")
        assert head.startswith(b"HTTP/1.1 206") and body == data[3:]
        assert sock.recv(1) == b""  # the connection ends with the answer


@pytest.mark.e2e
def test_a_body_asked_on_a_kept_connection_says_it_closes_it_and_is_whole(
        served: tuple[Agent, str, bytes, str]) -> None:
    # Every plain HTTP/1.x blob answer goes by sendfile, held to the slow-reader floor: through ASGI
    # messages a keep-alive reader that read nothing held a 4 MiB chunk in a send nothing timed out.
    agent, sha, data, _ = served
    with socket.create_connection((agent.address, agent.port), timeout=10) as sock:
        head, body = ask(sock, agent, f"/v1/blobs/{sha}", "Range: bytes=0-\r\n")
        assert head.startswith(b"HTTP/1.1 206") and body == data
        assert b"\r\nconnection: close" in head.lower()
        assert sock.recv(1) == b""  # the connection ends with the answer


@pytest.fixture
def blob(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    """(an open descriptor, its bytes): 24 MiB and a bit, more than loopback's buffers hold."""
    data = os.urandom((24 << 20) + 4093)
    (tmp_path / "b").write_bytes(data)
    fd = os.open(tmp_path / "b", os.O_RDONLY)
    try:
        yield fd, data
    finally:
        os.close(fd)


def closing_scope(server: socket.socket) -> dict[str, object]:
    return {"type": "http", "scheme": "http", "http_version": "1.1", "headers": [(b"connection", b"close")],
            "server": server.getsockname(), "client": server.getpeername(), "extensions": handed(server)}


def only_the_head_and_the_end(messages: list[Message], whole: bool) -> bool:
    """What a direct answer hands the server: an empty body message that sends the head, and once
    the body went whole on the socket, an empty last one (a cut answer ends unfinished)."""
    ends = [m.get("more_body", False) is False for m in messages]
    return (all(m["type"] == "http.response.body" and m.get("body", b"") == b"" for m in messages)
            and ends == ([False, True] if whole else [False]))


def the_server_closes(sock: socket.socket) -> None:
    """What net's server does once an answer that said connection: close has ended."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def read_to_end(sock: socket.socket, into: bytearray, pause_s: float = 0.0, size: int = 1 << 20) -> None:
    sock.settimeout(30)
    while more := sock.recv(size):
        into += more
        time.sleep(pause_s)


@pytest.mark.parametrize("headers", [[(b"connection", b"close")], []], ids=["closing", "kept-alive"])
def test_a_plain_http_body_goes_by_sendfile_on_its_socket_not_through_the_server(
        connection: tuple[socket.socket, socket.socket], blob: tuple[int, bytes],
        headers: list[tuple[bytes, bytes]]) -> None:
    # A request that keeps its connection alive too: its answer said connection: close (answer_headers).
    server, client = connection
    server.setblocking(False)  # as the server's own socket is
    fd, data = blob
    messages: list[Message] = []

    async def record(message: Message) -> None:
        messages.append(message)

    got = bytearray()
    reader = threading.Thread(target=read_to_end, args=(client, got))
    reader.start()
    trio.run(send_range, {**closing_scope(server), "headers": headers}, record, fd, 7, len(data) - 7)
    the_server_closes(server)
    reader.join(30)
    assert only_the_head_and_the_end(messages, whole=True)  # the server saw no body: it went on the socket itself
    assert bytes(got) == data[7:]  # whole, and the connection ended with it (read_to_end returned)


def test_a_reader_too_slow_for_a_body_in_asgi_messages_is_cut_by_the_watchdog(
        connection: tuple[socket.socket, socket.socket], blob: tuple[int, bytes],
        caplog: pytest.LogCaptureFixture) -> None:
    # TLS bodies go through the server, whose send may be shielded (hypercorn's was): a peer that
    # stops reading held it, and the chunk, for ever. The watchdog hangs the connection up under it.
    server, client = connection
    fd, data = blob
    scope = {**closing_scope(server), "scheme": "https", "path": "/v1/blobs/" + "cd" * 32}
    sent: list[int] = []
    sizes: list[int] = []

    async def main() -> None:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(server))

        async def shielded_send(message: Message) -> None:  # as hypercorn's: a broken connection ends it quietly
            sizes.append(len(message.get("body", b"")))
            with trio.CancelScope(shield=True):
                try:
                    await stream.send_all(message.get("body", b""))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

        with trio.fail_after(20):
            await send_range(scope, shielded_send, fd, 0, len(data), sending=sent.append, idle_s=0.3)

    with caplog.at_level(logging.WARNING, logger="fleet-agent"):
        trio.run(main)
    assert sum(sent) < len(data)  # cut: the rest was never read from the file or handed on
    assert max(sizes) <= FLOOR_BYTES  # a message's deadline is the floor's own: 1 MiB in idle_s
    (line,) = [r.getMessage() for r in caplog.records if "blob_reader_too_slow" in r.getMessage()]
    assert "cd" * 32 in line and "took under" in line
    got = bytearray()
    read_to_end(client, got)  # what the buffers held, then the end of the connection
    assert 0 < len(got) < len(data)


def test_a_peer_that_reads_nothing_is_cut_after_the_idle_time(
        connection: tuple[socket.socket, socket.socket], blob: tuple[int, bytes],
        caplog: pytest.LogCaptureFixture) -> None:
    server, client = connection
    server.setblocking(False)
    fd, data = blob
    counted: list[int] = []
    scope = {**closing_scope(server), "path": "/v1/blobs/" + "ab" * 32}
    messages: list[Message] = []

    async def main() -> None:
        with trio.fail_after(10):
            await send_range(scope, record, fd, 0, len(data), sending=counted.append, idle_s=0.3)

    async def record(message: Message) -> None:
        messages.append(message)

    with caplog.at_level(logging.WARNING, logger="fleet-agent"):
        trio.run(main)
    assert only_the_head_and_the_end(messages, whole=False)
    got = bytearray()
    read_to_end(client, got)
    assert 0 < len(got) < len(data)  # what the buffers held, then the end of the connection
    # Counted as the socket took them (they were counted whole before being sent), and the cut is
    # logged with its code, the peer and the blob: the peer itself only sees its connection end.
    assert sum(counted) == len(got)
    (line,) = [r.getMessage() for r in caplog.records if "blob_reader_too_slow" in r.getMessage()]
    host, port = client.getsockname()[:2]
    assert f"{host}:{port}" in line and "ab" * 32 in line and "took under" in line


def test_a_file_that_shrinks_while_served_ends_the_answer_and_is_logged_with_a_code(
        connection: tuple[socket.socket, socket.socket], blob: tuple[int, bytes],
        caplog: pytest.LogCaptureFixture) -> None:
    server, client = connection
    server.setblocking(False)
    fd, data = blob
    scope = {**closing_scope(server), "path": "/v1/blobs/" + "cd" * 32}
    got = bytearray()
    reader = threading.Thread(target=read_to_end, args=(client, got))
    reader.start()

    messages: list[Message] = []

    async def record(message: Message) -> None:
        messages.append(message)

    with caplog.at_level(logging.WARNING, logger="fleet-agent"):
        trio.run(send_range, scope, record, fd, 0, len(data) + 4096)  # the head promised more
    reader.join(30)
    assert only_the_head_and_the_end(messages, whole=False)
    assert bytes(got) == data  # what the file held, then the end of the connection
    (line,) = [r.getMessage() for r in caplog.records if "blob_shrank" in r.getMessage()]
    assert "cd" * 32 in line and "shrank" in line


def test_a_peer_that_trickles_is_cut_though_it_reads_something_in_every_idle_time(
        connection: tuple[socket.socket, socket.socket], blob: tuple[int, bytes]) -> None:
    server, client = connection
    server.setblocking(False)
    fd, data = blob
    got = bytearray()
    reader = threading.Thread(target=read_to_end, args=(client, got, 0.05, 16 << 10))  # 320 KiB/s
    reader.start()

    async def main() -> None:
        with trio.fail_after(20):  # the whole file at this pace would take over a minute
            await send_direct(server, fd, 0, len(data), idle_s=0.5)

    try:
        with pytest.raises(TimeoutError, match="took under"):
            trio.run(main)
    finally:
        server.shutdown(socket.SHUT_RDWR)
        reader.join(30)
    assert len(got) < len(data)


async def fetched(partial: Partial, data: bytes, upto: int) -> None:
    """The fetch feeding `partial`: a MiB at a time, each published as verified, then silence after `upto`."""
    with open(partial.path, "r+b") as fh:
        for at in range(0, upto, 1 << 20):
            await trio.sleep(0.01)
            fh.write(data[at:min(upto, at + (1 << 20))])
            fh.flush()
            partial.verified = min(upto, at + (1 << 20))


def forward(connection: tuple[socket.socket, socket.socket], tmp_path: Path, data: bytes,
            upto: int) -> tuple[list[str], bytes, UpstreamEnded | None]:
    """A whole-file answer over a file being fetched, on the direct path: (the messages the server
    was handed, the bytes the client received before the connection ended, why it was cut)."""
    server, client = connection
    server.setblocking(False)
    (tmp_path / "part").write_bytes(b"")
    partial = Partial(tmp_path / "part", len(data), progress=lambda: partial.verified)
    messages: list[str] = []
    got = bytearray()
    cut: list[UpstreamEnded] = []
    reader = threading.Thread(target=read_to_end, args=(client, got))
    reader.start()

    async def record(message: Message) -> None:
        messages.append(message["type"])

    asked = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> Message:  # as a server's: the GET's empty body, then nothing until a hang-up
        if asked:
            return asked.pop()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetched, partial, data, upto)
            try:
                with trio.fail_after(10):
                    await PartialBlobResponse(partial, None, stall_s=0.3)(
                        {**closing_scope(server), "method": "GET"}, receive, record)
            except UpstreamEnded as exc:
                cut.append(exc)

    try:
        trio.run(main)
    finally:
        the_server_closes(server)
        reader.join(30)
    return messages, bytes(got), cut[0] if cut else None


def test_a_file_being_fetched_goes_by_sendfile_as_its_pieces_are_verified(
        connection: tuple[socket.socket, socket.socket], tmp_path: Path) -> None:
    data = os.urandom((6 << 20) + 5)
    messages, got, cut = forward(connection, tmp_path, data, len(data))
    assert messages == ["http.response.start", "http.response.body", "http.response.body"]  # the head, the end
    assert cut is None and got == data


def test_a_fetch_that_stalls_cuts_the_forwarded_answer_where_its_verified_bytes_end(
        connection: tuple[socket.socket, socket.socket], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(6 << 20)
    with caplog.at_level(logging.WARNING, logger="fleet-agent"):
        messages, got, cut = forward(connection, tmp_path, data, 3 << 20)
    # Logged with a code and the peer, not raised into the server (which logged a traceback).
    assert cut is None
    (line,) = [r.getMessage() for r in caplog.records if "[blob_source_ended]" in r.getMessage()]
    host, port = connection[1].getsockname()[:2]
    assert "received nothing" in line and f"{host}:{port}" in line
    assert messages == ["http.response.start", "http.response.body"]  # the head; cut, the answer never ends
    assert got == data[:3 << 20]  # the downstream resumes from there


@pytest.mark.e2e
def test_stalled_blob_readers_do_not_stop_the_agent_s_other_work(served: tuple[Agent, str, bytes, str]) -> None:
    """More stalled peers than trio has worker threads (40): an on-demand verify, which runs in one,
    still answers at once (it waited for the first sendfile's 60 s while they were threads)."""
    agent, sha, _, digest = served
    stalled = []
    try:
        for _ in range(48):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((agent.address, agent.port))
            sock.sendall(f"GET /v1/blobs/{sha} HTTP/1.1\r\nHost: {agent.address}\r\nAuthorization: Bearer {SECRET}\r\n"
                         "Connection: close\r\n\r\n".encode())
            stalled.append(sock)
        time.sleep(1)
        answer = httpx.post(f"{agent.url}/v1/weights/{digest}/verify", headers={"Authorization": f"Bearer {SECRET}"},
                            timeout=10)
        assert answer.status_code == 200, answer.text
    finally:
        for sock in stalled:
            sock.close()
