"""Run the agent's ASGI app under hypercorn on trio until SIGINT/SIGTERM, holding at most a capped
number of connections at once (Door).

hypercorn has no such cap, and its `serve` builds its listeners and hands every accepted stream to
its TCPServer itself, with no place to put one. `_serve` is its worker (hypercorn/trio/run.py,
`worker_serve`, 0.18) with that one change and without what the agent does not use (QUIC, statsd,
max_requests); its connections are hypercorn's TCPServer, closed as soon as the client's end
closes (_Connection). It uses hypercorn's own Lifespan, TCPServer and WorkerContext, so
pyproject.toml pins hypercorn to the minor version it was written against."""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio
from hypercorn.config import Config
from hypercorn.events import Event, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import ShutdownError, raise_shutdown, wrap_app
from starlette.types import ASGIApp

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
READ = 64 * 1024


def connection_cap(nofile: int) -> int:
    """Connections held at once, from the soft RLIMIT_NOFILE: what the reserve leaves, over three,
    since a blob answer holds three descriptors (the connection, its file, and the duplicate of the
    connection its body is sent on). 1,024 (the usual default) gives 298; 65,536 (what the agent
    raises it to where the hard limit allows) 21,802."""
    return max(16, (nofile - RESERVED_FDS) // 3)


class Door:
    """The connections the server holds: `cap` at once. One more is answered 503
    `too_many_connections` and closed (over TLS, closed: a 503 would cost a handshake first), and
    the refusal logged at most every WARN_EVERY_S: the agent's own work (fetches, workers, the
    store) keeps the descriptors it needs whatever its clients open."""

    def __init__(self, cap: int, node: str = "") -> None:
        self.cap = cap
        self.held = 0
        self.refused = 0
        self._lingering = 0
        self._warned_at = -math.inf
        body = json.dumps({"error": {"code": "too_many_connections", "message":
                                     f"the agent of node {node!r} holds at most {cap} connections at once, all "
                                     "held; retry shortly (fleet-agent serve --max-connections)"}}).encode()
        self._busy = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                      f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n").encode() + body

    async def __call__(self, serve: Callable[[trio.abc.Stream], Awaitable[None]], stream: trio.abc.Stream) -> None:
        if self.held >= self.cap:
            await self._refuse(stream)
            return
        self.held += 1
        try:
            await serve(stream)
        finally:
            self.held -= 1

    async def _refuse(self, stream: trio.abc.Stream) -> None:
        self.refused += 1
        now = trio.current_time()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("[too_many_connections] refusing connections: all %d allowed are held (the cap follows "
                        "RLIMIT_NOFILE; --max-connections sets it); %d refused so far", self.cap, self.refused)
        if not isinstance(stream, trio.SocketStream) or self._lingering >= LINGER_MAX:
            await trio.aclose_forcefully(stream)
            return
        self._lingering += 1
        try:
            with trio.move_on_after(LINGER_S):
                await stream.send_all(self._busy)
                await stream.send_eof()
                while await stream.receive_some(READ):
                    pass  # the request, dropped: closing with it unread would reset the connection
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self._lingering -= 1
            await trio.aclose_forcefully(stream)


class _Connection(TCPServer):
    """hypercorn's connection, closed as soon as its client has closed its end: hypercorn waits
    out the keep-alive timer first (120 s here) holding the descriptor in CLOSE-WAIT, and with
    it a place under the Door's cap. A request in flight when the client's end closes (a client
    that half-closes after its request) is answered first, as hypercorn does."""

    _ended = False
    _idle = True  # no request in flight (hypercorn's keep-alive timer runs)

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            self._idle = event.idle
        await super().protocol_send(event)

    async def _read_data(self) -> None:
        await super()._read_data()
        self._ended = True
        if self._idle:  # else a client that half-closed after its request still gets the answer,
            await self.idle_task.restart(self._task_group, self._idle_timeout)  # closed once idle

    async def _idle_timeout(self) -> None:
        if not self._ended:
            await super()._idle_timeout()
            return
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()


async def _serve(app: ASGIApp, config: Config, door: Door, shutdown_trigger: Callable[[], Awaitable[object]]) -> None:
    """hypercorn.trio.serve, every accepted stream passed through `door` (see the module's note)."""
    wrapped = wrap_app(app, config.wsgi_max_body_size, None)  # type: ignore[arg-type]
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            ssl_context = config.create_ssl_context()
            listeners: list[trio.abc.Listener[trio.abc.Stream]] = []
            for sock in sockets.secure_sockets:
                assert ssl_context is not None  # secure sockets are made only with a certificate
                sock.listen(config.backlog)
                listeners.append(trio.SSLListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)),
                                                  ssl_context, https_compatible=True))
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
            handler = partial(door, partial(_Connection, wrapped, config, context, ConnectionState(lifespan_state.copy())))
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    nursery.start_soon(partial(trio.serve_listeners, handler, listeners, handler_nursery=server_nursery))
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
          tls_cert: str | None = None, tls_key: str | None = None) -> int:
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
    door = Door(max_connections or connection_cap(nofile), ident.name)

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
