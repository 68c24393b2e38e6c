"""Run `fleet serve`: the heartbeat and the router in one trio process, until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os
import signal

import trio

from ..client import AgentClient
from ..model import Desired
from ..store import Store
from .front import Front
from .heartbeat import Heartbeat
from .metrics import ServeMetrics
from .router import Router

log = logging.getLogger("fleet")


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


async def serve(desired: Desired, secret: str, store: Store, *, interval: float, misses: int,
                timeout: float) -> None:
    keys = api_keys(desired)
    async with AgentClient(secret, timeout=timeout) as client:
        metrics = ServeMetrics()
        heartbeat = Heartbeat(desired, client, store, interval=interval, misses=misses, timeout=timeout,
                              on_beat=metrics.beat_seconds.observe)
        router = Router(desired, heartbeat.view, api_keys=keys, metrics=metrics)
        host, _, port = desired.control_plane.listen.rpartition(":")
        front = Front(router.app())
        listeners = front.listen(host.strip("[]"), int(port))
        stop = trio.Event()

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    stop.set()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signal)
            await nursery.start(heartbeat.run)
            log.info("serving %d clusters on http://%s (heartbeat every %gs)", len(desired.clusters),
                     desired.control_plane.listen, interval)
            await front.serve(listeners, stop)
            nursery.cancel_scope.cancel()
