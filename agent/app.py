"""A real agent assembled from its parts (`assemble`), and the app built from its context: the routes of
agent/api/routes.py behind the cluster-secret check of agent/auth.py."""

from __future__ import annotations

import hashlib
import json
import marshal
import ssl
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp

from wire.state import AgentState, Inventory
from wire.windows import Window, status

from agent.machine import environment, inventory
from agent.api import routes
from agent.auth import BearerAuth
from agent.transfer.fetch import Fetcher
from agent.machine.identity import Identity
from agent.backends.launch import Launcher
from agent.weights.sealed import Key
from agent.weights.store import Store, WeightStore
from agent.weights.verify import DEFAULT_PERIOD_S, Verifier
from agent.serving.supervisor import Workers
from agent.api.server import Spawner
from agent.api.context import AgentContext, local_now


def assemble(home: Path, identity: Identity, secret: bytes, version: str, gpu_probe: inventory.GpuProbe,
             launcher: Launcher, *, listen_host: str = "127.0.0.1", windows: tuple[Window, ...] = (),
             clock: Callable[[], datetime] = local_now, engines: dict[str, Any] | None = None,
             verify_every_s: float | None = DEFAULT_PERIOD_S, disk_reserve: int | None = None,
             weights_key: Key | None = None, peer_tls: ssl.SSLContext | None = None) -> AgentContext:
    """A real agent's parts under `home`: its weight store, a fetcher writing into it (keeping
    disk_reserve bytes free: None for the default), workers starting servers through `launcher`
    (on listen_host unless a request names another host), and a verifier of what the store holds,
    run at start and every verify_every_s seconds once the server's nursery opens (None: on demand only).
    weights_key opens the encrypted models the store holds (agent/weights/sealed.py); peer_tls holds the CAs a
    peer's certificate is checked with when a fetch goes over TLS (None: the system's)."""
    spawner = Spawner()
    store = Store(home, weights_key)
    store.sweep()  # what a crashed import or commit left half-written
    fetcher = Fetcher(store, secret.decode(), spawner, peer_tls, node=identity.name, reserve=disk_reserve)
    workers = Workers(home, store, spawner, launcher, listen_host, secret=secret)
    verifier = Verifier(store, fetcher, workers.model_corrupt)  # a model found corrupt fails its servers at once
    if verify_every_s is not None:
        spawner(verifier.run, verify_every_s)
    return AgentContext(home=home, identity=identity, secret=secret, version=version, gpu_probe=gpu_probe,
                        store=store, fetcher=fetcher, workers=workers, spawner=spawner,
                        windows=windows, clock=clock,
                        engines=environment.engines() if engines is None else engines, verifier=verifier)


def create_app(ctx: AgentContext) -> BearerAuth:
    app = Starlette(routes=routes.table(ctx), exception_handlers=routes.ERRORS)
    app.state.ctx = ctx
    return BearerAuth(app, ctx.secret)


def route_table(app: ASGIApp) -> list[tuple[str, set[str]]]:
    """(path, methods) of every route, for tests that must try them all."""
    inner = app.app if isinstance(app, BearerAuth) else app
    return [(r.path, set(r.methods or ())) for r in inner.routes if isinstance(r, Route)]  # type: ignore[attr-defined]
