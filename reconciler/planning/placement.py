"""Members placed from measured inventory: a cluster that asks for `members: {count: N}` gets N
nodes chosen by the planner. Pure, like the planner that calls it: the same inputs, the same nodes.

The rule, in order: a node already running a member stays where it still fits (so two plans of an
unchanged fleet never move one); then nodes that hold the weights (no fetch); then the most memory
free after this plan on the node's best GPU (CPU-only nodes: available memory, then cores); then
the node running the fewest of fleet's servers (spread); then the file's order. Nodes outside an
availability window (the agent's or fleet.yaml's), that do not answer, or whose port the cluster
needs is another cluster's there, are passed over; one member a node. Each placed member's replica
(and its draft's) follows from where it lands. What each placement rests on is said in words, for
the change's reason; a cluster that cannot be placed whole is the plan error placement_failed,
naming what is short and the best candidate's figures.

Placement is tried on the plan's ledger (reconciler/planning/gpus.py), and its trials are undone
before it returns: the planner then checks and assigns the GPUs of every start on that ledger as
for any listed member, each node's GPUs built once a plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from wire.ids import server_id
from wire.plan_details import ServerSettings
from wire.windows import Window, status

from reconciler.core.desired import Desired, ReplicaSpec
from reconciler.core.diagnostics import Diagnostic, error
from reconciler.core.observed import Observed, ObservedNode
from reconciler.planning.gpus import ACTIVE, Archs, Estimates, Ledger, gib
from reconciler.planning.weights import model_bytes


@dataclass(frozen=True, slots=True)
class Placed:
    """fleet.yaml's wishes with every placed cluster's members named, and why each is where it is."""

    desired: Desired
    reasons: dict[tuple[str, str], str]  # (cluster, node) -> "placed on gpu-b: holds the weights; ..."


def place(d: Desired, o: Observed, ok: dict[str, ObservedNode], diags: list[Diagnostic],
          archs: Archs | None = None, ledger: Ledger | None = None, estimates: Estimates | None = None) -> Placed:
    """`ledger`: the plan's, over `ok` and untouched, on which candidates are tried (then undone);
    `estimates`: the plan's, which the assignment then asks the same."""
    placed = [c for c in d.clusters.values() if c.placement is not None]
    if not placed:
        return Placed(d, {})
    ledger = ledger if ledger is not None else Ledger(ok)
    arch_of = archs or Archs(o)
    estimate = estimates or Estimates()
    order = {n: i for i, n in enumerate(d.nodes)}
    ports: dict[str, set[int]] = {}  # node -> ports taken there by listed members
    load: dict[str, int] = {n: sum(1 for s in obs.servers.values() if s.state in ACTIVE) for n, obs in ok.items()}
    for c in d.clusters.values():
        for node in c.members:
            ports.setdefault(node, set()).add(c.port)
    clusters = dict(d.clusters)
    replicas = list(d.replicas)
    held_where = {(r.model, r.node) for r in replicas}
    memory: dict[str, int] = {n: obs.memory_available for n, obs in ok.items()}  # CPU-only nodes, as placed
    serve_port = _serve_port(d)
    reasons: dict[tuple[str, str], str] = {}
    for c in placed:
        assert c.placement is not None
        model = d.models[c.model]
        weights = model_bytes(model, o)
        arch = arch_of(model.digest)
        spec = c.placement
        names = spec.nodes or tuple(d.nodes)
        labels = dict(spec.labels)
        only_cp = model.format == "gguf" or model.encrypted
        passed: list[str] = []  # why candidates were passed over, for the error
        candidates = []
        for n in names:
            ns = d.nodes.get(n)
            if ns is None or any(dict(ns.labels).get(k) != v for k, v in labels.items()):
                continue
            if only_cp and n != d.control_plane.node:
                continue
            obs = ok.get(n)
            if obs is None:
                passed.append(f"{n}: not observed")
                continue
            if not inside(d, n, obs):
                passed.append(f"{n}: outside its availability window")
                continue
            if c.port in ports.get(n, ()) or (n, c.port) == serve_port or c.port == ns.agent_port:
                passed.append(f"{n}: port {c.port} is another cluster's there")
                continue
            candidates.append(n)
        settings = ServerSettings()  # what the estimate reads, as the start's own settings will say it
        if c.settings.context_length is not None:
            settings["context_length"] = c.settings.context_length
        if c.settings.parallel is not None:
            settings["parallel"] = c.settings.parallel

        def gpus_for(n: str) -> int:
            pinned = c.settings.gpus_for(n)
            if pinned:
                return len(pinned)
            tp = c.settings.tensor_parallel
            return max(1, len(ok[n].gpus)) if tp == "auto" else int(tp or 1)

        def need(n: str) -> int:
            return estimate(model.format, weights, arch, settings, gpus_for(n) if ok[n].gpus else 1)["total_bytes"]

        def holds(n: str) -> bool:
            w = ok[n].weights.get(model.digest)
            return w is not None and not w.corrupt

        chosen: list[str] = []
        # A node running a member stays where it still fits: an unchanged one is not checked
        # against itself (its reservation is kept), a changed one gives its share back first.
        for n in candidates:
            if len(chosen) == spec.count:
                break
            srv = ok[n].servers.get(server_id(c.name, n))
            if srv is None or srv.state not in ACTIVE:
                continue
            if srv.model != model.digest:
                ledger.release(n, srv.id)
                if not fits(ledger, n, c.name, need(n), gpus_for(n), c.settings.gpus_for(n), ok[n]):
                    continue
            chosen.append(n)
            reasons[(c.name, n)] = f"stays on {n}: it runs a member there"
        left = [n for n in candidates if n not in chosen]

        def score(n: str) -> tuple[int, int, int, int, int, int]:
            obs = ok[n]
            return (not holds(n), 0 if obs.gpus else 1, -ledger.best_after(n), -memory[n], -obs.cores,
                    load.get(n, 0) * len(order) + order[n])

        shortest = ""
        for n in sorted(left, key=score):
            if len(chosen) == spec.count:
                break
            size = need(n)
            obs = ok[n]
            if obs.gpus:
                got = ledger.assign(n, server_id(c.name, n), size, gpus_for(n), c.settings.gpus_for(n))
                if got.shares is None:
                    shortest = shortest or f"{n}: {got.problem}"
                    continue
                first = got.shares[0]["index"]
                room = next(g.after for g in ledger.gpus(n) if g.index == first)
                where = (f"GPU {','.join(str(s['index']) for s in got.shares)} "
                         f"{'has' if len(got.shares) == 1 else f'(of GPU {first}) has'} {gib(room)} free after this plan")
            else:
                if size > memory[n]:
                    shortest = shortest or (f"{n}: needs {gib(size)} of memory, {gib(memory[n])} "
                                            f"available ({obs.cores} cores)")
                    continue
                memory[n] -= size
                where = f"{gib(memory[n])} of memory available after it, {obs.cores} cores"
            fetch = "holds the weights" if holds(n) else f"fetches the weights ({weights:,} bytes)"
            reasons[(c.name, n)] = f"placed on {n}: {fetch}; {where}"
            chosen.append(n)
            load[n] = load.get(n, 0) + 1
        if len(chosen) < spec.count:
            short = [f"the best candidate left, {shortest}"] if shortest else []
            short += passed[:5] + ([f"and {len(passed) - 5} more passed over"] if len(passed) > 5 else [])
            diags.append(error(
                "placement_failed", f"cluster {c.name!r} asks for {spec.count} member(s) of {model.name!r} "
                f"(about {gib(estimate(model.format, weights, arch, settings, 1)['total_bytes'])} each on one GPU "
                f"or in memory) but only {len(chosen)} could be placed"
                + (f" ({', '.join(chosen)})" if chosen else "") + (": " + "; ".join(short) if short else
                                                                   ": no candidate node"),
                "Free memory on the candidates, add nodes (or widen members.nodes / members.labels), or lower "
                "members.count.", address=f"clusters.{c.name}"))
        members = tuple(sorted(chosen, key=lambda n: order[n]))
        # A candidate that holds the weights keeps them, member or not: the next placement may want
        # them there, and a node passed over (outside its window) is not changed for it.
        keep = [n for n in names if n in ok and n not in members and holds(n) and n in d.nodes]
        for n in keep:
            if (c.model, n) not in held_where and model.source != n:
                replicas.append(ReplicaSpec(model=c.model, node=n))
                held_where.add((c.model, n))
        for n in members:
            ports.setdefault(n, set()).add(c.port)
            wanted = [c.model] + ([c.settings.speculative.draft] if c.settings.speculative is not None
                                  and c.settings.speculative.draft else [])
            for m in wanted:
                if (m, n) not in held_where and d.models[m].source != n:
                    replicas.append(ReplicaSpec(model=m, node=n))
                    held_where.add((m, n))
        clusters[c.name] = replace(c, members=members)
    ledger.reset()
    return Placed(replace(d, clusters=clusters, replicas=tuple(replicas)), reasons)


def fits(ledger: Ledger, node: str, cluster: str, size: int, n: int, pinned: tuple[int, ...] | None,
         obs: ObservedNode) -> bool:
    """Reserved on `ledger` when it fits (GPUs), or within the node's available memory (CPU only)."""
    if not obs.gpus:
        return size <= obs.memory_available
    return ledger.assign(node, server_id(cluster, node), size, n, pinned).shares is not None


def inside(d: Desired, name: str, obs: ObservedNode) -> bool:
    """Inside both windows: the agent's own and fleet.yaml's `available`, at the node's clock."""
    if not obs.inside_window:
        return False
    spec = d.nodes[name]
    if spec.available and obs.observed_at:
        now = datetime.fromisoformat(obs.observed_at)
        return bool(status(tuple(Window.parse(w) for w in spec.available), now)["inside"])
    return True


def _serve_port(d: Desired) -> tuple[str, int]:
    return d.control_plane.node, int(d.control_plane.listen.rsplit(":", 1)[1])


def members_of(d: Desired, o: Observed, cluster: str) -> tuple[str, ...]:
    """A cluster's members as serve sees them: fleet.yaml's names, or for a placed cluster the nodes
    (in the file's order) whose agents report its server CLUSTER@NODE, the truth once applied."""
    c = d.clusters[cluster]
    if c.placement is None:
        return c.members
    return tuple(n for n in d.nodes if n in o.nodes and server_id(cluster, n) in o.nodes[n].servers)
