"""fleet.yaml → Desired: the schema, then the checks it cannot express (config_checks.py), then the values."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wire.layers import LayerRange

from reconciler.fleetfile import schema, source
from reconciler.fleetfile.checks import Checker, rendezvous_port
from reconciler.core.diagnostics import Diagnostic, error, has_errors
from reconciler.core.desired import DEFAULT_AGENT_PORT, DEFAULT_LISTEN, DEFAULT_STARTUP_TIMEOUT_S, ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec, PipelineSpec, Placement, ReplicaSpec, ServeTlsSpec, Settings, SpeculativeSpec
from reconciler.fleetfile.source import Document


@dataclass(frozen=True, slots=True)
class Loaded:
    """The outcome of loading a fleet file: the desired state when it is valid, and every
    diagnostic either way. `digest` identifies the configuration's meaning (not its comments)."""

    filename: str
    desired: Desired | None
    diagnostics: tuple[Diagnostic, ...]
    document: Document | None
    digest: str | None
    text: str | None = None
    cached: bool = False  # from desiredcache.py: what this very text validated to on an earlier run (no document)

    @property
    def ok(self) -> bool:
        return self.desired is not None and not has_errors(self.diagnostics)


def load(path: str | Path) -> Loaded:
    name = str(path)
    text, diags = source.read_file(path)
    if text is None:
        return Loaded(name, None, tuple(diags), None, None)
    return load_text(text, name)


def load_text(text: str, filename: str) -> Loaded:
    doc, diags = source.parse(text, filename)
    if doc is None:
        return Loaded(filename, None, tuple(diags), None, None, text)
    if not isinstance(doc.data, dict):
        diags.append(error("schema_violation", "the top level of a fleet file must be a mapping",
                           "Start from fleet.yaml.example: `version`, `control_plane`, `nodes`, ...",
                           range=doc.range(())))
        return Loaded(filename, None, tuple(diags), doc, None, text)
    # One error a place: a value the YAML already refused (a number too long, written in hex) is
    # not reported again by the schema.
    refused = {d.address for d in diags if d.is_error and d.address}
    diags += [d for d in schema.validate(doc) if d.address not in refused]
    if has_errors(diags):
        return Loaded(filename, None, tuple(diags), doc, None, text)
    checker = Checker(doc)
    diags += checker.run()
    desired = None if has_errors(diags) else _build(doc.data, checker.layers, checker.ca_file)
    digest = "sha256:" + hashlib.sha256(
        json.dumps(doc.data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return Loaded(filename, desired, tuple(diags), doc, digest, text)


def _pins(given: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """settings.gpus: a list for every member ("*"), or per member."""
    if given is None:
        return ()
    if isinstance(given, list):
        return (("*", tuple(given)),)
    return tuple((node, tuple(g)) for node, g in given.items())


def _build(data: dict[str, Any], layers: dict[tuple[str, int], LayerRange], ca_file: str | None = None) -> Desired:
    cp = data["control_plane"]
    nodes = {name: NodeSpec(name=name, address=n["address"], agent_port=n.get("agent_port", DEFAULT_AGENT_PORT),
                            hostname=n.get("hostname"), identity=n.get("identity"), tls=n.get("tls", False),
                            available=tuple(n.get("available", ())), ca_file=ca_file,
                            labels=tuple(sorted(n.get("labels", {}).items())))
             for name, n in data["nodes"].items()}
    models = {name: ModelSpec(name=name, format=m["format"], digest=m["digest"], source=m["source"],
                              encrypted=m.get("encrypted", False), layers=m.get("layers"))
              for name, m in data.get("models", {}).items()}
    replicas = tuple(
        ReplicaSpec(model=model, node=item if isinstance(item, str) else item["node"], layers=layers.get((model, i)))
        for model, items in data.get("replicas", {}).items() for i, item in enumerate(items))
    clusters = {}
    for name, c in data.get("clusters", {}).items():
        s = c.get("settings", {})
        spec = s.get("speculative")
        speculative = None if spec is None else SpeculativeSpec(
            mode=spec.get("mode", "draft"), draft=spec.get("draft"), tokens=spec.get("tokens"))
        settings = Settings(context_length=s.get("context_length"), threads=s.get("threads"),
                            batch_size=s.get("batch_size"), parallel=s.get("parallel"),
                            tensor_parallel=s.get("tensor_parallel"),
                            speculative=speculative,
                            startup_timeout_s=float(s.get("startup_timeout_s", DEFAULT_STARTUP_TIMEOUT_S)),
                            gpus=_pins(s.get("gpus")))
        pipeline = None if c.get("pipeline", False) is False else PipelineSpec(rendezvous_port(c))
        members, placement = c["members"], None
        if isinstance(members, dict):  # {count, nodes, labels}: placed by the planner
            placement = Placement(int(members["count"]), tuple(members.get("nodes", ())),
                                  tuple(sorted(members.get("labels", {}).items())))
        clusters[name] = ClusterSpec(name=name, model=c["model"], members=tuple(members) if placement is None else (),
                                     port=c["port"], settings=settings, pipeline=pipeline, placement=placement,
                                     adapter=c.get("adapter"))
    return Desired(version=data["version"],
                   control_plane=ControlPlaneSpec(node=cp["node"], listen=cp.get("listen", DEFAULT_LISTEN),
                                                  api_keys_env=cp.get("api_keys_env"),
                                                  tls=ServeTlsSpec(cp["tls"]["cert"], cp["tls"]["key"])
                                                  if "tls" in cp else None, state=cp.get("state")),
                   nodes=nodes, models=models, replicas=replicas, clusters=clusters,
                   delete_last_copy=frozenset(data.get("delete_last_copy", ())))
