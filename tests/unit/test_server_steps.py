"""net/server.py's path for a connection whose request is there when it is accepted (every
connection of a fan-out, and of the scale benches' simulated agents), on real loopback sockets:
answered whole and in order, with no trip through trio's epoll to accept connections already
waiting nor to read a request already in the socket. Counted with a trio instrument: the steps
each server task takes. Also: the addresses in the scope, taken from accept and from a listener
bound to one address instead of asked of each socket, are the connection's own."""

from __future__ import annotations

import socket
from collections import Counter
from typing import Any

import trio
import trio.lowlevel
from starlette.types import Receive, Scope, Send

from net.server import Server

SEEN: list[dict[str, Any]] = []


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers /304 with a bare 304, anything else with its path as the body; never waits."""
    SEEN.append(scope)
    await receive()
    if scope["path"] == "/304":
        await send({"type": "http.response.start", "status": 304, "headers": [(b"etag", b'"g"')]})
        await send({"type": "http.response.body", "body": b""})
        return
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


class Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps: Counter[str] = Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name.rsplit(".", 1)[-1]] += 1


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while more := sock.recv(65536):
        data += more
    return data


def serve_for(server: Server, listening: socket.socket, seconds: float) -> Steps:
    """Serve on `listening` for `seconds`, counting each task's steps."""
    steps = Steps()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, [listening], trio.Event())
            await trio.sleep(seconds)
            nursery.cancel_scope.cancel()

    trio.run(main, instruments=[steps])
    return steps


def test_waiting_connections_and_their_requests_are_served_without_waiting() -> None:
    SEEN.clear()
    server = Server(app, cap=16)
    [listening] = server.listen("127.0.0.1", 0)
    port = listening.getsockname()[1]
    clients = []
    for path in ["/a", "/304", "/b"]:  # connected and sent before the server runs
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        clients.append(client)
    steps = serve_for(server, listening, 0.2)
    answers = [read_all(c) for c in clients]
    assert answers[0] == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n/a"
    assert answers[1] == b'HTTP/1.1 304 Not Modified\r\netag: "g"\r\nconnection: close\r\n\r\n'
    assert answers[2].endswith(b"\r\n\r\n/b")
    # each connection answered in the one step it was started in; the accepting task took all
    # three in its first step, then waited once (and was woken once more, by the cancel)
    assert steps.steps["connection"] == 3 and steps.steps["_accept"] == 2, steps.steps
    assert sorted(s["client"] for s in SEEN) == sorted(c.getsockname()[:2] for c in clients)  # in trio's order
    assert all(s["server"] == ("127.0.0.1", port) for s in SEEN)
    for c in clients:
        c.close()


def test_on_a_wildcard_listener_each_connection_has_its_own_address() -> None:
    """Bound to 0.0.0.0, a connection's address is asked of its socket: here 127.0.0.2, where a
    client connected to."""
    SEEN.clear()
    server = Server(app, cap=16)
    [listening] = server.listen("0.0.0.0", 0)
    port = listening.getsockname()[1]
    client = socket.create_connection(("127.0.0.2", port))
    client.sendall(b"GET /w HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, [listening], trio.Event())
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert read_all(client).endswith(b"/w")
    assert SEEN[0]["server"] == ("127.0.0.2", port) and SEEN[0]["client"] == client.getsockname()[:2]
    client.close()


def test_a_burst_of_strangers_past_the_cap_gives_places_to_each_other_not_a_trusted_idle_connection() -> None:
    """Cap 8, three connections kept alive after proving their client, then 20 strangers' requests
    arriving together (accepted in one row): before any of the row's tasks runs, none of them is
    waiting, so the sixth to eighth took the trusted connections' places and the ninth on were
    refused 503 (fails before). As before the row, the strangers give their places to each other:
    every one is answered 200 and the trusted connections keep theirs."""
    server = Server(app, cap=8, trusts=lambda scope: (b"x-secret", b"s") in scope["headers"])
    [listening] = server.listen("127.0.0.1", 0)
    port = listening.getsockname()[1]
    trusted = []
    for _ in range(3):
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(b"GET /t HTTP/1.1\r\nHost: x\r\nx-secret: s\r\n\r\n")
        trusted.append(client)
    strangers: list[socket.socket] = []
    held: dict[str, int] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, [listening], trio.Event())
            await trio.sleep(0.2)
            assert len(server.known) == 3
            for _ in range(20):  # no checkpoint: all 20 are in the backlog when the server next runs
                client = socket.create_connection(("127.0.0.1", port))
                client.sendall(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
                strangers.append(client)
            await trio.sleep(0.3)
            held.update(known=len(server.known), refused=server.refused, evicted=server.evicted)
            nursery.cancel_scope.cancel()

    trio.run(main)
    answers = [read_all(c) for c in strangers]
    assert held == {"known": 3, "refused": 0, "evicted": 15}, held
    assert all(a.startswith(b"HTTP/1.1 200 OK") and a.endswith(b"/s") for a in answers), answers
    for c in trusted + strangers:
        c.close()


def test_pipelined_requests_are_answered_a_step_each() -> None:
    """200 small requests pipelined in one write are read at once: each is answered in a step of
    its own (a checkpoint between them), so that a stranger pipelining without end cannot hold
    the thread for a whole read's worth of answers (a step for all of them, before)."""
    SEEN.clear()
    server = Server(app, cap=16)
    [listening] = server.listen("127.0.0.1", 0)
    port = listening.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n" * 199 + b"GET /p HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    steps = serve_for(server, listening, 0.3)
    assert read_all(client).count(b"HTTP/1.1 200 OK") == 200
    assert steps.steps["connection"] >= 200, steps.steps
    client.close()
