"""Which weights each node should hold (whole models and slices), and the fetches that bring them there."""

from __future__ import annotations

from dataclasses import dataclass

from wire import manifest as mf
from wire.ids import replica_address
from wire.layers import LayerRange
from wire.plan_details import ReplicateDetails

from reconciler.planning import fanout
from reconciler.core.diagnostics import Diagnostic, error
from reconciler.core.desired import Desired, ModelSpec
from reconciler.core.observed import Observed, ObservedNode
from reconciler.planning.plan import Action, Change


@dataclass(frozen=True, slots=True)
class Want:
    """A node should hold `digest` (a whole model, or a slice with `layers` of `source_digest`)."""

    model: ModelSpec
    digest: str
    bytes: int
    layers: LayerRange | None = None
    source_digest: str | None = None

    @property
    def address_model(self) -> str:
        return self.model.name if self.layers is None else f"{self.model.name}[{self.layers}]"


def wants(d: Desired, o: Observed, diags: list[Diagnostic]) -> dict[str, dict[str, Want]]:
    """node → digest → Want, for every replica, every source, every model a member serves, and
    each cluster's LoRA adapter on every member of it (on a pipeline's stages, the slice of it for
    their layers)."""
    out: dict[str, dict[str, Want]] = {n: {} for n in d.nodes}
    for m in d.models.values():
        out[m.source][m.digest] = Want(m, m.digest, model_bytes(m, o))
    for r in d.replicas:
        m = d.models[r.model]
        if r.layers is None:
            out[r.node][m.digest] = Want(m, m.digest, model_bytes(m, o))
            continue
        full = o.manifests.get(m.digest)
        if full is None:
            diags.append(error("source_missing", f"cannot plan layers {r.layers} of {m.name!r} on "
                               f"{r.node!r}: no node reported the full model's manifest ({m.digest})",
                               f"The source {m.source!r} must hold it.", address=r.address))
            continue
        try:
            sliced = mf.make_slice(full, m.digest, r.layers)
        except mf.ManifestError as exc:
            diags.append(error("invalid_slice", f"layers {r.layers} of {m.name!r}: {exc}", address=r.address))
            continue
        out[r.node][mf.digest_of(sliced)] = Want(m, mf.digest_of(sliced), sum(f["size"] for f in sliced["files"]),
                                                 r.layers, m.digest)
    for c in d.clusters.values():  # a LoRA adapter follows the members that merge it (placed ones too)
        if c.adapter is not None and c.adapter in d.models and c.pipeline is None:
            a = d.models[c.adapter]
            for node in c.members:
                out[node].setdefault(a.digest, Want(a, a.digest, model_bytes(a, o)))
        elif c.adapter is not None and c.adapter in d.models:
            adapter_slices(c.name, d.models[c.adapter], c.model, c.members, o, out, diags)
    return out


def adapter_slices(cluster: str, a: ModelSpec, model: str, members: tuple[str, ...], o: Observed,
                   out: dict[str, dict[str, Want]], diags: list[Diagnostic]) -> None:
    """A pipeline's stages each want the slice of adapter `a` for the layers of their slice of
    `model` (mf.make_adapter_slice, promised by digest as a model slice is), cut from the full
    adapter's manifest; an adapter no stage can merge is refused (adapter_pipeline_unsupported)."""
    full = o.manifests.get(a.digest)
    for node in members:
        stage = next((w for w in out[node].values() if w.model.name == model and w.layers is not None), None)
        if stage is None or stage.layers is None:
            continue  # no slice of the model here: the pipeline's own diagnostic says so
        if full is None:
            diags.append(error("source_missing", f"cannot plan layers {stage.layers} of adapter {a.name!r} on "
                               f"{node!r}: no node reported the full adapter's manifest ({a.digest})",
                               f"The source {a.source!r} must hold it.",
                               address=replica_address(f"{a.name}[{stage.layers}]", node)))
            return
        try:
            sliced = mf.make_slice(full, a.digest, stage.layers)
        except mf.ManifestError as exc:
            diags.append(error("adapter_pipeline_unsupported", f"cluster {cluster!r} is a pipeline, whose stages "
                               f"cannot merge adapter {a.name!r}: {exc}",
                               "Serve the model whole on each member with this adapter.",
                               address=f"clusters.{cluster}.adapter"))
            return
        digest = mf.digest_of(sliced)
        out[node].setdefault(digest, Want(a, digest, sum(f["size"] for f in sliced["files"]), stage.layers, a.digest))


def model_bytes(m: ModelSpec, o: Observed) -> int:
    """The size of model `m` as a node reports holding it, else as its manifest says (0: unknown)."""
    for obs in o.nodes.values():
        if m.digest in obs.weights:
            return obs.weights[m.digest].bytes
    full = o.manifests.get(m.digest)
    return sum(f["size"] for f in full["files"]) if full else 0


def replicate(d: Desired, ok: dict[str, ObservedNode], wants: dict[str, dict[str, Want]],
              diags: list[Diagnostic]) -> list[Change]:
    """The fetches that bring each node the weights it wants, from the nodes holding a good copy."""
    cp = d.control_plane.node
    changes: list[Change] = []
    planned_bytes: dict[str, int] = {}
    by_digest: dict[str, list[tuple[str, Want]]] = {}
    for node in d.nodes:
        for digest, want in wants[node].items():
            obs = ok.get(node)
            if obs is None or (digest in obs.weights and not obs.weights[digest].corrupt):
                continue
            if want.model.encrypted and node != cp:
                diags.append(error(
                    "encrypted_remote_unsupported",
                    f"encrypted model {want.model.name!r} cannot be replicated to {node!r}: encrypted weights "
                    f"never leave the control plane's node ({cp!r})",
                    address=replica_address(want.address_model, node)))
                continue
            by_digest.setdefault(digest, []).append((node, want))
    for digest, targets in by_digest.items():
        want = targets[0][1]
        full = want.source_digest or digest
        holders = [n for n, obs in ok.items() if full in obs.weights and not obs.weights[full].corrupt]
        holders.sort(key=lambda n: (n != want.model.source, list(d.nodes).index(n)))
        spoiled = [f"{n} ({obs.weights[full].corrupt})" for n, obs in ok.items()
                   if full in obs.weights and obs.weights[full].corrupt]
        if not holders:
            for node, w in targets:
                summary = (f"the source node {node!r} does not hold {w.model.name!r} ({full}), and no other "
                           "reachable node does" if node == w.model.source else
                           f"no reachable node holds {w.model.name!r} ({full}) to replicate to {node!r}")
                if spoiled:
                    summary = (f"no reachable node holds a good copy of {w.model.name!r} ({full}) to replicate to "
                               f"{node!r}: the copy on {', '.join(spoiled)} is corrupt")
                diags.append(error("source_missing", summary,
                                   f"Import it on {w.model.source!r}: fleet-agent import PATH.",
                                   address=replica_address(w.address_model, node)))
            continue
        # Fan out in chains that forward pieces as they arrive (reconciler/planning/fanout.py): started
        # together, so nothing waits for another copy to finish.
        arrange = fanout.spread if want.layers else fanout.chains
        sources = {s.receiver: s for s in arrange(holders, [n for n, _ in targets])}
        for node, w in targets:
            peer, chained = sources[node].peer, sources[node].chained
            # A chained peer's fetch is a dependency (a targeted plan takes it along), which the
            # executor starts together with this one (reconciler/applying/execute.py streams_from).
            deps = (replica_address(w.address_model, peer),) if chained else ()
            via = " as it arrives there" if chained else ""
            planned_bytes[node] = planned_bytes.get(node, 0) + w.bytes
            details = ReplicateDetails(model=w.model.name, digest=w.digest, format=w.model.format, peer=peer,
                                       bytes=w.bytes)
            if w.layers is not None and w.source_digest is not None:
                details["layers"], details["source_digest"] = str(w.layers), w.source_digest
            what = f"copy of layers {w.layers} of {w.model.name}" if w.layers else f"replica of {w.model.name}"
            bad = ok[node].weights.get(w.digest)
            if bad is not None and bad.corrupt:  # held, but its agent found it corrupt: fetched again
                changes.append(Change(Action.REPLACE, replica_address(w.address_model, node), node,
                                      f"{node}'s {what} is corrupt ({bad.corrupt}); fetch {w.bytes:,} "
                                      f"bytes again from {peer}{via}", deps, details))
                continue
            changes.append(Change(Action.REPLICATE, replica_address(w.address_model, node), node,
                                  f"{node} holds no {what}; fetch {w.bytes:,} bytes from {peer}{via}", deps,
                                  details))
    for node, total in planned_bytes.items():
        # What the agent keeps in reserve its fetches never use: it is not free for the plan either.
        reserve = ok[node].disk_reserve
        free = max(0, ok[node].disk_free - reserve)
        if total > free:
            kept = f" (less the {reserve:,} its agent keeps in reserve)" if reserve else ""
            diags.append(error("insufficient_disk", f"{node!r} needs {total:,} bytes for the weights "
                               f"planned there but has {free:,} free{kept}", address=f"node.{node}"))
    return changes
