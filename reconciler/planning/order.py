"""What the planner's changes become before they are a plan: deletes made safe (the fleet's last copy
of a digest is deleted only where fleet.yaml lists it under `delete_last_copy`), dependency order,
and a plan limited to some targets with everything they need: their dependencies and their group."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Mapping

from wire.plan_details import DeleteDetails

from reconciler.core.diagnostics import Diagnostic, error, warning
from reconciler.core.observed import ObservedNode
from reconciler.planning.pipeline import group_of
from reconciler.planning.plan import Action, Change

RANK = {Action.REPLICATE: 0, Action.STOP: 1, Action.REPLACE: 2, Action.START: 3, Action.DELETE: 4}

LAST_COPY = "last_copy_delete"


@dataclass(frozen=True, slots=True)
class Guarded:
    """The changes with each delete made safe to run, and what is said about the last copies among
    them: one diagnostic per such delete, at its address, so that a plan limited by --target to
    other changes is not refused by (or told of) a delete it leaves out."""

    changes: list[Change]
    diagnostics: list[Diagnostic]

    def said_for(self, kept: list[Change]) -> list[Diagnostic]:
        addresses = {c.address for c in kept}
        return [d for d in self.diagnostics if d.address in addresses]


def guard(changes: list[Change], nodes: Mapping[str, ObservedNode], allowed: frozenset[str]) -> Guarded:
    """A delete of a digest whose copies are being fetched elsewhere waits for those fetches (a
    failed fetch then skips it); a delete that leaves no verified copy in the fleet, counting every
    node that answered, is a plan error, or with the opt-in a change marked last_copy and a warning.
    A corrupt copy is no copy: deleting one loses nothing, and one left behind keeps nothing."""
    deleting = {(c.node, c.details["digest"]) for c in changes if c.action is Action.DELETE}
    arriving: dict[str, list[str]] = {}
    for c in changes:
        if "peer" in c.details:  # a replicate, or a corrupt replica fetched again: a verified copy to come
            arriving.setdefault(c.details["digest"], []).append(c.address)

    def kept(digest: str | None) -> bool:
        return digest is not None and (digest in arriving or any(
            (name, digest) not in deleting and digest in obs.weights and not obs.weights[digest].corrupt
            for name, obs in nodes.items()))

    out: list[Change] = []
    diags: list[Diagnostic] = []
    for c in changes:
        held = nodes[c.node].weights.get(c.details["digest"]) if c.action is Action.DELETE else None
        if held is None or held.corrupt:
            out.append(c)
            continue
        waits = tuple(a for a in arriving.get(held.digest, ()) if a not in c.depends_on)
        # A slice's bytes can be cut again from a full copy that stays; a full model from no slice.
        if waits or kept(held.digest) or kept(held.slice_of):
            out.append(replace(c, depends_on=c.depends_on + waits) if waits else c)
            continue
        others = sorted(n for n, d in deleting if d == held.digest and n != c.node)
        also = f"; its copies on {', '.join(others)} are deleted by this plan too" if others else ""
        what = f"the fleet's last verified copy of {held.digest} ({c.address})"
        if held.digest in allowed:
            out.append(replace(c, reason=f"{c.reason}; it is the fleet's LAST copy (fleet.yaml: delete_last_copy)",
                               details=DeleteDetails(digest=held.digest, last_copy=True)))
            diags.append(warning(LAST_COPY, f"{c.node} deletes {what}{also}: fleet.yaml lists the digest under "
                                 "delete_last_copy", "Once applied, no node holds these weights: they can only be "
                                 "imported again.", address=c.address))
            continue
        out.append(c)
        diags.append(error(LAST_COPY, f"the plan would delete {what} from {c.node}{also}",
                           f"Keep it: declare it under `models` (format, digest: {held.digest}, source: {c.node}). "
                           f"Or let it go: list {held.digest} under `delete_last_copy` in fleet.yaml. A plan "
                           "limited by --target to other changes is not refused for it.", address=c.address))
    return Guarded(out, diags)


def order(changes: list[Change]) -> list[Change]:
    """Dependency order, then action rank, then address: deterministic output."""
    by_address = {c.address: c for c in changes}
    deps = {c.address: [d for d in c.depends_on if d in by_address] for c in changes}
    waiting = {a: len(ds) for a, ds in deps.items()}
    users: dict[str, list[str]] = {}
    for a, ds in deps.items():
        for d in ds:
            users.setdefault(d, []).append(a)
    ready = [(RANK[c.action], c.address) for c in changes if waiting[c.address] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, address = heapq.heappop(ready)
        c = by_address[address]
        out.append(Change(c.action, c.address, c.node, c.reason, tuple(sorted(set(deps[address]))), c.details,
                          c.drift))
        for u in users.get(address, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (RANK[by_address[u].action], u))
    if len(out) != len(changes):  # a cycle would be a planner bug: fail loudly, never drop work
        raise RuntimeError("dependency cycle among " + ", ".join(sorted(a for a, n in waiting.items() if n)))
    return out


def select(changes: list[Change], targets: tuple[str, ...]) -> list[Change]:
    by_address = {c.address: c for c in changes}
    keep: set[str] = set()
    stack = [c.address for c in changes if any(c.address == t or c.address.startswith(t + "@")
                                                or c.address.startswith(t + ".") for t in targets)]
    groups: dict[str, list[str]] = {}
    for c in changes:
        group = group_of(c)
        if group is not None:
            groups.setdefault(group, []).append(c.address)
    while stack:
        a = stack.pop()
        if a not in keep:
            keep.add(a)
            stack.extend(d for d in by_address[a].depends_on if d in by_address)
            group = group_of(by_address[a])
            stack.extend(groups[group] if group is not None else ())  # a stage never starts without its group
    return [c for c in changes if c.address in keep]
