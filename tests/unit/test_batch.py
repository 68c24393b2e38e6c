"""reconciler/agents/batch.py: the one-epoll fan-out of one-shot GETs. Its reader (transport.AgentAnswer,
llhttp) agrees with transport.read_response (a quiet beat's 304 recognised whole, the rest through the
same reader) on every answer at every cut; on loopback, stand-in agents that answer, stay silent, refuse, or
answer 304 get each its own result, in order, never more connections at once than allowed, and a
cancelled batch ends its thread and its connections."""

from __future__ import annotations

import functools
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from reconciler.agents.errors import AgentProtocolError, NodeUnreachable
from reconciler.agents.batch import TimedOut, batchable, exchange_all
from reconciler.core.desired import NodeSpec
from reconciler.agents.transport import AgentAnswer, AgentRequest, read_response

NODE = NodeSpec(name="n", address="127.0.0.1", agent_port=1)
LIVE = b'["2026-11-30T12:00:00+02:00",1,2,[3],[]]'

ANSWERS = [
    b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-type: application/json\r\n\r\n{"a": true}',
    b'HTTP/1.1 304 Not Modified\r\netag: "g"\r\nfleet-live: ' + LIVE + b"\r\n\r\n",
    b'HTTP/1.1 304 Not Modified\r\netag: "g"\r\n\r\n',
    b"HTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n\r\nto the end",  # no length: the body ends with the connection
    b"HTTP/1.1 200 OK\r\ncontent-length: 20\r\n\r\nshort",  # cut short
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2x\r\n\r\n",
    b"NONSENSE\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-le",  # closed before the head ended
    # What comes after an answer is no part of it, nor another answer:
    b'HTTP/1.1 500 Internal Server Error\r\ncontent-length: 7\r\n\r\n{"e":1}HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok',
    b'HTTP/1.1 304 Not Modified\r\nfleet-live: ' + LIVE + b'\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok',
    b'HTTP/1.1 304 Not Modified\r\nfleet-live: ' + LIVE + b'\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n',
    # A 304 the quiet beat's shortcut does not take, read by llhttp whole as at every cut:
    b'HTTP/1.1 304 Not Modified\r\nfleet-live: ' + LIVE + b'\r\nfleet-live: ["x",0,0,[],[]]\r\n\r\n',
    b'HTTP/1.1 304 Not Modified\r\nfleet-live: ' + LIVE + b'\r\nConnection:close\r\n\r\n',
    b'HTTP/1.1 304 Not Modified\r\nfleet-live: ' + LIVE + b'\r\nconnection: keep-alive, close\r\n\r\n',
    b'HTTP/1.1 304 Not Modified\r\nfleet-live: ' + LIVE + b'\r\nno colon here\r\n\r\n',
    b'HTTP/1.1 304 Not Modified\r\nfleet-live: ' + LIVE + b'\r\n folded\r\n\r\n',
    b'HTTP/1.1 304 Not Modified\nfleet-live: ' + LIVE + b'\n\n',
    b'HTTP/1.1 304 Not Modified\r\ncontent-length: 1\r\ncontent-length: 2\r\nfleet-live: ' + LIVE + b'\r\n\r\n',
    b'HTTP/1.1 304 Not Modified\r\nfleet-live:  ' + LIVE + b'  \r\n\r\n',
]


def through_reader(data: bytes, cut: int) -> Any:
    """The reader fed `data` in two pieces cut at `cut`, then the connection's end."""
    reader = AgentAnswer(NODE)
    try:
        for piece in [p for p in (data[:cut], data[cut:]) if p] + [b""]:
            answer = reader.take(piece)
            if answer is not None:
                return answer
        return None
    except (NodeUnreachable, AgentProtocolError) as exc:
        return type(exc), exc.message


def through_read_response(data: bytes) -> Any:
    async def go() -> Any:
        at = 0

        async def receive(n: int) -> bytes:
            nonlocal at
            out = data[at:at + n]
            at += len(out)
            return out
        try:
            return await read_response(NODE, receive)
        except (NodeUnreachable, AgentProtocolError) as exc:
            return type(exc), exc.message
    return trio.run(go)


@pytest.mark.parametrize("data", ANSWERS, ids=range(len(ANSWERS)))
def test_the_reader_reads_as_read_response_does_at_every_cut(data: bytes) -> None:
    """The same status and body (or error) at every cut; whether the connection may be kept too,
    where the reader had every byte read_response had (bytes after an answer that come in a later
    read are found by the next call's idle check, sockio.idle_open)."""
    expected = through_read_response(data)
    for cut in range(1, len(data) + 1):
        got, want = through_reader(data, cut), expected
        if cut < len(data) and len(got) == len(want) == 3:  # an answer (an error is a pair): its status and body
            got, want = got[:2], want[:2]
        assert got == want, cut
    if data.startswith(b"HTTP/1.1 304 Not Modified\r\n") and b"fleet-live" in data and b"Continue" not in data:
        assert expected[:2] in ((304, LIVE), (304, b'["x",0,0,[],[]]')) or expected[0] is AgentProtocolError, expected


def test_only_plain_agents_at_an_address_are_batched() -> None:
    assert batchable(NODE) and batchable(NodeSpec(name="n", address="::1"))
    assert not batchable(NodeSpec(name="n", address="node-a.example"))
    assert not batchable(NodeSpec(name="n", address="127.0.0.1", tls=True))


async def read_head(stream: trio.SocketStream) -> bytes | None:
    """A stand-in agent's read of one request: its head and what came with it (None: the client left)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        more = await stream.receive_some(65536)
        if not more:
            return None
        buf += more
    return buf


async def stand_in(stream: trio.SocketStream, *, answer: bytes | None, live: list[int], most: list[int]) -> None:
    """Reads a request head and answers it (None: stays silent); counts connections open at once."""
    live[0] += 1
    most[0] = max(most[0], live[0])
    try:
        if (buf := await read_head(stream)) is None:
            return
        await trio.sleep(0.01)  # so that connections overlap
        if answer is None:  # silent until the client goes
            while await stream.receive_some(65536):
                pass
            return
        await stream.send_all(answer.replace(b"GENERATION", b"1" if b"if-none-match" in buf.lower() else b"0"))
    finally:
        live[0] -= 1
        await stream.aclose()


def test_each_request_gets_its_own_result_in_order_within_the_bound() -> None:
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    closed_port = refused.getsockname()[1]
    refused.close()  # nothing listens there now

    async def main() -> None:
        live, most = [0], [0]
        async with trio.open_nursery() as nursery:
            ok = await nursery.start(functools.partial(trio.serve_tcp, functools.partial(
                stand_in, answer=b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nGENERATION", live=live, most=most),
                0, host="127.0.0.1"))
            silent = await nursery.start(functools.partial(trio.serve_tcp, functools.partial(
                stand_in, answer=None, live=live, most=most), 0, host="127.0.0.1"))
            port, quiet = ok[0].socket.getsockname()[1], silent[0].socket.getsockname()[1]
            requests = [AgentRequest("GET", NodeSpec(name=f"n{i}", address="127.0.0.1", agent_port=port), "/v1/state",
                                     None, "s" * 16, "g" if i % 2 else None) for i in range(20)]
            requests.insert(5, AgentRequest("GET", NodeSpec(name="quiet", address="127.0.0.1", agent_port=quiet),
                                            "/v1/state"))
            requests.insert(7, AgentRequest("GET", NodeSpec(name="gone", address="127.0.0.1",
                                                            agent_port=closed_port), "/v1/state"))
            started = trio.current_time()
            results = await exchange_all(requests, concurrency=4, timeout=0.5)
            took = trio.current_time() - started
            assert isinstance(results[5], TimedOut) and 0.5 <= took < 5
            assert isinstance(results[7], ConnectionRefusedError)
            rest = [r for i, r in enumerate(results) if i not in (5, 7)]
            assert rest == [(200, b"1" if i % 2 else b"0") for i in range(20)]
            assert most[0] <= 4
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_cancelled_batch_ends_its_connections() -> None:
    async def main() -> None:
        live, most = [0], [0]
        async with trio.open_nursery() as nursery:
            silent = await nursery.start(functools.partial(trio.serve_tcp, functools.partial(
                stand_in, answer=None, live=live, most=most), 0, host="127.0.0.1"))
            node = NodeSpec(name="quiet", address="127.0.0.1", agent_port=silent[0].socket.getsockname()[1])
            with trio.move_on_after(0.3):
                await exchange_all([AgentRequest("GET", node, "/v1/state")] * 3, concurrency=8, timeout=60)
            assert most[0] == 3
            with trio.fail_after(5):  # the thread saw the cancel and closed every connection
                while live[0]:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)


def silent_listener() -> socket.socket:
    """A listener that never accepts: a connection to it is made by the kernel, and never answered."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


@pytest.mark.parametrize("timeout", [math.inf, 3e6])
def test_a_timeout_past_what_epoll_takes_waits_until_cancelled(timeout: float) -> None:
    """`fleet plan --timeout inf`: no deadline; epoll cannot wait that long in one call (OverflowError)."""
    with silent_listener() as lst:
        node = NodeSpec(name="n", address="127.0.0.1", agent_port=lst.getsockname()[1])

        async def main() -> None:
            with trio.move_on_after(0.3) as scope:
                await exchange_all([AgentRequest("GET", node, "/v1/state")], concurrency=4, timeout=timeout)
            assert scope.cancelled_caught

        trio.run(main)


def test_a_timeout_that_is_not_a_duration_is_refused() -> None:
    for timeout in (math.nan, -1.0):
        with pytest.raises(ValueError):
            trio.run(functools.partial(exchange_all, [], concurrency=1, timeout=timeout))


def test_no_concurrency_still_asks_one_at_a_time() -> None:
    with silent_listener() as lst:
        node = NodeSpec(name="n", address="127.0.0.1", agent_port=lst.getsockname()[1])

        async def main() -> None:
            with trio.fail_after(5):
                results = await exchange_all([AgentRequest("GET", node, "/v1/state")] * 2, concurrency=0, timeout=0.05)
            assert all(isinstance(r, TimedOut) for r in results) and len(results) == 2

        trio.run(main)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_batch_cancelled_before_it_began_closes_its_sockets() -> None:
    async def main() -> None:
        await trio.sleep(0)
        before = open_descriptors()
        for _ in range(20):
            with trio.CancelScope() as scope:
                scope.cancel()
                await exchange_all([AgentRequest("GET", NODE, "/v1/state")], concurrency=4, timeout=1)
        assert open_descriptors() == before

    trio.run(main)


OUT_OF_DESCRIPTORS = """
import os, resource, sys, trio
from reconciler.agents.batch import exchange_all
from reconciler.core.desired import NodeSpec
from reconciler.agents.transport import AgentRequest
async def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for fd in held[-3:]:  # room for the batch's socket pair and its epoll, none for a connection
        os.close(fd)
    node = NodeSpec(name="n", address="127.0.0.1", agent_port=9)
    results = await exchange_all([AgentRequest("GET", node, "/v1/state")] * 2, concurrency=4, timeout=1)
    print([getattr(r, "errno", None) == errno.EMFILE for r in results])
import errno
trio.run(main)
"""


def test_out_of_descriptors_is_each_nodes_error_not_the_batchs() -> None:
    done = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[True, True]"


def test_the_agents_own_quiet_answer_takes_the_shortcut() -> None:
    """A quiet beat's 304 as fleet-agent writes it (agent/api/routes.py's headers through net's
    response_head) is read without llhttp, as the quiet beat's CPU assumes (bench/heartbeat)."""
    from starlette.responses import Response

    from net.http1 import response_head
    from reconciler.agents.transport import quiet_304
    from wire import live as wire_live

    answer = Response(status_code=304, headers={"etag": '"g1"', wire_live.HEADER: LIVE.decode()})
    head, *_ = response_head(answer.status_code, answer.raw_headers, "1.1", keep_alive=True, no_body=False)
    assert quiet_304(head) == LIVE
    assert quiet_304(head.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")) is None  # llhttp reads a close
