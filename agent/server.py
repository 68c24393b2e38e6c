"""Run the agent's ASGI app under hypercorn on trio until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from starlette.types import ASGIApp

from .identity import Identity

if TYPE_CHECKING:
    from .app import Spawner
    from .workers import Workers

log = logging.getLogger("fleet-agent")


def serve(app: ASGIApp, host: str, port: int, ident: Identity, *, spawner: Spawner | None = None,
          workers: Workers | None = None,
          tls_cert: str | None = None, tls_key: str | None = None) -> int:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None  # requests carry the cluster secret in a header: log none of them
    config.errorlog = log
    config.graceful_timeout = 5
    # fleet serve's heartbeat keeps its connection between beats (30 s by default): an idle one
    # closed after hypercorn's 5 s would be set up again on every beat.
    config.keep_alive_timeout = 120
    if tls_cert and tls_key:
        config.certfile, config.keyfile = tls_cert, tls_key
    scheme = "https" if tls_cert else "http"

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
            log.info("node %r (identity %s) listening on %s://%s", ident.name, ident.id, scheme, config.bind[0])
            await hypercorn_serve(app, config, shutdown_trigger=shutdown.wait)  # type: ignore[arg-type]
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
