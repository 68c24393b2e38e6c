"""What the agents reported, as frozen values: what observe() returns and the planner, the
heartbeat, the router and `fleet nodes` read. Each node keeps the state it was built from, so that
the snapshot (the JSON `fleet observe -o` writes) round-trips and a plan can be made again with no
network."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from wire import live
from wire.live import Live

SNAPSHOT_FORMAT = "1.0"


@dataclass(frozen=True, slots=True)
class HeldModel:
    digest: str
    format: str
    bytes: int
    slice_of: str | None = None
    layers: str | None = None
    name: str = ""
    path: str = ""  # where the agent keeps it: scrubbed from answers relayed to clients
    corrupt: str | None = None  # the agent's verification found it bad: "FILE: REASON"
    key_missing: str | None = None  # encrypted under this key id, which its agent does not hold
    # What the KV cache is sized from, where the agent reports the model's architecture
    # (`architecture` in its weights entry: layers, kv_heads, head_dim, kv_dtype_bytes): None when it does not.
    arch: tuple[int, int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class ObservedServer:
    id: str
    state: str
    model: str
    port: int
    settings: dict[str, Any]
    reason: str | None = None
    group: str | None = None  # the pipeline group a stage was started in (its `pipeline.group`)
    # What its worker asks of every request (the router sends it); its shape is the schema's, so it
    # cannot carry a line break into a request head.
    credential: str = field(default="", repr=False)
    # The GPUs its agent gave it and the bytes reserved on each, (index, uuid, bytes), as the start
    # asked (wire.state.ServerEntry.gpus): fleet's own share of each GPU in the planner's ledger.
    gpus: tuple[tuple[int, str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ObservedNode:
    name: str
    error_code: str | None = None  # node_unreachable, node_auth_rejected, agent_protocol_error
    error: str | None = None
    identity: str | None = None
    observed_at: str | None = None  # the agent's own clock, with its UTC offset
    disk_free: int = 0
    disk_reserve: int = 0  # of disk_free, what the agent keeps free (its fetches never use it)
    gpus: tuple[tuple[str, int, int], ...] = ()  # (name, free bytes, total bytes)
    simulated: bool = False
    inside_window: bool = True
    windows: tuple[str, ...] = ()
    weights: dict[str, HeldModel] = field(default_factory=dict)
    fetching: frozenset[str] = frozenset()
    servers: dict[str, ObservedServer] = field(default_factory=dict)
    agent_version: str = ""
    accelerator: str = ""
    home: str = ""  # the agent's home directory (the disk it reports on)
    state: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # as the agent sent it
    # The agent's name for this state: asked again with it, an agent whose state has not changed
    # answers 304 and this very node is kept (observe.py), with no parsing or checking.
    generation: str | None = field(default=None, compare=False)
    # fingerprint(state) where it is known already: kept with the state (obscache.py) and carried
    # by brought_up (a generation covers everything a fingerprint reads).
    known_fingerprint: str = field(default="", compare=False, repr=False)
    # Beside `gpus`, in the same order: each GPU's (index, uuid) as the inventory names them.
    gpu_ids: tuple[tuple[int, str], ...] = ()
    cores: int = 0  # usable CPU cores, and the memory available now: what CPU-only placement weighs
    memory_available: int = 0

    @property
    def ok(self) -> bool:
        return self.error_code is None

    @property
    def fingerprint(self) -> str:
        """fingerprint(state), computed when asked (the planner asks, the heartbeat never does)
        unless known already."""
        if self.known_fingerprint:
            return self.known_fingerprint
        return fingerprint(self.state) if self.state is not None else ""

    def snapshot_entry(self) -> dict[str, Any]:
        """This node in a snapshot: its state, or the error that stood in for it."""
        if self.error_code is not None:
            return {"state": None, "error": {"code": self.error_code, "message": self.error or ""}}
        return {"state": self.state, "error": None}


@dataclass(frozen=True, slots=True)
class Observed:
    nodes: dict[str, ObservedNode]
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)  # full manifests of sliced models

    def to_snapshot(self) -> dict[str, Any]:
        return {"format_version": SNAPSHOT_FORMAT,
                "nodes": {name: self.nodes[name].snapshot_entry() for name in sorted(self.nodes)},
                "manifests": self.manifests}


def fingerprint(state: dict[str, Any]) -> str:
    """What, if it changed between plan and apply, makes a saved plan stale: the identity, the
    models held and the servers with their state. Not free memory or disk, which always move."""
    core = {
        "identity": state.get("identity", {}).get("id"),
        "weights": sorted(w.get("digest", "") for w in state.get("weights", [])),
        "servers": sorted((s.get("id"), s.get("state"), s.get("model"), s.get("port"),
                           json.dumps(s.get("settings"), sort_keys=True)) for s in state.get("servers", [])),
    }
    return "sha256:" + hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def node_from_state(name: str, state: dict[str, Any]) -> ObservedNode:
    inv = state.get("inventory", {})
    avail = state.get("availability", {})
    weights = {}
    for w in state.get("weights", []):
        sl = w.get("slice") or {}
        integrity = w.get("integrity") or {}
        corrupt = f"{integrity.get('file')}: {integrity.get('reason')}" if integrity.get("state") == "corrupt" else None
        sealed = w.get("encryption") or {}
        weights[w["digest"]] = HeldModel(w["digest"], w.get("format", ""), int(w.get("bytes", 0)),
                                         sl.get("of"), sl.get("layers"), w.get("name") or "", w.get("path") or "",
                                         corrupt, None if sealed.get("key_held", True) else str(sealed.get("key_id")),
                                         _arch(w.get("architecture")))
    servers = {s["id"]: ObservedServer(s["id"], s.get("state", ""), s.get("model", ""), int(s.get("port", 0)),
                                       dict(s.get("settings") or {}), s.get("reason"),
                                       (s.get("pipeline") or {}).get("group"), s.get("credential") or "",
                                       tuple((int(g["index"]), str(g.get("uuid", "")), int(g["bytes"]))
                                             for g in s.get("gpus") or ()))
               for s in state.get("servers", [])}
    if any("credential" in s for s in state.get("servers", [])):
        # Workers' credentials stay here, for the router: the state goes on into snapshots (fleet
        # observe -o) and the state store, which must not carry them.
        state = {**state, "servers": [{k: v for k, v in s.items() if k != "credential"} for s in state["servers"]]}
    return ObservedNode(
        name=name, identity=state.get("identity", {}).get("id"), observed_at=state.get("observed_at"),
        disk_free=int(inv.get("disk", {}).get("free_bytes", 0)),
        disk_reserve=int(inv.get("disk", {}).get("reserve_bytes", 0)),
        gpus=tuple((g["name"], int(g["memory_free_bytes"]), int(g["memory_total_bytes"])) for g in inv.get("gpus", [])),
        simulated=bool(inv.get("simulated")), inside_window=bool(avail.get("inside", True)),
        windows=tuple(avail.get("windows", [])), weights=weights,
        fetching=frozenset(f["digest"] for f in state.get("fetches", [])), servers=servers,
        agent_version=state.get("agent_version", ""),
        accelerator=state.get("variant", {}).get("accelerator", ""), home=inv.get("disk", {}).get("path", ""),
        state=state, generation=state.get("generation"), known_fingerprint=fingerprint(state),
        gpu_ids=tuple((int(g.get("index", i)), str(g.get("uuid", ""))) for i, g in enumerate(inv.get("gpus", []))),
        cores=int(inv.get("cores", {}).get("usable", 0)),
        memory_available=int(inv.get("memory", {}).get("available_bytes", 0)))


def _arch(a: Any) -> tuple[int, int, int, int] | None:
    """(layers, kv_heads, head_dim, kv_dtype_bytes) from a weights entry's `architecture`, if whole."""
    if not isinstance(a, dict):
        return None
    try:
        got = (int(a["layers"]), int(a["kv_heads"]), int(a["head_dim"]), int(a.get("kv_dtype_bytes", 2)))
    except (KeyError, TypeError, ValueError):
        return None
    return got if all(v > 0 for v in got) else None


def brought_up(node: ObservedNode, values: Live | None) -> ObservedNode | None:
    """`node`, held at a generation its agent has just confirmed (a 304), with the moving values
    that 304 carried: what a 200 would have made of it now. None when they do not fit the state
    held (or there are none): the state must then be asked for whole."""
    if values is None or node.state is None or not live.fits(node.state, values):
        return None
    # Built field by field: dataclasses.replace's generic walk was a third of a warm plan's cost here.
    return ObservedNode(name=node.name, identity=node.identity, observed_at=values.observed_at,
                        disk_free=values.disk_free, disk_reserve=node.disk_reserve,
                        gpus=tuple((g[0], free, g[2]) for g, free in zip(node.gpus, values.gpus_free)),
                        simulated=node.simulated, inside_window=node.inside_window, windows=node.windows,
                        weights=node.weights, fetching=node.fetching, servers=node.servers,
                        agent_version=node.agent_version, accelerator=node.accelerator, home=node.home,
                        state=live.brought_up(node.state, values), generation=node.generation,
                        known_fingerprint=node.known_fingerprint, gpu_ids=node.gpu_ids, cores=node.cores,
                        memory_available=values.memory_available)


# The fields of a node as obscache.py keeps them, by position: rebuilding a node from them costs a
# third of reading its state again (node_from_state's lookups), 10,000 times in a warm plan.
Fields = tuple[Any, ...]


def node_fields(node: ObservedNode) -> Fields:
    """What node_from_fields() takes back, with its fingerprint and no workers' credentials."""
    return (node.identity, node.observed_at, node.disk_free, node.disk_reserve, node.gpus, node.simulated,
            node.inside_window, node.windows,
            {d: (m.digest, m.format, m.bytes, m.slice_of, m.layers, m.name, m.path, m.corrupt, m.key_missing, m.arch)
             for d, m in node.weights.items()},
            node.fetching,
            {i: (s.id, s.state, s.model, s.port, s.settings, s.reason, s.group, "", s.gpus)
             for i, s in node.servers.items()},
            node.agent_version, node.accelerator, node.home, node.generation, node.fingerprint,
            node.gpu_ids, node.cores, node.memory_available)


def node_from_fields(name: str, state: dict[str, Any], fields: Fields) -> ObservedNode:
    """The node node_fields() was taken from (its workers' credentials aside), with `state`."""
    (identity, observed_at, disk_free, disk_reserve, gpus, simulated, inside_window, windows, weights, fetching,
     servers, agent_version, accelerator, home, generation, known, gpu_ids, cores, memory_available) = fields
    return ObservedNode(name, None, None, identity, observed_at, disk_free, disk_reserve, gpus, simulated,
                        inside_window, windows, {d: HeldModel(*m) for d, m in weights.items()}, fetching,
                        {i: ObservedServer(*s) for i, s in servers.items()}, agent_version, accelerator, home,
                        state, generation, known, gpu_ids, cores, memory_available)


def node_from_entry(name: str, entry: dict[str, Any]) -> ObservedNode:
    """A node from its snapshot entry: {"state": ..., "error": null} or {"state": null, "error": {code, message}}."""
    if entry.get("state") is not None:
        return node_from_state(name, entry["state"])
    err = entry.get("error") or {}
    return ObservedNode(name=name, error_code=err.get("code", "node_unreachable"),
                        error=err.get("message", "no answer"))


def from_snapshot(snapshot: dict[str, Any]) -> Observed:
    nodes = {name: node_from_entry(name, entry) for name, entry in snapshot.get("nodes", {}).items()}
    return Observed(nodes=nodes, manifests=dict(snapshot.get("manifests", {})))
