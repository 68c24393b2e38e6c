"""What every route reads, handed in whole (`AgentContext`: the store, the fetcher, the workers, the
clock and the GPU probe), the state it assembles, and the generation that lets an unchanged state be
answered 304."""

from __future__ import annotations

import hashlib
import json
import marshal
import ssl
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from wire.state import AgentState, Inventory
from wire.windows import Window, status

from agent.machine import environment, inventory
from agent.machine.identity import Identity
from agent.transfer.fetch import Fetcher
from agent.weights.store import Store, WeightStore
from agent.weights.verify import Verifier
from agent.serving.supervisor import Workers
from agent.api.server import Spawner


def local_now() -> datetime:
    return datetime.now().astimezone()


@dataclass
class AgentContext:
    """Everything the routes read, handed in whole: the store, the fetcher and the workers are
    built by whoever assembles the agent (assemble() below, or agent/simulation/simulate.py); the clock and the
    GPU probe are seams for tests."""

    home: Path
    identity: Identity
    secret: bytes
    version: str
    gpu_probe: inventory.GpuProbe
    store: WeightStore
    fetcher: Fetcher
    workers: Workers
    spawner: Spawner
    windows: tuple[Window, ...] = ()
    clock: Callable[[], datetime] = local_now
    engines: dict[str, Any] = field(default_factory=environment.engines)
    # The machine now (inventory.measure); agent/simulation/simulate.py's agents share one machine, measured
    # once for them all.
    measure: Callable[..., Inventory] = inventory.measure
    verifier: Verifier | None = None  # None where there are no bytes to verify (a simulated agent)
    generations: Generations = field(default_factory=lambda: Generations())  # what GET /v1/state names

    def state(self) -> AgentState:
        now = self.clock()
        inv = self.measure(self.home, self.gpu_probe, reserve=self.fetcher.reserve)
        # A build that cannot use the GPUs present (or the reverse) is told at once, with what to install.
        findings = environment.state_findings(len(inv["gpus"]), inv["gpu_note"], self.engines)
        return {
            "identity": {"id": self.identity.id, "name": self.identity.name,
                         "enrolled_at": self.identity.enrolled_at},
            "agent_version": self.version,
            "variant": {"accelerator": environment.variant(self.engines), **self.engines,
                        **({"findings": findings} if findings else {})},
            "inventory": inv,
            "availability": status(self.windows, now),
            "observed_at": now.isoformat(),
            "weights": self.store.entries(),
            "fetches": [j.to_json() for j in self.fetcher.active()],
            "servers": [s.to_json() for s in self.workers.servers.values()],
            "link_rates": self.fetcher.rates.to_json(),
        }


STEP = 256 << 20  # free disk and GPU memory, as the state's generation counts them


def _core(state: AgentState) -> dict[str, Any]:
    inv = state["inventory"]
    return {**state, "observed_at": None, "servers": [{**s, "uptime_s": None} for s in state["servers"]],
            "inventory": {**inv, "memory": {**inv["memory"], "available_bytes": None},
                          "disk": {**inv["disk"], "free_bytes": inv["disk"]["free_bytes"] // STEP},
                          "gpus": [{**g, "memory_free_bytes": g["memory_free_bytes"] // STEP} for g in inv["gpus"]]}}


def _name(core: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(core, sort_keys=True, default=str).encode()).hexdigest()[:32]


def generation(state: AgentState) -> str:
    """A name for what the control plane acts on in `state`, so that GET /v1/state can answer 304
    to a control plane that already holds it (its heartbeat then neither parses nor checks it):
    the state less its clock, each server's uptime and the host's available memory, with free disk
    and GPU memory counted in 256 MiB steps (a smaller change is not news)."""
    return _name(_core(state))


class Generations:
    """generation() of each state asked about, with the last one's name kept: a state whose
    generation covers the same bytes (marshal's version 2: values and their types, in order, with
    no references or interning marks that vary between equal values) has it back without the JSON
    and the hash, 4 of the 24 us a 304 spent on it. The kept bytes are a copy: nothing changed in
    place afterwards can make a changed state look kept. A state marshal cannot write is named whole.
    marshal writes any buffer (bytes, bytearray, memoryview) as plain bytes, so those three would
    look alike here; a state is JSON (a dict of JSON values), which holds none of them."""

    __slots__ = ("kept", "name")

    def __init__(self) -> None:
        self.kept, self.name = b"", ""

    def __call__(self, state: AgentState) -> str:
        core = _core(state)
        try:
            key = marshal.dumps(core, 2)
        except ValueError:  # a value marshal does not write (json.dumps names it by str())
            return _name(core)
        if key != self.kept:
            self.kept, self.name = key, _name(core)
        return self.name
