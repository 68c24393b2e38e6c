"""Many one-shot requests to plain agents at once, each on a connection of its own, all on one epoll
in one thread: the fan-out of `fleet plan` (apply, observe). trio waits for the whole batch as one
call (to_thread), and a cancel ends the thread's connections through a socket it watches.

A trio task per call, each parked on its own socket, cost trio's registration, a park, a wake and
our layers' coroutines per call: at 2,000 simulated agents answering 304, 0.30-0.42 ms of CPU per
node for the observation, against 0.16-0.17 for a bare epoll loop over the same sockets, and
0.20-0.22 for the observation through this module (bench/plan_scale; trio waiting on this epoll
as one file, with a cancel scope per wake, still cost 0.30). Each call keeps its own deadline, and
the answer is read by transport.AgentAnswer, as transport.read_response reads it
(tests/unit/test_batch.py checks both at every cut)."""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Sequence

import trio

from net.sockio import numeric_family
from reconciler.agents.errors import AgentProtocolError, NodeUnreachable
from reconciler.core.desired import NodeSpec
from reconciler.agents.transport import READ, AgentAnswer, AgentRequest


POLL_MAX_S = 3600.0  # the longest one wait in epoll, whatever the calls' deadlines


class TimedOut(Exception):
    """No whole answer within the call's timeout."""


Result = tuple[int, bytes] | OSError | NodeUnreachable | AgentProtocolError | TimedOut


def batchable(node: NodeSpec) -> bool:
    """Plain HTTP to a numeric address: TLS and names to resolve go through SocketTransport.exchange."""
    return not node.tls and numeric_family(node.address) is not None


class _Call:
    __slots__ = ("index", "sock", "unsent", "answer", "deadline", "done")

    def __init__(self, index: int, sock: socket.socket, unsent: memoryview, node: NodeSpec, deadline: float) -> None:
        self.index, self.sock, self.unsent, self.deadline, self.done = index, sock, unsent, deadline, False
        self.answer = AgentAnswer(node)


async def exchange_all(requests: Sequence[AgentRequest], *, concurrency: int, timeout: float) -> list[Result]:
    """Each request's answer (status, body) or why there is none, in the requests' order; at most
    `concurrency` connections at a time, each allowed `timeout` seconds from its connect. The
    calls run in a thread of their own blocking in epoll; cancelled, trio lets it go and closing
    `ours` wakes it to close its sockets and end. `timeout` may be math.inf (no deadline)."""
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"a call's timeout must be a number of seconds >= 0, not {timeout!r}")
    ours, theirs = socket.socketpair()
    begun = threading.Lock()  # held by whichever comes first: the thread starting, or the caller giving up
    started = False

    def run() -> list[Result]:
        nonlocal started
        with begun:
            if theirs.fileno() < 0:
                return []  # given up on before it started
            started = True
        return _exchange_all(requests, max(1, concurrency), timeout, theirs)

    try:
        return await trio.to_thread.run_sync(run, abandon_on_cancel=True)
    finally:
        ours.close()  # the thread's end reads as closed: if it still runs, it stops
        with begun:
            if not started:  # cancelled before the thread began (or it never will): its end is ours to close
                theirs.close()


def _exchange_all(requests: Sequence[AgentRequest], concurrency: int, timeout: float,
                  stop: socket.socket) -> list[Result]:
    results: list[Result | None] = [None] * len(requests)
    waiting = deque(range(len(requests)))
    calls: dict[int, _Call] = {}  # by file descriptor
    started: deque[_Call] = deque()  # in the order of their deadlines
    poller = select.epoll()
    poller.register(stop.fileno(), select.EPOLLIN)

    def finish(call: _Call, result: Result) -> None:
        results[call.index] = result
        call.done = True
        del calls[call.sock.fileno()]
        call.sock.close()  # the kernel drops it from the epoll as it closes it

    def start(index: int) -> None:
        request = requests[index]
        node = request.node
        sock: socket.socket | None = None
        try:  # a socket refused (EMFILE: out of descriptors) is this node's error, not the batch's
            sock = socket.socket(numeric_family(node.address) or socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            code = sock.connect_ex((node.address, node.agent_port))
            if code not in (0, errno.EINPROGRESS):
                raise OSError(code, os.strerror(code))
            data = memoryview(request.encode())
            try:
                data = data[sock.send(data):]  # on loopback the connection is up already
            except BlockingIOError:
                pass  # still connecting: sent when it is writable
            call = _Call(index, sock, data, node, time.monotonic() + timeout)
            poller.register(sock.fileno(), select.EPOLLOUT if data else select.EPOLLIN)
        except OSError as exc:
            if sock is not None:
                sock.close()
            results[index] = exc
            return
        calls[sock.fileno()] = call
        started.append(call)

    def ready(call: _Call, events: int) -> None:
        sock = call.sock
        try:
            if call.unsent:
                if events & (select.EPOLLERR | select.EPOLLHUP) or not events & select.EPOLLOUT:
                    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    raise OSError(code or errno.ECONNRESET, os.strerror(code or errno.ECONNRESET))
                call.unsent = call.unsent[sock.send(call.unsent):]
                if not call.unsent:
                    poller.modify(sock.fileno(), select.EPOLLIN)
                return
            try:
                data = sock.recv(READ)
            except BlockingIOError:
                return
            answer = call.answer.take(data)
            if answer is not None:
                finish(call, answer[:2])
        except (OSError, NodeUnreachable, AgentProtocolError) as exc:
            finish(call, exc)

    stopped = stop.fileno()
    try:
        while waiting or calls:
            while waiting and len(calls) < concurrency:
                start(waiting.popleft())
            now = time.monotonic()
            while started and (started[0].done or started[0].deadline <= now):
                call = started.popleft()
                if not call.done:
                    finish(call, TimedOut())
            if not calls:
                continue
            # Capped: epoll takes at most ~2**31 ms, and an infinite timeout has no deadline at all.
            for fd, events in poller.poll(min(started[0].deadline - now, POLL_MAX_S)):
                if fd in calls:
                    ready(calls[fd], events)
                elif fd == stopped:
                    return []  # cancelled: nobody reads the results
    finally:
        for call in calls.values():
            call.sock.close()
        poller.close()
        stop.close()
    return [r if r is not None else TimedOut() for r in results]
