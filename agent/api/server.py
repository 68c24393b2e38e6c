"""Run the agent's ASGI app on net's server (net/server.py) until SIGINT/SIGTERM, holding at most a
capped number of connections at once, which strangers cannot keep.

The policy (agent_server): a connection must send a request's first byte within IDLE_S and its
whole head within HEAD_S of that byte; between requests, one that has never shown the cluster
secret is given IDLE_S again, one that has keeps a keep-alive of KEEP_ALIVE_S (fleet serve's
heartbeat keeps its connection between beats). When all places are held, the newest connection
takes the place of the oldest idle one: first one that never showed the secret, then one that
did. Only when every place has a request in flight is one more answered 503
`too_many_connections` and closed (over TLS, closed). Connections from the control plane's
addresses (--control-plane) count as authenticated from the start, and the last CONTROL_RESERVE
places are theirs alone. net's server does all of it; hypercorn, whose worker this module used to
rewrite around private members, is no longer the agent's."""

from __future__ import annotations

import ipaddress
import logging
import signal
import ssl
import sys
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio
from starlette.types import ASGIApp, Scope

from host.descriptors import raise_descriptor_limit
from net import sockio
from net.http1 import Limits
from net.server import Server
from net.server import connection_cap as net_connection_cap
from net.streams import ServerTls, TlsFiles

from agent.machine.identity import Identity

if TYPE_CHECKING:
    from agent.serving.supervisor import Workers

log = logging.getLogger("fleet-agent")

# Descriptors kept out of inbound connections' reach (net/server.py's connection_cap adds the
# refusals still lingering): stdio, epoll, trio's wake-up pair, the signal pipe, the listener and
# the log (~16); fetches (a connection to the peer and the part file each), workers (their pipes
# and the connection to their port), files being verified.
RESERVED_FDS = 96
IDLE_S = 10.0  # a connection's first byte of a head within this (again between requests, until it shows the secret)
HEAD_S = 10.0  # a request's whole head within this of its first byte
KEEP_ALIVE_S = 120.0  # an authenticated connection idle between requests is closed after this long
GRACE_S = 5.0  # on shutdown, requests in flight get this long to finish
CONTROL_RESERVE = 16  # places only the control plane's addresses (--control-plane) may take (at most a quarter)


def connection_cap(nofile: int) -> int:
    """Connections held at once, from the soft RLIMIT_NOFILE: a blob answer holds two descriptors
    (the connection and its file; the socket its body is sent on is the server's own, net/server.py's
    SOCKET_EXTENSION). 1,024 (the usual default) gives 448; 65,536 (what the agent raises it to where
    the hard limit allows) 32,704."""
    return net_connection_cap(nofile, RESERVED_FDS)


def _address(text: str) -> str:
    """An address as compared: an IPv4 address mapped into IPv6 (a listener on ::) as itself."""
    ip = ipaddress.ip_address(text.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def agent_server(app: ASGIApp, cap: int, node: str = "", control: frozenset[str] = frozenset(),
                 admits: Callable[[Scope], bool] = lambda scope: False, tls: ServerTls | None = None) -> Server:
    """net's server with the agent's policy (see the module's note): `admits(scope)` says whether a
    request carries the cluster secret, `control` the control plane's addresses."""
    addresses = frozenset(_address(a) for a in control)
    limits = Limits(keep_alive=KEEP_ALIVE_S, stranger_idle=IDLE_S, read_timeout=HEAD_S, grace=GRACE_S,
                    max_connections=cap)
    busy = (f"the agent of node {node!r} holds at most {cap} connections at once, all with a request in flight; "
            "retry shortly (fleet-agent serve --max-connections)")
    return Server(app, limits, cap=cap, tls=tls, name=f"the agent of node {node!r}", log=log, busy=busy,
                  cap_hint=" (the cap follows RLIMIT_NOFILE; --max-connections sets it)", trusts=admits,
                  privileged=(lambda address: _address(address) in addresses) if addresses else None,
                  reserve=min(CONTROL_RESERVE, cap // 4))


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
    control plane's (see agent_server)."""
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    scheme = "https" if tls_cert else "http"
    nofile = raise_descriptor_limit()  # for the agent's own files too, whatever the cap
    try:
        tls = ServerTls(TlsFiles(tls_cert, tls_key)) if tls_cert and tls_key else None
    except (OSError, ssl.SSLError) as exc:
        print(f"fleet-agent: refusing to start: the TLS certificate {tls_cert} or key {tls_key} does not load: {exc}",
              file=sys.stderr)
        return 3
    try:
        listeners = sockio.listen(host, port)
    except OSError as exc:  # port in use, bad address
        print(f"fleet-agent: refusing to start: cannot listen on {bind}: {exc.strerror or exc}", file=sys.stderr)
        return 3
    server = agent_server(app, max_connections or connection_cap(nofile), ident.name, control_plane, admits, tls)

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
                     ident.name, ident.id, scheme, bind, server.cap)
            await server.serve(listeners, shutdown)
            if workers is not None:
                await workers.stop_all()  # an agent that stops leaves no worker behind
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 0
