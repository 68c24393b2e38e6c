"""Run `fleet serve`: the heartbeat and the router in one trio process, until SIGINT/SIGTERM (SIGHUP
reloads the TLS certificate)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import ssl

import trio

from host.descriptors import raise_descriptor_limit

from reconciler.agents.client import AgentClient
from reconciler.core.desired import Desired
from reconciler.agents.observe import observer
from reconciler.state.pg import SharedStore, store_errors
from reconciler.state.drains import DrainRows
from reconciler.state.store import ServeRecord
from reconciler.serve.drains import DrainWatcher
from reconciler.serve.leader import Roles
from reconciler.agents.transport import SocketTransport
from reconciler.serve.front import Front, connection_cap
from net.http1 import Limits
from reconciler.serve.heartbeat import Heartbeat, View
from reconciler.serve.metrics import ServeMetrics
from reconciler.serve.router import Router
from net.streams import ServerTls, TlsFiles
from reconciler.serve.overview import ViewCollector
from reconciler.serve.ui.app import StatusPage, store_history

log = logging.getLogger("fleet")


# With no drain under way, serve looks at a SQLite store's drains this often (50 ms while one is):
# waking 20 times a second added 1-5 ms to the relay's p50 on a busy machine, and an apply waits
# up to 2 s (drain.ACK_S) for serve to take a member out of routing.
SQLITE_IDLE_S = 0.25


class ServeRefused(Exception):
    pass


def api_keys(desired: Desired) -> list[str] | None:
    env = desired.control_plane.api_keys_env
    if not env:
        return None
    keys = [k.strip() for k in os.environ.get(env, "").split(",") if k.strip()]
    if not keys:
        raise ServeRefused(f"control_plane.api_keys_env names {env}, which holds no key: set {env}=KEY1,KEY2 "
                           "(or remove api_keys_env to serve without client keys)")
    return keys


MAX_BODY_ENV = "FLEET_MAX_REQUEST_BODY"


def max_body() -> int:
    """The front's request-body limit in bytes: FLEET_MAX_REQUEST_BODY, or http1.Limits' default
    (4 MiB; why there)."""
    default = Limits().max_body
    value = os.environ.get(MAX_BODY_ENV, "").strip()
    if not value:
        return default
    if not value.isascii() or not value.isdigit() or len(value) > 12 or not 1024 <= int(value) <= 1 << 30:
        raise ServeRefused(f"{MAX_BODY_ENV}={value[:40]!r} is not a number of bytes from 1024 to 1073741824 "
                           f"(unset: {default})")
    return int(value)


def server_tls(desired: Desired) -> ServerTls | None:
    spec = desired.control_plane.tls
    if spec is None:
        return None
    try:
        return ServerTls(TlsFiles(spec.cert, spec.key))
    except (OSError, ssl.SSLError) as exc:
        raise ServeRefused(f"control_plane.tls: cannot load {spec.cert} with {spec.key}: {exc}") from None


async def serve(desired: Desired, secret: str, store: ServeRecord, *, interval: float, misses: int,
                timeout: float, drains: DrainRows | None = None, shared: SharedStore | None = None) -> None:
    """`drains`: where `fleet apply` asks for members to be drained around a replace (the state
    store's; None: no apply drains through this process). `shared`: the PostgreSQL store `store`
    and `drains` are part of, which other `fleet serve` processes may share: this one leads the
    heartbeat while it holds the leadership lock, and follows the leader's rows otherwise
    (serve/leader.py); changes arrive by NOTIFY."""
    keys = api_keys(desired)
    body_limit = max_body()
    tls = server_tls(desired)
    nofile = raise_descriptor_limit()  # the front's connection cap follows it
    # The heartbeat keeps a connection per agent between beats (transport.SocketTransport), out
    # of the descriptors the front's cap is computed from.
    kept = min(len(desired.nodes), nofile // 4)
    if shared is not None:  # the beats' writes on a connection of their own, from a thread
        store = shared.beat_record()
    store.tune_for_serve()  # no fsync per beat: ServeRecord.tune_for_serve says why
    transport = SocketTransport(keep_alive=True, max_idle=kept)
    async with AgentClient(secret, timeout=timeout, transport=transport) as client:
        metrics = ServeMetrics()
        observe = observer(desired, client)

        def make_heartbeat(view: View | None = None) -> Heartbeat:
            return Heartbeat(desired, observe, store, interval=interval, misses=misses, timeout=timeout,
                             on_beat=metrics.beat_seconds.observe, on_plan=metrics.planned, view=view)

        heartbeat = make_heartbeat()
        view = heartbeat.view
        notifier = shared.notifier() if shared is not None else None
        name = f"{socket.gethostname()}:{os.getpid()}"
        if shared is not None:  # the other serves wait for this one's answers while it lives
            shared.sql.name_serve(name)
        roles = (Roles(make_heartbeat, view, store, shared.leader_lock(),
                       lambda limit: notifier.wait(ServeRecord.CHANNEL, limit), poll_s=min(interval / 4, 2.0),
                       observe=observe, timeout=timeout)
                 if shared is not None and notifier is not None else None)
        # A worker restarted between beats refuses the credential the router holds: its agent is asked again.
        router = Router(desired, view, api_keys=keys, metrics=metrics,
                        refresh=roles.refresh if roles else heartbeat.refresh)
        router.ui = StatusPage(desired, view, metrics, store_history(store.sql.execute), router.keys)  # /ui
        metrics.registry.register(ViewCollector(desired, view))  # members by state, corrupt copies, replications
        watcher = (DrainWatcher(drains, view, router.in_flight, roles.refresh if roles else heartbeat.refresh,
                                on_change=metrics.draining.set,
                                wait=(lambda limit: notifier.wait(DrainRows.CHANNEL, limit)) if notifier
                                else lambda limit: trio.sleep(SQLITE_IDLE_S),
                                answers=(lambda: roles.leading) if roles else (lambda: True), name=name)
                   if drains is not None else None)
        host, _, port = desired.control_plane.listen.rpartition(":")
        front = Front(router.app(), Limits(max_connections=connection_cap(nofile - kept), max_body=body_limit),
                      tls=tls, on_drop=lambda reason: metrics.connections_dropped.labels(reason).inc(),
                      admit=router.admit)
        metrics.connections.set_function(lambda: front.live)
        listeners = front.listen(host.strip("[]"), int(port))
        stop = trio.Event()

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
                async for sig in signals:
                    if sig == signal.SIGHUP:  # a renewed certificate, without dropping a connection
                        if tls is not None:
                            tls.reload()
                        continue
                    stop.set()
                    return

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(on_signal)
                if shared is not None and notifier is not None and roles is not None:
                    await nursery.start(notifier.run)
                    shared.sql.watch = notifier.watcher(DrainRows.CHANNEL)
                    await nursery.start(roles.run)
                else:
                    await nursery.start(heartbeat.run)
                if watcher is not None:
                    await nursery.start(watcher.run)
                log.info("serving %d clusters on %s://%s (heartbeat every %gs, at most %d client connections)",
                         len(desired.clusters), "https" if tls else "http", desired.control_plane.listen, interval,
                         front.cap)
                # What start-up built (modules, config, schema, the first beat) lives as long as the
                # process: frozen out of every later collection, or a full one walks those ~50,000
                # objects and stalls every stream (29 ms of CPU measured; a young one about 2 ms).
                gc.collect()
                gc.freeze()
                await front.serve(listeners, stop)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # A shared store's connection lost (its server restarted, the network gone): said and
            # ended with a code, and another `fleet serve` on the store leads in the meantime.
            lost = group.subgroup(lambda exc: isinstance(exc, store_errors()))
            if lost is None or shared is None:
                raise
            first: BaseException = lost
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise ServeRefused(f"lost the state store {shared.where}: "
                               f"{str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__}"
                               " (another fleet serve sharing it leads meanwhile, if one runs)") from None
    transport.close()
