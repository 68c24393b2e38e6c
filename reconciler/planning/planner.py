"""plan(desired, observed) -> Plan. Pure: no I/O, no clock, no async; everything it needs is in its
two arguments, which is what makes plans testable from files and checkable in CI from snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping

from wire import manifest as mf
from wire.ids import replica_address, server_address, server_id, split_server_id
from wire.plan_details import (DeleteDetails, ReplaceDetails, RunningServer, ServerSettings, Speculative,
                               StartDetails, StopDetails)
from wire.windows import Window, status

from reconciler.core.diagnostics import Diagnostic, error, warning
from reconciler.planning import weights as plan_weights
from reconciler.planning.diffs import settings_diff
from reconciler.core.desired import ClusterSpec, Desired, ModelSpec
from reconciler.planning.notes import build_warnings, estimate_replications
from reconciler.core.observed import Observed, ObservedNode
from reconciler.planning.pipeline import StageInput, group_of, plan_group
from reconciler.planning.order import guard, order, select
from reconciler.planning.plan import Action, Change, Plan
from reconciler.planning.gpus import Arch, Archs, Estimates, Ledger, gib
from reconciler.planning.placement import place
from reconciler.planning.weights import Want, model_bytes


@dataclass(frozen=True, slots=True)
class _Ask:
    """A start or replace on a node with GPUs, waiting for its GPUs (assigned once every change is known)."""

    at: int  # its index in the planner's changes
    node: str
    sid: str
    fmt: str
    weights: int
    arch: Arch | None
    settings: ServerSettings
    pinned: tuple[int, ...] | None
    layers: int | None = None  # a pipeline stage: how many of the model's layers it holds


def plan(desired: Desired, observed: Observed, *, targets: tuple[str, ...] = (),
         config_digest: str = "", config_file: str = "") -> Plan:
    p = _Planner(desired, observed)
    p.run()
    estimated, too_long = estimate_replications(p.changes, desired.nodes, p.ok)  # node_notes.py
    guarded = guard(estimated, p.ok, desired.delete_last_copy)
    changes = order(guarded.changes)
    diags = list(p.diags) + build_warnings(p.ok)
    if targets:
        changes = select(changes, targets)
        diags.append(warning("targeted_plan", f"the plan is limited to {', '.join(targets)}",
                             "Other changes the fleet needs are left out: use -target only for "
                             "exceptional situations, then run a full plan."))
    diags += guarded.said_for(changes)
    diags += [d for d in too_long if d.address in {c.address for c in changes}]
    fingerprints = {n: o.fingerprint for n, o in observed.nodes.items() if o.ok}
    return Plan(tuple(changes), tuple(diags), config_digest, config_file, fingerprints, targets,
                tuple(p.ledger.to_json()))


def _adapter_digest(settings: Mapping[str, Any]) -> str | None:
    """The LoRA adapter a server's settings say it merges (None: none)."""
    adapter = settings.get("adapter")
    return str(adapter["digest"]) if isinstance(adapter, dict) and "digest" in adapter else None


class _Planner:
    def __init__(self, desired: Desired, observed: Observed) -> None:
        self.d = desired
        self.o = observed
        self.cp = desired.control_plane.node
        self.changes: list[Change] = []
        self.diags: list[Diagnostic] = []
        self.ok: dict[str, ObservedNode] = {}
        self.ledger = Ledger(self.ok)
        self.arch = Archs(observed)  # each model's architecture, looked up once a plan
        self.estimate = Estimates()  # each start's VRAM, worked out once a plan (placement asks first)
        self.asks: list[_Ask] = []
        self.placed: dict[tuple[str, str], str] = {}  # (cluster, node) -> why a placed member is there

    # ---- nodes ----

    def check_nodes(self) -> None:
        for name, spec in self.d.nodes.items():
            obs = self.o.nodes.get(name)
            if obs is None:
                self.diags.append(error("node_unreachable", f"node {name!r} ({spec.address}:{spec.agent_port}) "
                                        "was not observed", address=f"node.{name}"))
            elif not obs.ok:
                self.diags.append(error(obs.error_code or "node_unreachable", obs.error or "no answer",
                                        address=f"node.{name}"))
            elif spec.identity and obs.identity != spec.identity:
                self.diags.append(error("identity_mismatch",
                                        f"node {name!r} answered as identity {obs.identity}, but fleet.yaml pins "
                                        f"{spec.identity}", "Another machine answers at this address, or the "
                                        "node was enrolled again. Check the machine, then update the pin.",
                                        address=f"node.{name}"))
            elif not spec.identity and (other := self.named_as_another(name, obs)) is not None:
                self.diags.append(error("identity_of_another_node",
                                        f"the agent at {name!r} ({spec.address}:{spec.agent_port}) says it is "
                                        f"{other!r}, another node of this fleet",
                                        f"Two names of fleet.yaml may lead to one machine, or {name!r}'s address is "
                                        f"wrong. Check the address; pin each node's identity (nodes.{name}.identity: "
                                        "the id `fleet-agent identity` prints) to catch it for certain.",
                                        address=f"node.{name}"))
            else:
                self.ok[name] = obs

    def named_as_another(self, name: str, obs: ObservedNode) -> str | None:
        """The other fleet node whose name the agent at `name` gives as its own (None: none)."""
        said = ((obs.state or {}).get("identity") or {}).get("name")
        return said if isinstance(said, str) and said != name and said in self.d.nodes else None

    # ---- servers ----

    def resolve_settings(self, c: ClusterSpec, node: str, obs: ObservedNode) -> ServerSettings:
        s = c.settings
        out = ServerSettings()  # only what is set, in the order the agent and `fleet plan` have always shown
        if s.context_length is not None:
            out["context_length"] = s.context_length
        if s.threads is not None:
            out["threads"] = s.threads
        if s.batch_size is not None:
            out["batch_size"] = s.batch_size
        if s.parallel is not None:
            out["parallel"] = s.parallel
        address = server_address(c.name, node)
        if s.tensor_parallel == "auto":
            out["tensor_parallel"] = max(1, len(obs.gpus))
            if node != self.cp:
                self.diags.append(warning(
                    "tensor_parallel_remote_fallback", f"tensor_parallel: auto on {node!r} uses its reported GPU "
                    f"count ({len(obs.gpus)}) → {out['tensor_parallel']}", address=address))
        elif s.tensor_parallel is not None:
            out["tensor_parallel"] = s.tensor_parallel
        if s.speculative is not None:
            spec = Speculative(mode=s.speculative.mode)
            if s.speculative.draft:
                spec["draft"], spec["draft_digest"] = s.speculative.draft, self.d.models[s.speculative.draft].digest
            if s.speculative.tokens:
                spec["tokens"] = s.speculative.tokens
            out["speculative"] = spec
            if s.speculative.mode == "draft" and self.d.models[c.model].format == "gguf":
                self.diags.append(warning(
                    "speculative_draft_not_applied",
                    f"cluster {c.name!r} serves a GGUF model: its draft model {s.speculative.draft!r} is not used",
                    "fleet's llama.cpp workers draft by prompt lookup only (speculative: {mode: prompt_lookup}); "
                    "the server starts and answers without a draft model", address=address))
            if node != self.cp:
                self.diags.append(warning("speculative_remote_unvalidated",
                                          f"speculative decoding on remote node {node!r} is not validated",
                                          address=address))
        if c.adapter is not None:
            out["adapter"] = {"name": c.adapter, "digest": self.d.models[c.adapter].digest}
        out["startup_timeout_s"] = s.startup_timeout_s
        return out

    def adapter_misfit(self, c: ClusterSpec, model: ModelSpec) -> bool:
        """A cluster whose LoRA adapter does not fit its model, by the two manifests the agents
        reported (its tensors against the base's): a plan error naming both digests. Unknown (a
        manifest not reported yet): planned, and the worker's merge says so if it does not fit."""
        if c.adapter is None:
            return False
        adapter = self.d.models[c.adapter]
        am, bm = self.o.manifests.get(adapter.digest), self.o.manifests.get(model.digest)
        if am is None or bm is None:
            return False
        why = mf.adapter_base_problem(am, bm)
        if why is None:
            return False
        named = (am.get("adapter") or {}).get("base_model")
        self.diags.append(error(
            "adapter_base_mismatch", f"adapter {adapter.name!r} ({adapter.digest}) does not fit model {model.name!r} "
            f"({model.digest}) of cluster {c.name!r}: {why}",
            f"It was made on {named!r}." if named else "", address=f"clusters.{c.name}.adapter"))
        return True

    def servers(self, wants: dict[str, dict[str, Want]]) -> set[tuple[str, str]]:
        desired_ids: set[tuple[str, str]] = set()
        replicating = {ch.address for ch in self.changes if ch.action is Action.REPLICATE or "peer" in ch.details}
        for c in self.d.clusters.values():
            model = self.d.models[c.model]
            if self.adapter_misfit(c, model):
                desired_ids |= {(node, server_id(c.name, node)) for node in c.members}  # left as they run
                continue
            if c.pipeline is not None:
                desired_ids |= self.pipeline(c, model, wants, replicating)
                continue
            previous: str | None = None
            for node in c.members:
                sid, address = server_id(c.name, node), server_address(c.name, node)
                desired_ids.add((node, sid))
                if model.format == "gguf" and node != self.cp:
                    self.diags.append(error(
                        "llamacpp_remote_unsupported", f"cluster {c.name!r} serves GGUF model {model.name!r} on "
                        f"{node!r}: llama.cpp servers run only on the control plane's node ({self.cp!r})",
                        "Serve a safetensors model there, or make this cluster's only member the control plane's node.",
                        address=address))
                    continue
                if model.encrypted and node != self.cp:
                    self.diags.append(error("encrypted_remote_unsupported", f"encrypted model {model.name!r} cannot "
                                            f"be served on {node!r}, only on {self.cp!r}", address=address))
                    continue
                obs = self.ok.get(node)
                if obs is None:
                    continue
                settings = self.resolve_settings(c, node, obs)
                pinned = c.settings.gpus_for(node)
                host = self.d.nodes[node].address
                details = StartDetails(cluster=c.name, server_id=sid, model=model.name, digest=model.digest,
                                       port=c.port, host=host, settings=settings)
                draft_digest = settings["speculative"].get("draft_digest") if "speculative" in settings else None
                adapter_digest = settings["adapter"]["digest"] if "adapter" in settings else None
                deps = [replica_address(w.address_model, node) for w in wants[node].values()
                        if w.digest in (model.digest, draft_digest, adapter_digest)
                        and replica_address(w.address_model, node) in replicating]
                if previous:
                    deps.append(previous)
                current = obs.servers.get(sid)
                placed_as = self.placed.get((c.name, node))
                lead = f"{placed_as}; " if placed_as is not None else ""  # why a placed member is where it is
                change: Change | None = None
                if current is None:
                    change = Change(Action.START, address, node, f"{lead}{node} runs no server of cluster {c.name}",
                                    tuple(deps), details)
                elif current.state in ("failed", "stopped", "stopping"):
                    why = (current.reason or "").splitlines()[0] if current.reason else "no reason reported"
                    change = Change(Action.START, address, node, f"{lead}its server {current.state}: {why}",
                                    tuple(deps), details, drift=True)
                else:
                    diffs = settings_diff(current.settings, settings)
                    if current.model != model.digest:
                        diffs.insert(0, f"model {current.model[:19]}… → {model.digest[:19]}…")
                    if current.port != c.port:
                        diffs.insert(0, f"port {current.port} → {c.port}")
                    given = sorted(g[0] for g in current.gpus)
                    if pinned is not None and current.gpus and given != sorted(pinned):
                        diffs.append(f"gpus {','.join(map(str, given))} → {','.join(map(str, sorted(pinned)))}")
                    held = obs.weights.get(current.model)
                    corrupt = held.corrupt if held is not None else None
                    if diffs or corrupt:
                        before = RunningServer(model=current.model, port=current.port, settings=current.settings)
                        why = ("changed: " + "; ".join(diffs) if diffs else
                               f"it serves weights found corrupt ({corrupt}); start it again on the copy fetched again")
                        change = Change(Action.REPLACE, address, node, lead + why, tuple(deps),
                                        ReplaceDetails(**details, before=before))
                held = obs.weights.get(model.digest)
                if change is not None and held is not None and held.key_missing:
                    self.diags.append(error(
                        "encrypted_key_missing", f"cannot start encrypted model {model.name!r} on {node!r}: its agent "
                        f"does not hold key {held.key_missing}, which the weights are encrypted under",
                        "Start fleet-agent there with --key-file (or $FLEET_WEIGHTS_KEY_FILE) naming that key.",
                        address=address))
                    continue
                if change is not None:
                    if obs.gpus:
                        self.asks.append(_Ask(len(self.changes), node, sid, model.format, model_bytes(model, self.o),
                                              self.arch(model.digest), settings, pinned))
                    self.changes.append(change)
                    previous = address
        return desired_ids

    def pipeline(self, c: ClusterSpec, model: ModelSpec, wants: dict[str, dict[str, Want]],
                 replicating: set[str]) -> set[tuple[str, str]]:
        """Every stage of pipeline `c` as one group: planned only when every stage can be."""
        ids = {(node, server_id(c.name, node)) for node in c.members}
        stages: list[StageInput] = []
        for node in c.members:
            obs = self.ok.get(node)
            want = next((w for w in wants[node].values() if w.model.name == model.name and w.layers is not None), None)
            if model.encrypted and node != self.cp:
                self.diags.append(error("encrypted_remote_unsupported", f"encrypted model {model.name!r} cannot "
                                        f"be served on {node!r}, only on {self.cp!r}",
                                        address=server_address(c.name, node)))
            if obs is None or want is None or want.layers is None or (model.encrypted and node != self.cp):
                continue  # the node's or the slice's own diagnostic says why
            settings = self.resolve_settings(c, node, obs)
            fetches = [replica_address(want.address_model, node)]
            if c.adapter is not None:  # the stage merges the slice of the adapter for its layers
                part = next((w for w in wants[node].values() if w.model.name == c.adapter and w.layers == want.layers),
                            None)
                if part is None:
                    continue  # the adapter's diagnostic says why (reconciler/planning/weights.py adapter_slices)
                settings["adapter"] = {"name": c.adapter, "digest": part.digest}
                fetches.append(replica_address(part.address_model, node))
            stages.append(StageInput(node, self.d.nodes[node].address, want.layers, want.digest, settings,
                                     tuple(a for a in fetches if a in replicating), obs.servers.get(
                                         server_id(c.name, node))))
        if len(stages) < len(c.members):
            return ids
        total = (self.o.manifests.get(model.digest) or {}).get("layers")
        if isinstance(total, int) and stages[-1].layers.last != total - 1:
            self.diags.append(error("pipeline_layers_gap", f"the stages of pipeline {c.name!r} end at layer "
                                    f"{stages[-1].layers.last}, but {model.name!r} has {total} layers "
                                    f"(0-{total - 1})", "The last stage's slice must end at the model's last layer.",
                                    address=server_address(c.name, stages[-1].node)))
            return ids
        arch = self.arch(model.digest)
        sized = {w.digest: w for n in c.members for w in wants[n].values() if w.layers is not None}
        for change in plan_group(c, model, stages, settings_diff):
            obs = self.ok[change.node]
            want = sized.get(change.details["digest"])
            if obs.gpus and want is not None and want.layers is not None:
                self.asks.append(_Ask(len(self.changes), change.node, change.details["server_id"], model.format,
                                      want.bytes, arch, change.details["settings"],
                                      c.settings.gpus_for(change.node), want.layers.count))
            self.changes.append(change)
        return ids

    def assign_gpus(self) -> None:
        """Every start and replace on a node with GPUs given its GPUs, once every change is known:
        what this plan replaces or stops gives its share back first; replaces take theirs before
        starts (they run first); a change taking memory a replace gave back waits for that replace."""
        replacing = {(ch.node, ch.details["server_id"]): ch.address for ch in self.changes
                     if ch.action is Action.REPLACE and "server_id" in ch.details}
        for ch in self.changes:
            if ch.action is Action.STOP:
                self.ledger.release(ch.node, ch.details["server_id"])
        for node, sid in replacing:
            self.ledger.release(node, sid)
        for ask in sorted(self.asks, key=lambda a: self.changes[a.at].action is not Action.REPLACE):
            ch = self.changes[ask.at]
            n = len(ask.pinned) if ask.pinned else int(ask.settings.get("tensor_parallel") or 1)
            vram = self.estimate(ask.fmt, ask.weights, ask.arch, ask.settings, n, ask.layers)
            got = self.ledger.assign(ask.node, ask.sid, vram["total_bytes"], n, ask.pinned)
            if got.shares is None:
                name = ch.details["model"]
                self.diags.append(error(got.code, f"{name!r} needs about {gib(vram['total_bytes'])} of VRAM on "
                                        f"{ask.node!r} over {n} GPU(s) (weights {gib(vram['weights_bytes'])} + KV "
                                        f"cache {gib(vram['kv_cache_bytes'])} + overhead "
                                        f"{gib(vram['overhead_bytes'])}): {got.problem}",
                                        f"KV cache: {vram['basis']}.", address=ch.address))
                self.changes[ask.at] = Change(ch.action, ch.address, ch.node, ch.reason, ch.depends_on,
                                              {**ch.details, "vram": vram}, ch.drift)
                continue
            deps = ch.depends_on
            if replacing and "pipeline" not in ch.details:
                chosen = {s["index"] for s in got.shares}
                deps += tuple(dict.fromkeys(
                    replacing[(ask.node, other)] for g in self.ledger.gpus(ask.node) if g.index in chosen
                    for other in sorted(g.released) if (ask.node, other) in replacing and other != ask.sid
                    and replacing[(ask.node, other)] not in deps))
            self.changes[ask.at] = Change(ch.action, ch.address, ch.node, ch.reason, deps,
                                          {**ch.details, "gpus": got.shares, "vram": vram}, ch.drift)

    # ---- drift ----

    def drift(self, wants: dict[str, dict[str, Want]], desired_ids: set[tuple[str, str]]) -> None:
        replacing = [ch for ch in self.changes if ch.action is Action.REPLACE and "before" in ch.details]
        for node, obs in self.ok.items():
            # Weights are deleted after the servers using them stop, or are replaced by ones that do not.
            stopping: dict[str, list[str]] = {}
            for ch in replacing:
                if ch.node == node:
                    stopping.setdefault(ch.details["before"]["model"], []).append(ch.address)
                    merged = _adapter_digest(ch.details["before"]["settings"])
                    if merged is not None and merged != _adapter_digest(ch.details["settings"]):
                        stopping.setdefault(merged, []).append(ch.address)  # its adapter, loaded until then
            for sid, srv in obs.servers.items():
                if (node, sid) in desired_ids:
                    continue
                address = server_address(split_server_id(sid)[0], node)
                self.changes.append(Change(Action.STOP, address, node,
                                           f"{node} runs server {sid} ({srv.state}) that no cluster asks for",
                                           (), StopDetails(server_id=sid, model=srv.model), drift=True))
                stopping.setdefault(srv.model, []).append(address)
                if _adapter_digest(srv.settings) is not None:
                    stopping.setdefault(str(_adapter_digest(srv.settings)), []).append(address)
            for digest, held in obs.weights.items():
                if digest in wants.get(node, {}) or digest in obs.fetching:
                    continue
                full = held.slice_of or digest
                name = next((m.name for m in self.d.models.values() if m.digest == full), digest[7:19])
                if held.slice_of:
                    name = f"{name}[{held.layers}]"
                self.changes.append(Change(Action.DELETE, replica_address(name, node), node,
                                           f"{node} holds {name} ({held.bytes:,} bytes) that no replica asks for",
                                           tuple(stopping.get(digest, ())), DeleteDetails(digest=digest), drift=True))
        # A start waits for the stops on its node: they may free its port. A pipeline's stages also
        # wait for the stops of their cluster's former stages: the old group is gone before the new forms.
        stops: dict[str, list[str]] = {}
        for ch in self.changes:
            if ch.action is Action.STOP:
                stops.setdefault(ch.node, []).append(ch.address)
                stops.setdefault("cluster:" + split_server_id(ch.details["server_id"])[0], []).append(ch.address)
        self.changes = [Change(ch.action, ch.address, ch.node, ch.reason, ch.depends_on + tuple(dict.fromkeys(
                            stops.get(ch.node, []) + (stops.get("cluster:" + ch.details["cluster"], [])
                                                      if group_of(ch) else []))),
                               ch.details, ch.drift)
                        if ch.action in (Action.START, Action.REPLACE) and "server_id" in ch.details else ch
                        for ch in self.changes]

    def windows(self) -> None:
        for node in sorted({c.node for c in self.changes}):
            obs = self.ok[node]
            if not obs.inside_window:
                self.diags.append(error("outside_availability_window", f"{node!r} is outside its availability "
                                        f"window ({', '.join(obs.windows)}, the agent's own); no work may be "
                                        "planned there now", address=f"node.{node}"))
                continue
            spec = self.d.nodes[node]
            if spec.available and obs.observed_at:
                now = datetime.fromisoformat(obs.observed_at)
                if not status(tuple(Window.parse(w) for w in spec.available), now)["inside"]:
                    self.diags.append(error("outside_availability_window", f"{node!r} is outside its availability "
                                            f"window ({', '.join(spec.available)}, from fleet.yaml) at its local "
                                            f"time {now:%H:%M}", address=f"node.{node}"))

    def run(self) -> None:
        self.check_nodes()
        placed = place(self.d, self.o, self.ok, self.diags, self.arch, self.ledger, self.estimate)
        self.d, self.placed = placed.desired, placed.reasons
        wants = plan_weights.wants(self.d, self.o, self.diags)
        self.changes += plan_weights.replicate(self.d, self.ok, wants, self.diags)
        desired_ids = self.servers(wants)
        self.drift(wants, desired_ids)
        self.assign_gpus()
        self.windows()
