"""Run the agent's ASGI app under hypercorn on trio until SIGINT/SIGTERM, holding at most a capped
number of connections at once, which strangers cannot keep (Door).

hypercorn has no such cap, and its `serve` builds its listeners and hands every accepted stream to
its TCPServer itself, with no place to put one. `_serve` is its worker (hypercorn/trio/run.py,
`worker_serve`, 0.18) with that one change and without what the agent does not use (QUIC, statsd,
max_requests); each connection is hypercorn's TCPServer, given a stream that tells the Door when
bytes arrive (TLS is layered by the Door over that stream), and the app is wrapped so that the
Door sees each request begin and end. Nothing of a TCPServer's private members is used; its
constructor, Lifespan and WorkerContext are hypercorn's own, so pyproject.toml pins hypercorn to
the minor version it was written against."""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import signal
import ssl
import sys
from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import ShutdownError, raise_shutdown, wrap_app
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from host.descriptors import raise_descriptor_limit

from agent.machine.identity import Identity

if TYPE_CHECKING:
    from agent.serving.supervisor import Workers

log = logging.getLogger("fleet-agent")

# Descriptors kept out of inbound connections' reach: stdio, epoll, trio's wake-up pair, the signal
# pipe, the listener and the log (~16); fetches (a connection to the peer and the part file each),
# workers (their pipes and the connection to their port), files being verified, refusals
# lingering (LINGER_MAX).
RESERVED_FDS = 128
LINGER_MAX = 32
LINGER_S = 1.0  # a refused client's request is read (and dropped) this long, so the 503 is not reset
WARN_EVERY_S = 10.0
IDLE_S = 10.0  # a connection's first byte of a head within this (again between requests, until it shows the secret)
HEAD_S = 10.0  # a request's whole head within this of its first byte
CONTROL_RESERVE = 16  # places only the control plane's addresses (--control-plane) may take (at most a quarter)
READ = 64 * 1024


def connection_cap(nofile: int) -> int:
    """Connections held at once, from the soft RLIMIT_NOFILE: what the reserve leaves, over three,
    since a blob answer holds three descriptors (the connection, its file, and the duplicate of the
    connection its body is sent on). 1,024 (the usual default) gives 298; 65,536 (what the agent
    raises it to where the hard limit allows) 21,802."""
    return max(16, (nofile - RESERVED_FDS) // 3)


class _Conn:
    """One held connection, as the Door sees it: its cancel scope (its deadline is the idle or head
    deadline, cancelling it evicts it), whether it has shown the cluster secret (or comes from a
    control-plane address), whether a request is in flight, and whether bytes of a head arrived."""

    __slots__ = ("key", "scope", "trusted", "control", "in_flight", "heading", "ended", "request")

    def __init__(self, key: tuple[str, int], deadline: float, control: bool) -> None:
        self.key = key
        self.scope = trio.CancelScope(deadline=deadline)
        self.trusted = self.control = control
        self.in_flight = self.heading = self.ended = False
        self.request = 0


class Door:
    """The connections the server holds: `cap` at once, and strangers cannot keep them.

    A connection must send a request's first byte within IDLE_S and its whole head within HEAD_S
    of that byte; between requests, one that has never shown the cluster secret is given IDLE_S
    again, one that has keeps hypercorn's keep-alive (120 s). When all places are held, the newest
    connection takes the place of the oldest idle one (no request in flight): first one that never
    showed the secret, then one that did. Only when every place has a request in flight is one more
    answered 503 `too_many_connections` and closed (over TLS, closed: a 503 would cost a handshake
    first), the refusal logged at most every WARN_EVERY_S. Connections from `control` (the control
    plane's addresses, --control-plane) count as authenticated from the start, and the last
    CONTROL_RESERVE places are theirs alone. A connection whose client closed its end is closed as
    soon as no request of it is in flight (hypercorn held it in CLOSE-WAIT for the keep-alive).

    What the Door knows of requests it learns from `watch` (the ASGI app in front of the agent's)
    and from the bytes it reads (`_Watched`): no hypercorn internals."""

    def __init__(self, cap: int, node: str = "", control: frozenset[str] = frozenset(),
                 admits: Callable[[Scope], bool] = lambda scope: False) -> None:
        self.cap = cap
        self.control = frozenset(_address(a) for a in control)
        self.reserve = min(CONTROL_RESERVE, cap // 4) if control else 0
        self.admits = admits
        self.refused = self.evicted = self.timed_out = 0
        # Idle connections, oldest first: strangers (never showed the secret) and the authenticated.
        self._strangers: OrderedDict[tuple[str, int], _Conn] = OrderedDict()
        self._known: OrderedDict[tuple[str, int], _Conn] = OrderedDict()
        self._busy: dict[tuple[str, int], _Conn] = {}  # a request in flight
        self._lingering = 0
        self._warned_at = self._evict_warned_at = -math.inf
        body = json.dumps({"error": {"code": "too_many_connections", "message":
                                     f"the agent of node {node!r} holds at most {cap} connections at once, all "
                                     "with a request in flight; retry shortly (fleet-agent serve --max-connections)"}}).encode()
        self._busy_answer = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n").encode() + body

    @property
    def held(self) -> int:
        return len(self._strangers) + len(self._known) + len(self._busy)

    def _find(self, key: tuple[str, int]) -> _Conn | None:
        return self._strangers.get(key) or self._known.get(key) or self._busy.get(key)

    def _drop(self, conn: _Conn) -> None:
        for table in (self._strangers, self._known, self._busy):
            if table.get(conn.key) is conn:
                del table[conn.key]

    def _rest(self, conn: _Conn) -> None:
        """`conn` idle: at the end of its table (the newest idle)."""
        (self._known if conn.trusted else self._strangers)[conn.key] = conn

    def _make_room(self, control: bool) -> bool:
        limit = self.cap if control else self.cap - self.reserve
        while self.held >= limit:
            table = self._strangers or self._known
            if not table:
                return False
            _, victim = table.popitem(last=False)
            victim.scope.cancel()
            self.evicted += 1
            now = trio.current_time()
            if now - self._evict_warned_at >= WARN_EVERY_S:
                self._evict_warned_at = now
                log.warning("[connections_evicted] all %d places were held: the oldest idle connection gives its "
                            "place to the newest (unauthenticated ones first); %d evicted so far", self.cap,
                            self.evicted)
        return True

    async def __call__(self, serve: Callable[[trio.abc.Stream], Awaitable[None]], stream: trio.SocketStream,
                       ssl_context: ssl.SSLContext | None = None) -> None:
        try:
            key = _peer(stream.socket.getpeername())
        except OSError:  # gone already
            await trio.aclose_forcefully(stream)
            return
        control = _address(key[0]) in self.control
        stale = self._find(key)  # the same client address held: that connection is gone
        if stale is not None:
            self._drop(stale)
            stale.scope.cancel()
        if not self._make_room(control):
            await self._refuse(stream if ssl_context is None else None, stream)
            return
        conn = _Conn(key, trio.current_time() + IDLE_S, control)
        self._rest(conn)
        watched = _Watched(stream, self, conn)
        try:
            with conn.scope:
                await serve(watched if ssl_context is None else
                            trio.SSLStream(watched, ssl_context, server_side=True, https_compatible=True))
            if conn.scope.cancelled_caught and conn.scope.deadline <= trio.current_time():
                self.timed_out += 1  # a head not sent in time, or a stranger idle past IDLE_S
        finally:
            self._drop(conn)
            await trio.aclose_forcefully(stream)

    # What the bytes read and the requests seen say (the only way in: no hypercorn internals).

    def received(self, conn: _Conn, data: bytes) -> None:
        if not data:
            conn.ended = True
            if not conn.in_flight and not conn.heading:
                conn.scope.cancel()  # idle and closed by its client: its place back at once
        elif not conn.in_flight and not conn.heading:
            conn.heading = True
            conn.scope.deadline = trio.current_time() + HEAD_S

    def begin(self, scope: Scope) -> tuple[_Conn, int] | None:
        """A request's head has arrived (the app is called): its connection is busy, and known from
        now on if the request carries the secret."""
        client = scope.get("client")
        conn = self._find(_peer(client)) if client else None
        if conn is None:
            return None
        self._drop(conn)
        self._busy[conn.key] = conn
        conn.in_flight, conn.heading = True, False
        conn.trusted = conn.trusted or self.admits(scope)
        conn.scope.deadline = math.inf
        conn.request += 1
        return conn, conn.request

    def end(self, conn: _Conn, request: int) -> None:
        """The answer to `request` has been sent (or its app returned): the connection is idle."""
        if not conn.in_flight or conn.request != request:
            return
        conn.in_flight = False
        if self._busy.get(conn.key) is not conn:
            return  # dropped meanwhile
        del self._busy[conn.key]
        if conn.ended:
            conn.scope.cancel()
            return
        conn.scope.deadline = math.inf if conn.trusted else trio.current_time() + IDLE_S
        self._rest(conn)

    def watch(self, app: ASGIApp) -> ASGIApp:
        """`app` with each HTTP request reported to the Door (begin, then end once answered)."""

        async def watched(scope: Scope, receive: Receive, send: Send) -> None:
            began = self.begin(scope) if scope["type"] == "http" else None
            if began is None:
                await app(scope, receive, send)
                return

            async def sending(message: Message) -> None:
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    self.end(*began)

            try:
                await app(scope, receive, sending)
            finally:
                self.end(*began)

        return watched

    async def _refuse(self, plain: trio.SocketStream | None, stream: trio.SocketStream) -> None:
        self.refused += 1
        now = trio.current_time()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("[too_many_connections] refusing connections: all %d allowed are held, each with a request "
                        "in flight (the cap follows RLIMIT_NOFILE; --max-connections sets it); %d refused so far",
                        self.cap, self.refused)
        if plain is None or self._lingering >= LINGER_MAX:
            await trio.aclose_forcefully(stream)
            return
        self._lingering += 1
        try:
            with trio.move_on_after(LINGER_S):
                await stream.send_all(self._busy_answer)
                await stream.send_eof()
                while await stream.receive_some(READ):
                    pass  # the request, dropped: closing with it unread would reset the connection
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self._lingering -= 1
            await trio.aclose_forcefully(stream)


class _Watched(trio.abc.HalfCloseableStream):
    """A connection's socket stream, telling the Door when bytes (or the client's close) arrive."""

    def __init__(self, inner: trio.SocketStream, door: Door, conn: _Conn) -> None:
        self.inner, self.door, self.conn = inner, door, conn

    @property
    def socket(self) -> trio.socket.SocketType:  # what a server asks a socket stream for its addresses
        return self.inner.socket

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        self.door.received(self.conn, data)
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _peer(address: Any) -> tuple[str, int]:
    return str(address[0]), int(address[1])


def _address(text: str) -> str:
    """An address as compared: an IPv4 address mapped into IPv6 (a listener on ::) as itself."""
    ip = ipaddress.ip_address(text.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


async def _serve(app: ASGIApp, config: Config, door: Door, shutdown_trigger: Callable[[], Awaitable[object]]) -> None:
    """hypercorn.trio.serve, every accepted connection passed through `door` (see the module's note)."""
    wrapped = wrap_app(door.watch(app), config.wsgi_max_body_size, None)  # type: ignore[arg-type]
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            ssl_context = config.create_ssl_context()
            connection = partial(TCPServer, wrapped, config, context, ConnectionState(lifespan_state.copy()))
            served: list[tuple[list[trio.SocketListener], ssl.SSLContext | None]] = []
            for group, context_of in ((sockets.secure_sockets, ssl_context), (sockets.insecure_sockets, None)):
                listeners = []
                for sock in group:
                    sock.listen(config.backlog)
                    listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                if listeners:  # TLS is set up by the Door, over the stream it watches
                    served.append((listeners, context_of))
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    for listeners, context_of in served:
                        nursery.start_soon(partial(trio.serve_listeners, partial(_admit, door, connection, context_of),
                                                   listeners, handler_nursery=server_nursery))
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, others = error.split((ShutdownError, KeyboardInterrupt))
                if others is not None:
                    raise others
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _admit(door: Door, connection: Callable[[trio.abc.Stream], Awaitable[None]],
                 ssl_context: ssl.SSLContext | None, stream: trio.SocketStream) -> None:
    await door(connection, stream, ssl_context)


class Spawner:
    """Background work (fetches, server supervision, verification) runs in the server's nursery,
    handed over once open; what is spawned before (the verification at start) starts then."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        self._waiting: list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]] = []

    @property
    def nursery(self) -> trio.Nursery | None:
        return self._nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        self._nursery = nursery
        waiting, self._waiting = self._waiting, []
        for fn, args in waiting:
            self(fn, *args)

    def __call__(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        if self._nursery is None:
            self._waiting.append((fn, args))
            return
        self._nursery.start_soon(fn, *args)



def serve(app: ASGIApp, host: str, port: int, ident: Identity, *, spawner: Spawner | None = None,
          workers: Workers | None = None, max_connections: int | None = None,
          tls_cert: str | None = None, tls_key: str | None = None, control_plane: frozenset[str] = frozenset(),
          admits: Callable[[Scope], bool] = lambda scope: False) -> int:
    """Serve `app` until SIGINT/SIGTERM; `admits` says whether a request carries the cluster secret
    (its connection is then preferred), `control_plane` the addresses whose connections are the
    control plane's (see Door)."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None  # requests carry the cluster secret in a header: log none of them
    config.errorlog = log
    config.graceful_timeout = 5
    # fleet serve's heartbeat keeps its connection between beats (30 s by default): an idle one
    # closed after hypercorn's 5 s would be set up again on every beat.
    config.keep_alive_timeout = 120
    config.alpn_protocols = ["http/1.1"]  # fleet speaks HTTP/1.1; over h2 a blob abandoned mid-body held its connection
    if tls_cert and tls_key:
        config.certfile, config.keyfile = tls_cert, tls_key
    scheme = "https" if tls_cert else "http"
    nofile = raise_descriptor_limit()  # for the agent's own files too, whatever the cap
    door = Door(max_connections or connection_cap(nofile), ident.name, control_plane, admits)

    async def main() -> None:
        shutdown = trio.Event()

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("%s received: stopping", signal.Signals(signum).name)
                    shutdown.set()
                    return

        async with trio.open_nursery() as nursery:
            if spawner is not None:
                spawner.nursery = nursery  # fetches run here, and end with the server
            nursery.start_soon(on_signal)
            log.info("node %r (identity %s) listening on %s://%s, at most %d connections at once",
                     ident.name, ident.id, scheme, config.bind[0], door.cap)
            await _serve(app, config, door, shutdown.wait)
            if workers is not None:
                await workers.stop_all()  # an agent that stops leaves no worker behind
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except (OSError, BaseExceptionGroup) as exc:  # a bind failure (port in use, bad address), maybe grouped
        os_error = _first_os_error(exc)
        if os_error is None:
            raise
        reason = os_error.strerror or str(os_error)
        print(f"fleet-agent: refusing to start: cannot listen on {config.bind[0]}: {reason}", file=sys.stderr)
        return 3
    return 0


def _first_os_error(exc: BaseException) -> OSError | None:
    if isinstance(exc, OSError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _first_os_error(inner)
        if found is not None:
            return found
    return None
