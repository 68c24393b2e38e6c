"""fleet.yaml's checks a schema cannot express (cross-references and conflicts), each with its place."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import stat
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from wire.layers import LayerRange, LayerRangeError

from reconciler.core.diagnostics import Diagnostic, error, format_path, warning
from reconciler.core.desired import DEFAULT_AGENT_PORT, DEFAULT_LISTEN
from reconciler.fleetfile.source import Document, YamlPath


class Checker:
    """Cross-references and conflicts. Runs only on a schema-valid document, so shapes are known."""

    def __init__(self, doc: Document) -> None:
        self.doc = doc
        self.data: dict[str, Any] = doc.data
        self.nodes: dict[str, Any] = self.data["nodes"]
        self.models: dict[str, Any] = self.data.get("models", {})
        self.diags: list[Diagnostic] = []
        # Each slice's range as parsed while checking, by (model, index), for _build.
        self.layers: dict[tuple[str, int], LayerRange] = {}
        # What each node holds of each model: its slice (None: whole) and where the replica is written.
        self.held: dict[tuple[str, str], tuple[LayerRange | None, YamlPath]] = {}
        # Nodes serving each model as pipeline stages: their slices are checked per pipeline.
        self.staged: dict[str, set[str]] = defaultdict(set)
        for cluster in self.data.get("clusters", {}).values():
            if cluster.get("pipeline", False) is not False:
                self.staged[cluster["model"]].update(listed(cluster))

    def add(self, code: str, path: YamlPath, summary: str, detail: str = "", *, key: bool = False,
            severity: str = "error") -> None:
        make = error if severity == "error" else warning
        self.diags.append(make(code, summary, detail, format_path(path), self.doc.range(path, key=key)))

    def node_ref(self, name: str, path: YamlPath, what: str) -> bool:
        if name in self.nodes:
            return True
        self.add("unknown_node", path, f"{what} names node {name!r}, which is not declared under `nodes`",
                 _suggest(name, self.nodes, "nodes"))
        return False

    def model_ref(self, name: str, path: YamlPath, what: str, *, key: bool = False) -> bool:
        if name in self.models:
            return True
        self.add("unknown_model", path, f"{what} names model {name!r}, which is not declared under `models`",
                 _suggest(name, self.models, "models"), key=key)
        return False

    def run(self) -> list[Diagnostic]:
        cp = self.data["control_plane"]["node"]
        self.node_ref(cp, ("control_plane", "node"), "control_plane.node")
        state = self.data["control_plane"].get("state")
        if isinstance(state, str) and (urlsplit(state).password is not None or "password=" in urlsplit(state).query):
            self.add("state_password_in_file", ("control_plane", "state"),
                     "control_plane.state holds a password: fleet.yaml is shared and kept in version control",
                     "Remove it from the URL; PostgreSQL takes it from PGPASSWORD or ~/.pgpass (libpq).")
        self.check_nodes()
        for name, model in self.models.items():
            self.node_ref(model["source"], ("models", name, "source"), f"the source of model {name!r}")
        holders = self.check_replicas()
        self.check_clusters(holders)
        self.ca_file = self.check_ca_file()
        return self.diags

    def check_ca_file(self) -> str | None:
        """control_plane.agent_ca_file made absolute (relative: beside the fleet file), read now."""
        given = self.data["control_plane"].get("agent_ca_file")
        if given is None:
            return None
        path = ca_file_path(self.doc.filename, given)
        why = ca_file_problem(path)
        if why is not None:
            self.add("ca_file_unreadable", ("control_plane", "agent_ca_file"),
                     f"cannot use {str(path)!r} as the agents' CA file: {why}")
        return str(path)

    def check_addresses(self) -> None:
        """Each address a real IP address or host name: the schema's patterns let through an IPv6
        look-alike (`1::2::3`) and any host in control_plane.listen (`127.0.31.999:8080`)."""
        for name, node in self.nodes.items():
            why = address_problem(node["address"])
            if why is not None:
                self.add("invalid_address", ("nodes", name, "address"),
                         f"nodes.{name}.address: {node['address']!r} is not an address: {why}",
                         "Write an IPv4 address (10.0.0.2), an IPv6 address (fd00::2) or a host name (gpu-a.lab).")
        listen = self.data["control_plane"].get("listen")
        if isinstance(listen, str):
            host = listen.rsplit(":", 1)[0]
            why = address_problem(host[1:-1] if host.startswith("[") else host, bracketed=host.startswith("["))
            if why is not None:
                self.add("invalid_address", ("control_plane", "listen"),
                         f"control_plane.listen: {host!r} is not an address: {why}",
                         "Write HOST:PORT with an IP address or host name: 0.0.0.0:8080, [::1]:8080, cp.lab:8080.")

    def check_nodes(self) -> None:
        self.check_addresses()
        seen: dict[tuple[str, int], str] = {}
        for name, node in self.nodes.items():
            key = (node["address"].lower(), node.get("agent_port", DEFAULT_AGENT_PORT))
            if key in seen:
                self.add("address_conflict", ("nodes", name, "address"),
                         f"nodes {seen[key]!r} and {name!r} both have their agent at {key[0]}:{key[1]}",
                         "Two nodes cannot share an agent; give each its own address or agent_port.")
            else:
                seen[key] = name

    def check_replicas(self) -> dict[str, set[str]]:
        """Every node that will hold (part of) each model, for the cluster checks."""
        holders: dict[str, set[str]] = defaultdict(set)
        for model_name, items in self.data.get("replicas", {}).items():
            known = self.model_ref(model_name, ("replicas", model_name), "replicas", key=True)
            model = self.models.get(model_name, {})
            first_at: dict[str, int] = {}
            slices: list[tuple[LayerRange, str, YamlPath]] = []
            for i, item in enumerate(items):
                node = item if isinstance(item, str) else item["node"]
                path: YamlPath = ("replicas", model_name, i) + (() if isinstance(item, str) else ("node",))
                if not self.node_ref(node, path, f"replicas.{model_name}[{i}]"):
                    continue
                if node in first_at:
                    self.add("duplicate_replica", path,
                             f"node {node!r} is listed twice for model {model_name!r}",
                             f"First listed at replicas.{model_name}[{first_at[node]}]. A node holds one "
                             "replica of a model: list it once (with `layers` for a slice).")
                    continue
                first_at[node] = i
                holders[model_name].add(node)
                self.held[(model_name, node)] = (None, path)
                if isinstance(item, dict) and "layers" in item:
                    lpath = ("replicas", model_name, i, "layers")
                    try:
                        rng = LayerRange.parse(item["layers"])
                    except LayerRangeError as exc:
                        self.add("invalid_layers", lpath, str(exc), _layers_hint(item["layers"]))
                        continue
                    self.layers[(model_name, i)] = rng
                    self.held[(model_name, node)] = (rng, lpath)
                    if known and model.get("format") == "gguf":
                        self.add("slice_unsupported", lpath,
                                 f"model {model_name!r} is GGUF: only safetensors models can be sliced by layers")
                        continue
                    if known and "layers" in model and rng.last >= model["layers"]:
                        self.add("slice_out_of_range", lpath,
                                 f"layers {rng} are outside model {model_name!r}, which has "
                                 f"{model['layers']} layers (0-{model['layers'] - 1})")
                        continue
                    if node not in self.staged[model_name]:
                        slices.append((rng, node, lpath))
            self.check_slices(model_name, model, slices)
        return holders

    def check_slices(self, model_name: str, model: dict[str, Any],
                     slices: list[tuple[LayerRange, str, YamlPath]]) -> None:
        if not slices:
            return
        slices.sort()
        expected_next = 0
        prev: tuple[LayerRange, str, YamlPath] | None = None
        for rng, node, path in slices:
            if prev is not None and rng.first <= prev[0].last:
                self.add("slice_overlap", path,
                         f"slices of {model_name!r} overlap: {node!r} holds {rng} and {prev[1]!r} holds {prev[0]}",
                         "Each layer of a sliced model is held by exactly one slice.")
            elif rng.first > expected_next:
                missing = LayerRange(expected_next, rng.first - 1)
                self.add("slice_gap", path, f"slices of {model_name!r} leave layers {missing} unheld",
                         "The slices of a model must cover its layers from 0 without gaps.")
            expected_next = max(expected_next, rng.last + 1)
            prev = (rng, node, path)
        total = model.get("layers")
        if total is not None and expected_next < total:
            self.add("slice_gap", slices[-1][2],
                     f"slices of {model_name!r} leave layers {LayerRange(expected_next, total - 1)} unheld",
                     f"Model {model_name!r} has {total} layers; the last slice must end at layer {total - 1}.")

    def check_clusters(self, holders: dict[str, set[str]]) -> None:
        bound: dict[tuple[str, int], tuple[str, YamlPath]] = {}
        for name, node in self.nodes.items():
            bound[(name, node.get("agent_port", DEFAULT_AGENT_PORT))] = (f"the agent of {name!r}",
                                                                          ("nodes", name, "agent_port"))
        cp = self.data["control_plane"]
        listen_port = int(cp.get("listen", DEFAULT_LISTEN).rsplit(":", 1)[1])
        bound.setdefault((cp["node"], listen_port), ("`fleet serve` (control_plane.listen)",
                                                     ("control_plane", "listen")))
        for cname, cluster in self.data.get("clusters", {}).items():
            base: YamlPath = ("clusters", cname)
            model_name = cluster["model"]
            known = self.model_ref(model_name, base + ("model",), f"cluster {cname!r}")
            self.check_gpus(cname, cluster)
            if known:
                self.check_adapter(cname, cluster)
            if isinstance(cluster["members"], dict):
                self.check_placement(cname, cluster)
                self.check_speculative(cname, cluster, holders)
                continue
            seen: dict[str, int] = {}
            for i, member in enumerate(cluster["members"]):
                mpath = base + ("members", i)
                if not self.node_ref(member, mpath, f"clusters.{cname}.members[{i}]"):
                    continue
                if member in seen:
                    self.add("duplicate_member", mpath, f"node {member!r} is listed twice in cluster {cname!r}",
                             f"First listed at clusters.{cname}.members[{seen[member]}]; a node runs one "
                             "server per cluster.")
                    continue
                seen[member] = i
                if known and cluster.get("pipeline", False) is False and member not in holders.get(model_name, set()) \
                        and member != self.models[model_name]["source"]:
                    self.add("member_without_replica", mpath,
                             f"{member!r} serves {model_name!r} in cluster {cname!r} but holds no replica of it",
                             f"Add {member!r} to replicas.{model_name}.")
                port_key = (member, cluster["port"])
                if port_key in bound:
                    other, _ = bound[port_key]
                    self.add("port_conflict", base + ("port",),
                             f"cluster {cname!r} and {other} both use port {cluster['port']} on node {member!r}")
                else:
                    bound[port_key] = (f"cluster {cname!r}", base + ("port",))
            if known and cluster.get("pipeline", False) is not False:
                self.check_pipeline(cname, cluster, bound)
            self.check_speculative(cname, cluster, holders)

    def check_adapter(self, cname: str, cluster: dict[str, Any]) -> None:
        """A cluster's LoRA adapter: a peft model, on a safetensors model. The planner replicates it to
        every member (a pipeline's stages: the slice of it for their layers, reconciler/planning/weights.py),
        and checks that it fits its base from the two manifests."""
        base: YamlPath = ("clusters", cname)
        model_name, adapter = cluster["model"], cluster.get("adapter")
        if self.models[model_name]["format"] == "peft":
            self.add("model_is_adapter", base + ("model",), f"cluster {cname!r} serves {model_name!r}, which is a "
                     "LoRA adapter (format peft), not a model", f"Serve its base model, with adapter: {model_name}.")
            return
        if adapter is None or not self.model_ref(adapter, base + ("adapter",), f"the adapter of cluster {cname!r}"):
            return
        if self.models[adapter]["format"] != "peft":
            self.add("not_an_adapter", base + ("adapter",), f"the adapter of cluster {cname!r}, {adapter!r}, is a "
                     f"{self.models[adapter]['format']} model, not a LoRA adapter (format peft)")
            return
        if self.models[model_name]["format"] == "gguf":
            self.add("adapter_gguf_unsupported", base + ("adapter",),
                     f"cluster {cname!r} serves GGUF model {model_name!r} with adapter {adapter!r}: a PEFT adapter "
                     "is merged only by PyTorch servers of safetensors models",
                     "Serve the safetensors form of the base with this adapter (llama.cpp would need it converted "
                     "to a GGUF LoRA).")
            return

    def check_gpus(self, cname: str, cluster: dict[str, Any]) -> None:
        """settings.gpus: per-member keys name members (or candidates); with tensor_parallel N, N GPUs."""
        pins = cluster.get("settings", {}).get("gpus")
        if pins is None:
            return
        path: YamlPath = ("clusters", cname, "settings", "gpus")
        members = cluster["members"]
        allowed = set(members.get("nodes", self.nodes)) if isinstance(members, dict) else set(members)
        lists = [(path, pins)] if isinstance(pins, list) else [(path + (n,), g) for n, g in pins.items()]
        if isinstance(pins, dict):
            for node in pins:
                if node not in allowed:
                    self.add("gpus_not_a_member", path + (node,), f"settings.gpus of cluster {cname!r} names "
                             f"{node!r}, which is not one of its members" + (" or candidates" if
                                                                             isinstance(members, dict) else ""),
                             f"Its members: {', '.join(sorted(allowed))}.", key=True)
        tp = cluster.get("settings", {}).get("tensor_parallel")
        for where, got in lists:
            if isinstance(tp, int) and len(got) != tp:
                self.add("gpus_tensor_parallel_mismatch", where, f"cluster {cname!r} pins {len(got)} GPU(s) "
                         f"({', '.join(map(str, got))}) but asks for tensor_parallel: {tp}",
                         f"Pin {tp} GPUs, or set tensor_parallel to {len(got)} (or leave it out: the pinned GPUs "
                         "are the server's).")

    def check_placement(self, cname: str, cluster: dict[str, Any]) -> None:
        """members: {count, nodes, labels}: what can be known offline: the candidates exist, carry
        the labels, and are at least `count`; no pipeline; GGUF and encrypted models only on the
        control plane's node."""
        base: YamlPath = ("clusters", cname, "members")
        spec = cluster["members"]
        if cluster.get("pipeline", False) is not False:
            self.add("placement_pipeline_unsupported", base, f"pipeline {cname!r} cannot be placed by count: its "
                     "stages are its slices' nodes", "List the members in layer order, each holding a slice.")
            return
        names = spec.get("nodes", list(self.nodes))
        for i, n in enumerate(spec.get("nodes", ())):
            self.node_ref(n, base + ("nodes", i), f"clusters.{cname}.members.nodes[{i}]")
        candidates = [n for n in names if n in self.nodes]
        labels = spec.get("labels", {})
        if labels:
            candidates = [n for n in candidates
                          if all(self.nodes[n].get("labels", {}).get(k) == v for k, v in labels.items())]
        model = self.models.get(cluster["model"])
        cp = self.data["control_plane"]["node"]
        only_cp = model is not None and (model["format"] == "gguf" or model.get("encrypted", False))
        if only_cp:
            candidates = [n for n in candidates if n == cp]
        if len(candidates) < spec["count"]:
            why = (f"{'GGUF' if model and model['format'] == 'gguf' else 'encrypted'} model "
                   f"{cluster['model']!r} is served only on the control plane's node ({cp!r})" if only_cp else
                   "of the nodes " + (f"labelled {', '.join(f'{k}={v}' for k, v in labels.items())}"
                                      if labels else "named"))
            self.add("placement_too_few_candidates", base + ("count",),
                     f"cluster {cname!r} asks for {spec['count']} member{'s' if spec['count'] > 1 else ''} but has {len(candidates)} candidate(s)"
                     + (f": {', '.join(candidates)}" if candidates else "") + f" ({why})",
                     "Each member is a node of its own: lower `count`, or widen `nodes` / `labels`.")

    def check_pipeline(self, cname: str, cluster: dict[str, Any],
                       bound: dict[tuple[str, int], tuple[str, YamlPath]]) -> None:
        """The stages of a pipeline: slices of a safetensors model, in member order, covering each of
        its layers exactly once; the rendezvous port free on the first member's node."""
        base: YamlPath = ("clusters", cname)
        model_name, model = cluster["model"], self.models[cluster["model"]]
        if model["format"] == "gguf":
            self.add("pipeline_gguf_unsupported", base + ("pipeline",),
                     f"cluster {cname!r} is a pipeline of GGUF model {model_name!r}: only safetensors models "
                     "can be served in stages", "llama.cpp servers run whole, on the control plane's node.")
            return
        if "speculative" in cluster.get("settings", {}):
            self.add("pipeline_speculative_unsupported", base + ("settings", "speculative"),
                     f"cluster {cname!r} is a pipeline: its stages cannot run speculative decoding")
        stages: list[tuple[LayerRange, str, YamlPath]] = []
        for i, member in enumerate(cluster["members"]):
            if member not in self.nodes or member in cluster["members"][:i]:
                continue  # reported above
            rng, path = self.held.get((model_name, member), (None, ()))
            if rng is None:
                holds = ("holds the whole model" if path or member == model["source"] else "holds nothing of it")
                self.add("pipeline_member_not_slice", base + ("members", i),
                         f"{member!r} is a stage of pipeline {cname!r} but {holds}",
                         f"A stage holds a slice: list {{node: {member}, layers: FIRST-LAST}} under "
                         f"replicas.{model_name}.")
                return
            stages.append((rng, member, path))
        for (before, other, _), (rng, member, _) in zip(stages, stages[1:]):
            if rng.first < before.first:
                self.add("pipeline_out_of_order", base + ("members", cluster["members"].index(member)),
                         f"members of pipeline {cname!r} are not in layer order: {member!r} holds layers {rng}, "
                         f"which come before those of {other!r} ({before})",
                         "List the members in the order of their layers, from layer 0.")
                return
        expected_next = 0
        for n, (rng, member, path) in enumerate(stages):
            if rng.first < expected_next:
                self.add("pipeline_layers_overlap", path,
                         f"stages of pipeline {cname!r} overlap: {member!r} holds {rng} and "
                         f"{stages[n - 1][1]!r} holds {stages[n - 1][0]}",
                         "Each layer is run by exactly one stage: start this slice where the previous one ends.")
                return
            if rng.first > expected_next:
                self.add("pipeline_layers_gap", path,
                         f"stages of pipeline {cname!r} leave layers {LayerRange(expected_next, rng.first - 1)} "
                         "unserved", "The stages' slices must follow each other from layer 0 without gaps.")
                return
            expected_next = rng.last + 1
        total = model.get("layers")
        if stages and total is not None and expected_next < total:
            self.add("pipeline_layers_gap", stages[-1][2],
                     f"stages of pipeline {cname!r} leave layers {LayerRange(expected_next, total - 1)} unserved",
                     f"Model {model_name!r} has {total} layers; the last stage must end at layer {total - 1}.")
        self.check_rendezvous(cname, cluster, bound)

    def check_rendezvous(self, cname: str, cluster: dict[str, Any],
                         bound: dict[tuple[str, int], tuple[str, YamlPath]]) -> None:
        spec = cluster["pipeline"]
        path: YamlPath = ("clusters", cname, "pipeline") + (("rendezvous_port",) if isinstance(spec, dict)
                                                             and "rendezvous_port" in spec else ())
        port, first = rendezvous_port(cluster), cluster["members"][0]
        if port > 65535:
            self.add("pipeline_port_conflict", path,
                     f"pipeline {cname!r} would meet on port {port} (its port + 1), which does not exist",
                     "Give it one: pipeline: {rendezvous_port: PORT}.")
        elif (first, port) in bound:
            self.add("pipeline_port_conflict", path,
                     f"the rendezvous of pipeline {cname!r} and {bound[(first, port)][0]} both use port {port} "
                     f"on node {first!r}", "The first stage's node hosts the rendezvous: pick a port free there.")
        else:
            bound[(first, port)] = (f"the rendezvous of pipeline {cname!r}", path)

    def check_speculative(self, cname: str, cluster: dict[str, Any], holders: dict[str, set[str]]) -> None:
        spec = cluster.get("settings", {}).get("speculative")
        if spec is None:
            return
        path: YamlPath = ("clusters", cname, "settings", "speculative")
        mode = spec.get("mode", "draft" if "draft" in spec else None)
        if mode == "draft" and "draft" not in spec:
            self.add("speculative_draft_missing", path,
                     f"cluster {cname!r} asks for draft speculative decoding but names no draft model",
                     "Add `draft: MODEL`, or use `mode: prompt_lookup`, which needs none.")
        elif mode is None:
            self.add("speculative_draft_missing", path,
                     f"cluster {cname!r} has a `speculative` section with neither `draft` nor `mode`")
        if "draft" not in spec:
            return
        draft = spec["draft"]
        if not self.model_ref(draft, path + ("draft",), f"the draft of cluster {cname!r}"):
            return
        for i, member in enumerate(listed(cluster)):
            if member in self.nodes and member not in holders.get(draft, set()) \
                    and member != self.models[draft]["source"]:
                self.add("draft_not_replicated", ("clusters", cname, "members", i),
                         f"{member!r} runs cluster {cname!r} with draft model {draft!r} but holds no replica of it",
                         f"Add {member!r} to replicas.{draft}.")


def listed(cluster: dict[str, Any]) -> list[str]:
    """A cluster's members as fleet.yaml lists them ([] for members placed by count)."""
    members = cluster["members"]
    return list(members) if isinstance(members, list) else []


def rendezvous_port(cluster: dict[str, Any]) -> int:
    spec = cluster["pipeline"]
    return int(spec["rendezvous_port"]) if isinstance(spec, dict) and "rendezvous_port" in spec \
        else int(cluster["port"]) + 1


def _suggest(name: str, known: dict[str, Any], section: str) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    if close:
        return f"Did you mean {close[0]!r}?"
    return f"Declared {section}: {', '.join(known) or 'none'}."


def _layers_hint(text: str) -> str:
    first, _, last = text.partition("-")
    example = f"{last}-{first}" if first.isdigit() and last.isdigit() else "0-39"
    return f"Write FIRST-LAST with FIRST <= LAST, e.g. {example}."


def ca_file_path(filename: str, given: str) -> Path:
    """Where control_plane.agent_ca_file names: beside the fleet file when relative, `~` the home
    directory now (the environment's $HOME: desiredcache.py works it out again for a kept file)."""
    return Path(filename).resolve().parent / Path(given).expanduser()


_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def address_problem(text: str, *, bracketed: bool = False) -> str | None:
    """Why `text` is neither an IP address nor a host name (RFC 1123; a name's last label is not
    all digits, RFC 3696 2), or None. `bracketed`: it was written [ADDR], so it must be IPv6."""
    if bracketed or ":" in text:
        try:
            ipaddress.IPv6Address(text)
            return None
        except ValueError as exc:
            return f"not an IPv6 address ({exc})"
    labels = text.split(".")
    if labels[-1].isdigit():
        try:
            ipaddress.IPv4Address(text)
            return None
        except ValueError as exc:
            return f"not an IPv4 address ({exc})"
    if len(text) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return "not a host name (labels of letters, digits and '-', 1-63 characters, separated by '.')"
    return None


# A CA bundle is kilobytes (the system's whole store is ~220 KiB); a file named in fleet.yaml is
# read whole, so one that could be anything (/dev/zero, a log, a FIFO) is refused before it is read.
MAX_NAMED_FILE_BYTES = 1024 * 1024


def read_named_file(path: Path, limit: int = MAX_NAMED_FILE_BYTES) -> bytes:
    """A file fleet.yaml names, read whole: a regular file (opened without blocking, so a FIFO
    never hangs the read, and checked before a byte is read) of at most `limit` bytes. OSError
    with a plain reason otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                    else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                    else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a file")
            raise OSError(f"it is {kind}, not a regular file")
        if info.st_size > limit:
            raise OSError(f"it is {info.st_size:,} bytes; at most {limit:,} are read")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:  # grew since fstat
            raise OSError(f"it is over {limit:,} bytes; at most {limit:,} are read")
        return data
    finally:
        os.close(fd)


def ca_file_problem(path: Path) -> str | None:
    """Why the agents' CA file cannot be used (None when it holds a PEM certificate); desiredcache
    asks again before it trusts a validation it kept."""
    try:
        return None if b"-----BEGIN CERTIFICATE-----" in read_named_file(path) else "it holds no PEM certificate"
    except OSError as exc:
        return exc.strerror or str(exc)
