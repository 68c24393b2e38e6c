"""A pipeline cluster's stages planned as one group: pure, like the planner that calls it.

The stages of a pipeline need each other to exist (a stage is running only once the group has
formed), so they are never changed one at a time: either every stage stays as it is, or every
stage is started again, together, with the same group id. That id is a digest of everything the
stages agree on, so a stage that reports another id belongs to a group that no longer exists."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from wire.ids import server_address, server_id
from wire.layers import LayerRange
from wire.plan_details import PipelineDetails, Rendezvous, ReplaceDetails, RunningServer, ServerSettings, Stage, \
    StartDetails

from reconciler.core.desired import ClusterSpec, ModelSpec
from reconciler.core.observed import ObservedServer
from reconciler.planning.plan import Action, Change

ACTIVE = ("starting", "running")  # states a stage is stopped from before it starts again


@dataclass(frozen=True, slots=True)
class StageInput:
    """What the planner knows of one stage: where it runs, its slice, its settings, what it waits
    for, and the server its node reports for it (None: none)."""

    node: str
    address: str
    layers: LayerRange
    digest: str  # the slice's
    settings: ServerSettings
    deps: tuple[str, ...]
    current: ObservedServer | None


def group_id(model: ModelSpec, port: int, rendezvous: Rendezvous, stages: list[StageInput]) -> str:
    """16 hex digits of sha256 over the canonical JSON of what every stage must agree on."""
    canonical = {"model": model.digest, "port": port, "rendezvous": rendezvous,
                 "stages": [{"node": s.node, "address": s.address, "layers": str(s.layers), "digest": s.digest,
                             "settings": s.settings} for s in stages]}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def plan_group(c: ClusterSpec, model: ModelSpec, stages: list[StageInput],
               diff: Callable[[Mapping[str, Any], Mapping[str, Any]], list[str]]) -> list[Change]:
    """The changes for every stage of pipeline `c`, or none when every stage runs as planned.
    `diff` is the planner's settings_diff (old, new) -> readable differences."""
    assert c.pipeline is not None and stages
    rendezvous = Rendezvous(address=stages[0].address, port=c.pipeline.rendezvous_port)
    group = group_id(model, c.port, rendezvous, stages)
    listed = [Stage(node=s.node, address=s.address, layers=str(s.layers)) for s in stages]
    world = len(stages)
    own: list[tuple[str, str]] = []  # per stage: (status, what is wrong with it, for people)
    for s in stages:
        cur = s.current
        if cur is None:
            own.append(("absent", f"{s.node} runs no server of cluster {c.name}"))
        elif cur.state not in ACTIVE:
            why = cur.reason.splitlines()[0] if cur.reason else "no reason reported"
            own.append(("down", f"its server {cur.state}: {why}"))
        else:
            diffs = diff(cur.settings, s.settings)
            if cur.model != s.digest:
                diffs.insert(0, f"model {cur.model[:19]}… → {s.digest[:19]}…")
            if cur.port != c.port:
                diffs.insert(0, f"port {cur.port} → {c.port}")
            own.append(("changed", "changed: " + "; ".join(diffs)) if diffs else ("same", ""))
    if all(status == "same" for status, _ in own):
        # Nothing of a stage changed, but its group did (members added, removed or moved).
        own = [("same", "") if s.current is None or s.current.group == group else
               ("changed", f"changed: pipeline group {s.current.group or 'unset'} → {group}") for s in stages]
        if all(status == "same" for status, _ in own):
            return []
    rank, (status, what) = next((r, o) for r, o in enumerate(own) if o[0] != "same")
    culprit = {"absent": f"stage {rank} on {stages[rank].node} is not running", "changed":
               f"stage {rank} on {stages[rank].node} changed", "down": f"stage {rank} on {stages[rank].node} "
               + what.removeprefix("its server ")}[status]
    changes = []
    for rank, (s, (status, what)) in enumerate(zip(stages, own)):
        details = StartDetails(cluster=c.name, server_id=server_id(c.name, s.node), model=model.name,
                               digest=s.digest, port=c.port, host=s.address, settings=s.settings,
                               pipeline=PipelineDetails(group=group, rank=rank, world_size=world,
                                                        rendezvous=rendezvous, stages=listed))
        reason = f"stage {rank} of {world} (layers {s.layers}): " + (what or f"restarts with its group: {culprit}")
        address = server_address(c.name, s.node)
        cur = s.current
        if cur is not None and cur.state in ACTIVE:
            before = RunningServer(model=cur.model, port=cur.port, settings=cur.settings)
            if cur.group:
                before["group"] = cur.group
            changes.append(Change(Action.REPLACE, address, s.node, reason, s.deps,
                                  ReplaceDetails(**details, before=before)))
        else:
            changes.append(Change(Action.START, address, s.node, reason, s.deps, details, drift=status == "down"))
    return changes


def group_of(change: Change) -> str | None:
    """The pipeline group a start or replace belongs to (None: not a pipeline stage)."""
    pipeline = change.details.get("pipeline")
    return str(pipeline["group"]) if isinstance(pipeline, dict) else None
