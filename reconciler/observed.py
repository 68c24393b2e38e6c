"""What the agents reported, as frozen values: the planner's second argument. Built from a
snapshot (the JSON `fleet observe -o` writes), so a plan can be made again with no network."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

SNAPSHOT_FORMAT = "1.0"


@dataclass(frozen=True, slots=True)
class HeldModel:
    digest: str
    format: str
    bytes: int
    slice_of: str | None = None
    layers: str | None = None


@dataclass(frozen=True, slots=True)
class ObservedServer:
    id: str
    state: str
    model: str
    port: int
    settings: dict[str, Any]
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class ObservedNode:
    name: str
    error_code: str | None = None  # node_unreachable, node_auth_rejected, agent_protocol_error
    error: str | None = None
    identity: str | None = None
    observed_at: str | None = None  # the agent's own clock, with its UTC offset
    disk_free: int = 0
    gpus: tuple[tuple[str, int, int], ...] = ()  # (name, free bytes, total bytes)
    simulated: bool = False
    inside_window: bool = True
    windows: tuple[str, ...] = ()
    weights: dict[str, HeldModel] = field(default_factory=dict)
    fetching: frozenset[str] = frozenset()
    servers: dict[str, ObservedServer] = field(default_factory=dict)
    fingerprint: str = ""

    @property
    def ok(self) -> bool:
        return self.error_code is None


@dataclass(frozen=True, slots=True)
class Observed:
    nodes: dict[str, ObservedNode]
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)  # full manifests of sliced models


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
        weights[w["digest"]] = HeldModel(w["digest"], w.get("format", ""), int(w.get("bytes", 0)),
                                         sl.get("of"), sl.get("layers"))
    servers = {s["id"]: ObservedServer(s["id"], s.get("state", ""), s.get("model", ""), int(s.get("port", 0)),
                                       dict(s.get("settings") or {}), s.get("reason"))
               for s in state.get("servers", [])}
    return ObservedNode(
        name=name, identity=state.get("identity", {}).get("id"), observed_at=state.get("observed_at"),
        disk_free=int(inv.get("disk", {}).get("free_bytes", 0)),
        gpus=tuple((g["name"], int(g["memory_free_bytes"]), int(g["memory_total_bytes"])) for g in inv.get("gpus", [])),
        simulated=bool(inv.get("simulated")), inside_window=bool(avail.get("inside", True)),
        windows=tuple(avail.get("windows", [])), weights=weights,
        fetching=frozenset(f["digest"] for f in state.get("fetches", [])), servers=servers,
        fingerprint=fingerprint(state))


def from_snapshot(snapshot: dict[str, Any]) -> Observed:
    nodes = {}
    for name, entry in snapshot.get("nodes", {}).items():
        if entry.get("state") is not None:
            nodes[name] = node_from_state(name, entry["state"])
        else:
            err = entry.get("error") or {}
            nodes[name] = ObservedNode(name=name, error_code=err.get("code", "node_unreachable"),
                                       error=err.get("message", "no answer"))
    return Observed(nodes=nodes, manifests=dict(snapshot.get("manifests", {})))
