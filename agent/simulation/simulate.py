"""Simulated agents for benchmarks and scale tests, clearly labelled as such: one process hosts
many agent apps on distinct loopback addresses, each assembled from the real agent's parts but
three: simulated GPUs, a store that also claims to hold some models (listed with "simulated":
true), and a launcher that starts no engine (pid 0, answering its health check at once, so a
server is `running` within a moment of its start). Authentication, routing, JSON, the workers'
checks and their supervision are the real agent's, and so is the server in front: net's server with
the agent's connection policy (agent/api/server.py agent_server), one for all the agents of the
process, with one cap from the process's descriptor limit. The machine is measured once for all
the agents of the process."""

from __future__ import annotations

import ipaddress
import json
import math
import signal
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, cast

import trio
from starlette.types import ASGIApp, Receive, Scope, Send

from host.descriptors import raise_descriptor_limit
from net import sockio
from wire.state import Inventory, WeightsEntry

from agent import __version__
from agent.api.context import AgentContext
from agent.api.server import Spawner, agent_server, connection_cap
from agent.app import create_app
from agent.backends.asgi import answer_lifespan
from agent.transfer.fetch import Fetcher
from agent.machine.identity import Identity
from agent.machine.inventory import GpuProbe, SimulatedGpus, measure
from agent.weights.store import Store
from agent.serving.supervisor import Workers

ENGINES: dict[str, Any] = {"torch": None, "transformers": None, "llama_cpp": None}


class SimulatedProcess:
    """A worker that is not there: it runs until signalled, then exits as a killed process would."""

    pid = 0

    def __init__(self) -> None:
        self.code: int | None = None
        self.exited = trio.Event()

    def poll(self) -> int | None:
        return self.code

    async def wait(self) -> int:
        await self.exited.wait()
        assert self.code is not None
        return self.code

    def send_signal(self, sig: int) -> None:
        if self.code is None:
            self.code = -sig
            self.exited.set()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class SimulatedLauncher:
    """Every engine counts as installed, every port as free, nothing is started, and every server
    answers at once."""

    def missing(self, modules: Sequence[str]) -> list[str]:
        return []

    def port_problem(self, host: str, port: int) -> str | None:
        return None

    async def launch(self, argv: Sequence[str], log: Path, env: Mapping[str, str],
                     keep_fds: Sequence[int] = ()) -> SimulatedProcess:
        return SimulatedProcess()

    async def answers(self, url: str, credential: str) -> bool:
        return True


class ClaimedStore:
    """A real Store seen with some models claimed on top: reported held (labelled simulated) and
    servable, with no bytes behind them. Fetches still write into the real store underneath."""

    def __init__(self, store: Store, claims: Sequence[dict[str, Any]]) -> None:
        self.store = store
        # A claim comes as JSON from the command line (digest, format, bytes); completed here it
        # has every field of a weights entry, which the cast records.
        self.claims = {c["digest"]: cast(WeightsEntry, {**c, "name": c.get("name", ""), "layers": None, "slice": None,
                                                        "path": "(simulated)", "simulated": True}) for c in claims}

    def blob_path(self, sha: str) -> Path:
        return self.store.blob_path(sha)

    def is_present(self, digest: str) -> bool:
        return digest in self.claims or self.store.is_present(digest)

    def manifest_bytes(self, digest: str) -> bytes:
        return self.store.manifest_bytes(digest)  # a claimed model has no manifest to give a peer

    def entry(self, digest: str) -> WeightsEntry:
        claimed = self.claims.get(digest)
        return claimed.copy() if claimed is not None else self.store.entry(digest)

    def entries(self) -> list[WeightsEntry]:
        return self.store.entries() + [c.copy() for c in self.claims.values()]

    def digests(self) -> Iterator[str]:
        yield from self.store.digests()
        yield from self.claims

    def delete(self, digest: str) -> None:
        if self.claims.pop(digest, None) is None:
            self.store.delete(digest)


class _ByAddress:
    """One ASGI app that hands each request to the agent app of the address it arrived on."""

    def __init__(self, apps: Mapping[str, ASGIApp]) -> None:
        self.apps = apps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        await self.apps[scope["server"][0]](scope, receive, send)


class SharedMachine:
    """The one machine all the simulated agents of a process run on, measured at most once a
    second for them all (each under its own home): a real agent measures its own machine, and
    10,000 measurements of this one per heartbeat only slowed the benches down."""

    def __init__(self, every: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self.at, self.last = -math.inf, cast(Inventory, {})

    def __call__(self, home: Path, probe: GpuProbe, *, reserve: int = 0) -> Inventory:
        if self.clock() - self.at >= self.every:
            self.last, self.at = measure(home, probe), self.clock()
        return {**self.last, "disk": {**self.last["disk"], "path": str(home), "reserve_bytes": reserve}}


MACHINE = SharedMachine()
STARTED = datetime.now(timezone.utc).isoformat(timespec="seconds")


def simulated_agent(home: Path, name: str, address: str, secret: bytes, gpus: Path,
                    held: Sequence[dict[str, Any]], spawner: Spawner) -> AgentContext:
    """One simulated agent, assembled like app.assemble() with the simulated store view and launcher."""
    # Kept in memory, named after the address (the same across restarts): enrolment's fsync per
    # agent made starting 10,000 of them take minutes.
    home.mkdir(parents=True, exist_ok=True)
    ident = Identity(uuid.uuid5(uuid.NAMESPACE_URL, f"fleet-simulated:{address}").hex, name, STARTED, __version__)
    store = Store(home)
    claimed = ClaimedStore(store, held)
    return AgentContext(home=home, identity=ident, secret=secret, version=__version__,
                        gpu_probe=SimulatedGpus(gpus), store=claimed,
                        fetcher=Fetcher(store, secret.decode(), spawner),
                        workers=Workers(home, claimed, spawner, SimulatedLauncher(), address),
                        spawner=spawner, engines=dict(ENGINES), measure=MACHINE)


def build(base: Path, first: str, count: int, secret: bytes, gpus: Path,
          held: Sequence[dict[str, Any]]) -> tuple[dict[str, AgentContext], Spawner]:
    """`count` simulated agents on consecutive addresses from `first`, sharing one spawner."""
    spawner = Spawner()
    start = ipaddress.IPv4Address(first)
    contexts = {}
    for i in range(count):
        address = str(start + i)
        contexts[address] = simulated_agent(base / f"node-{i}", f"sim-{i}", address, secret, gpus, held, spawner)
    return contexts, spawner


def serve(base: Path, first: str, count: int, port: int, secret: bytes, gpus: Path,
          held: Sequence[dict[str, Any]]) -> None:
    contexts, spawner = build(base, first, count, secret, gpus, held)
    apps = {addr: create_app(ctx) for addr, ctx in contexts.items()}
    nofile = raise_descriptor_limit()
    listeners = [sock for addr in contexts for sock in sockio.listen(addr, port)]
    # One cap for the process: what its descriptors allow once every agent's listener has one.
    # The agents share the cluster secret, so any one of them says whether a request carries it.
    server = agent_server(_ByAddress(apps), connection_cap(nofile - len(listeners)), "simulated",
                          admits=next(iter(apps.values())).admits)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            spawner.nursery = nursery
            await server.serve(listeners, trio.Event())

    print(json.dumps({"simulated_agents": count, "first": first, "port": port}), flush=True)
    trio.run(main)
