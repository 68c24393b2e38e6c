"""Changes in the order they may run (dependencies first, then action, then address), and a plan
limited to some targets with everything they need: their dependencies and their whole group."""

from __future__ import annotations

import heapq

from .pipeline_plan import group_of
from .plan import Action, Change

RANK = {Action.REPLICATE: 0, Action.STOP: 1, Action.REPLACE: 2, Action.START: 3, Action.DELETE: 4}


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
