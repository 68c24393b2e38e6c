"""The control plane's HTTP/1.1 front: net's server (net/server.py) with fleet serve's connection
cap, the descriptors it keeps for itself, and its name in refusals.

Why not hypercorn here: see net/server.py (bench/relay). What a client can make the front hold is
bounded: one request being read, at most Limits.read_ahead bytes of the next while a response is
in flight, and a number of connections derived from the process's descriptor limit
(connection_cap), so that the heartbeat and the relay's own connections always find a descriptor.
"""

from __future__ import annotations

import logging
import resource
from typing import Callable

from starlette.types import ASGIApp

from net.http1 import Admit, Limits
from net.server import Server
from net.server import connection_cap as net_connection_cap
from net.streams import ServerTls

__all__ = ["Front", "Limits", "connection_cap"]

# Descriptors kept out of the clients' reach. fleet serve's own: stdio, epoll, trio's wake-up
# pair, the signal pipe, the state database and its journal, the log, the listeners (~32, 64
# kept); the heartbeat's agent calls, one plain connection each, observe's concurrency (64); the
# router's pooled idle connections to workers (net/client.py's Pool; 100 kept).
# net/server.py's connection_cap adds the refusals still lingering.
RESERVED_FDS = 64 + 64 + 100


def connection_cap(nofile: int | None = None) -> int:
    """Client connections held at once, from the soft RLIMIT_NOFILE: what is left after the
    reserve, halved, because every connection relaying a stream holds a second descriptor (its
    connection to the worker). 1,024 (the usual default) gives 382; 65,536 (examples/systemd) 32,638."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        nofile = 1 << 20 if nofile == resource.RLIM_INFINITY else nofile
    return net_connection_cap(nofile, RESERVED_FDS)


class Front(Server):
    """net's server as fleet serve runs it (see Server for `on_drop` and `admit`)."""

    def __init__(self, app: ASGIApp, limits: Limits | None = None, *, tls: ServerTls | None = None,
                 on_drop: Callable[[str], None] | None = None, admit: Admit | None = None) -> None:
        limits = limits or Limits()
        super().__init__(app, limits, cap=limits.max_connections or connection_cap(), tls=tls, on_drop=on_drop,
                         admit=admit, name="fleet serve", log=logging.getLogger("fleet"),
                         cap_hint=" (the cap follows RLIMIT_NOFILE; see LimitNOFILE in "
                                  "examples/systemd/fleet-serve.service)")
