"""Simulated agents for benchmarks and scale tests, clearly labelled as such: one process hosts
many agent apps on distinct loopback addresses, with simulated GPUs, simulated held weights and
a launcher that starts no engine (a server is `running` at once and says `"simulated": true`).
The HTTP stack, authentication, routing and JSON are the real agent's."""

from __future__ import annotations

import ipaddress
import json
import logging
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from starlette.types import ASGIApp, Receive, Scope, Send

from . import __version__
from .app import AgentContext, Spawner, create_app
from .identity import enroll
from .inventory import SimulatedGpus
from .workers import Refused, Server, Workers


class SimulatedWorkers(Workers):
    """Keeps the agent's server table and its refusals (ids, ports, models held), spawns nothing."""

    held: set[str]  # digests the simulation claims, set by simulate() for each agent

    def start(self, body: dict[str, Any]) -> Server:
        sid, digest = body.get("id"), body.get("model")
        if not isinstance(sid, str) or not isinstance(digest, str) or not isinstance(body.get("port"), int):
            raise Refused(400, "bad_request", "id, model and port are required")
        if not self.store.is_present(digest) and digest not in self.held:
            raise Refused(409, "model_not_held", f"model {digest} is not held on this node")
        server = Server(sid, digest, "simulated", body.get("host") or self.default_host, body["port"],
                        body.get("settings") or {}, None, ["(simulated: no process)"], self.logs / f"{sid}.log",
                        state="running", pid=0)
        self.servers[sid] = server
        return server

    async def stop(self, sid: str, grace: float = 0) -> Server:
        server = self.servers.pop(sid, None)
        if server is None:
            raise Refused(404, "server_not_found", f"no server {sid} on this node")
        server.state = "stopped"
        return server


class _ByAddress:
    """One ASGI app that hands each request to the agent app of the address it arrived on."""

    def __init__(self, apps: dict[str, ASGIApp]) -> None:
        self.apps = apps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await self.apps[scope["server"][0]](scope, receive, send)


def build(base: Path, first: str, count: int, secret: bytes, gpus: Path,
          held: list[dict[str, Any]]) -> tuple[dict[str, AgentContext], Spawner]:
    spawner = Spawner()
    start = ipaddress.IPv4Address(first)
    contexts = {}
    for i in range(count):
        address = str(start + i)
        home = base / f"node-{i}"
        ident, _ = enroll(home, f"sim-{i}", __version__)
        ctx = AgentContext(home=home, identity=ident, secret=secret, version=__version__,
                           gpu_probe=SimulatedGpus(gpus), spawner=spawner, listen_host=address,
                           engines={"torch": None, "transformers": None, "llama_cpp": None})
        workers = SimulatedWorkers(home, ctx.store, spawner, address)
        workers.held = {h["digest"] for h in held}
        ctx.workers = workers
        _claim(ctx, held)
        contexts[address] = ctx
    return contexts, spawner


def _claim(ctx: AgentContext, held: list[dict[str, Any]]) -> None:
    """Report `held` models without their bytes: the state lists them, labelled simulated."""
    real = ctx.store.entries

    def entries() -> list[dict[str, Any]]:
        return real() + [{**h, "name": h.get("name", ""), "layers": None, "slice": None,
                          "path": "(simulated)", "simulated": True} for h in held]
    ctx.store.entries = entries  # type: ignore[method-assign]
    present, entry = ctx.store.is_present, ctx.store.entry

    def is_present(digest: str) -> bool:
        return digest in {h["digest"] for h in held} or present(digest)

    def simulated_entry(digest: str) -> dict[str, Any]:
        return next((e for e in entries() if e["digest"] == digest), None) or entry(digest)
    ctx.store.is_present = is_present  # type: ignore[method-assign]
    ctx.store.entry = simulated_entry  # type: ignore[method-assign]


def serve(base: Path, first: str, count: int, port: int, secret: bytes, gpus: Path, held: list[dict[str, Any]]) -> None:
    contexts, spawner = build(base, first, count, secret, gpus, held)
    app = _ByAddress({addr: create_app(ctx) for addr, ctx in contexts.items()})
    config = Config()
    config.bind = [f"{addr}:{port}" for addr in contexts]
    config.accesslog = None
    config.errorlog = logging.getLogger("fleet-agent")
    config.backlog = 1024

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            spawner.nursery = nursery
            await hypercorn_serve(app, config)  # type: ignore[arg-type]

    print(json.dumps({"simulated_agents": count, "first": first, "port": port}), flush=True)
    trio.run(main)
