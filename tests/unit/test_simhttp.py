"""agent/simulation/simhttp.py, the simulated agents' HTTP server, on real loopback sockets: answers whole and
in order, and no trip through trio's epoll for a request already in the socket when its
connection is accepted (every connection of a scale bench's agents), nor to accept connections
already waiting. Counted with a trio instrument: the steps each server task takes."""

from __future__ import annotations

import socket
from collections import Counter

import trio
import trio.lowlevel
from starlette.types import Receive, Scope, Send

from agent.simulation import simhttp


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers /304 with a bare 304, anything else with its path as the body; never waits."""
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


def test_waiting_connections_and_their_requests_are_served_without_waiting() -> None:
    listening = simhttp.listener("127.0.0.1", 0)
    port = listening.getsockname()[1]
    clients = []
    for path in ["/a", "/304", "/b"]:  # connected and sent before the server runs
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        clients.append(client)
    steps = Steps()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(simhttp.serve, app, [listening])
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main, instruments=[steps])
    answers = [read_all(c) for c in clients]
    assert answers[0] == b"HTTP/1.1 200 X\r\ncontent-length: 2\r\nconnection: close\r\n\r\n/a"
    assert answers[1] == b'HTTP/1.1 304 X\r\netag: "g"\r\nconnection: close\r\n\r\n'
    assert answers[2].endswith(b"\r\n\r\n/b")
    # each connection answered in the one step it was started in; the accepting task took all
    # three in its first step, then waited once (and was woken once more, by the cancel)
    assert steps.steps["_connection"] == 3 and steps.steps["_accept"] == 2, steps.steps
    for c in clients:
        c.close()
