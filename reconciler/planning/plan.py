"""A plan is data: changes with an address, a reason and dependencies, plus diagnostics; it has a
JSON twin (schemas/plan.schema.json) that can be saved and applied later."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from reconciler.core.diagnostics import Diagnostic, Pos, Severity, SourceRange, has_errors

PLAN_FORMAT = "1.0"


class Action(str, Enum):
    REPLICATE = "replicate"
    START = "start"
    REPLACE = "replace"
    STOP = "stop"
    DELETE = "delete"


SUMMARY_ORDER = (Action.REPLICATE, Action.START, Action.REPLACE, Action.STOP, Action.DELETE)


@dataclass(frozen=True, slots=True)
class Change:
    action: Action
    address: str
    node: str
    reason: str
    depends_on: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)  # one of wire.plan_details' shapes
    drift: bool = False  # undoing something fleet.yaml does not ask for

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action.value, "address": self.address, "node": self.node, "reason": self.reason,
                "depends_on": list(self.depends_on), "details": self.details, "drift": self.drift}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Change:
        return cls(Action(d["action"]), d["address"], d["node"], d["reason"], tuple(d.get("depends_on", ())),
                   dict(d.get("details", {})), bool(d.get("drift", False)))


@dataclass(frozen=True, slots=True)
class Plan:
    changes: tuple[Change, ...]
    diagnostics: tuple[Diagnostic, ...]
    config_digest: str = ""
    config_file: str = ""
    fingerprints: dict[str, str] = field(default_factory=dict)
    targets: tuple[str, ...] = ()
    # Each GPU of every node this plan reserves GPU memory on (reconciler/planning/gpus.py Gpu.to_json).
    gpus: tuple[dict[str, Any], ...] = ()

    @property
    def errored(self) -> bool:
        return has_errors(self.diagnostics)

    def count(self, action: Action) -> int:
        return sum(1 for c in self.changes if c.action is action)

    def summary(self) -> str:
        words = {Action.REPLICATE: "to replicate", Action.START: "to start", Action.REPLACE: "to replace",
                 Action.STOP: "to stop", Action.DELETE: "to delete"}
        return "Plan: " + ", ".join(f"{self.count(a)} {words[a]}" for a in SUMMARY_ORDER) + "."

    def touched_nodes(self) -> set[str]:
        return {c.node for c in self.changes} | {c.details["peer"] for c in self.changes if "peer" in c.details}

    def to_json(self) -> dict[str, Any]:
        return {"format_version": PLAN_FORMAT, "config_file": self.config_file,
                "config_digest": self.config_digest, "fingerprints": dict(sorted(self.fingerprints.items())),
                "targets": list(self.targets), "errored": self.errored,
                "summary": {a.value: self.count(a) for a in SUMMARY_ORDER},
                "changes": [c.to_json() for c in self.changes],
                "diagnostics": [d.to_json() for d in self.diagnostics], "gpus": list(self.gpus)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        if d.get("format_version") != PLAN_FORMAT:
            raise ValueError(f"plan format {d.get('format_version')!r} is not {PLAN_FORMAT}")
        diags = []
        for x in d.get("diagnostics", []):
            r = x.get("range")
            rng = SourceRange(r["filename"], Pos(**r["start"]), Pos(**r["end"])) if r else None
            diags.append(Diagnostic(Severity(x["severity"]), x["code"], x["summary"], x.get("detail", ""),
                                    x.get("address", ""), rng))
        return cls(tuple(Change.from_json(c) for c in d.get("changes", [])), tuple(diags),
                   d.get("config_digest", ""), d.get("config_file", ""), dict(d.get("fingerprints", {})),
                   tuple(d.get("targets", ())), tuple(d.get("gpus", ())))
