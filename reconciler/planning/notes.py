"""What a plan says about each node beyond its changes: engine builds that cannot use its GPUs, and
the bytes it will receive, how long that takes at the rates it measured, and whether it fits its
availability window. Pure."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Mapping, Sequence

from wire.windows import Window, status

from reconciler.core.diagnostics import Diagnostic, error, warning
from reconciler.core.desired import NodeSpec
from reconciler.core.observed import ObservedNode
from reconciler.planning.plan import Change


def build_findings(node: ObservedNode) -> list[dict[str, Any]]:
    """The agent's own findings about its engine builds (variant.findings in its state): a CPU-only
    torch or llama.cpp beside GPUs, or a CUDA torch on a node without any."""
    variant = (node.state or {}).get("variant") or {}
    found = variant.get("findings") or []
    return [f for f in found if isinstance(f, dict) and f.get("message")]


def build_warnings(nodes: Mapping[str, ObservedNode]) -> list[Diagnostic]:
    """One warning per mismatched engine build, naming the node and the package to install. The
    agent decides what does not match (it sees its GPUs and its packages); the planner only says it."""
    out = []
    for name in sorted(nodes):
        for f in build_findings(nodes[name]):
            engine = str(f.get("check", "")).partition(":")[2] or "engine"
            out.append(warning("engine_build_mismatch", f"node {name!r}: {f['message']}",
                               f"Install {f.get('install') or 'a build matching the GPUs'} on {name!r}; until "
                               f"then its {engine} servers run on the CPU or fail to load.",
                               address=f"node.{name}"))
    return out


def link_rate(receiver: ObservedNode, peer: NodeSpec | None) -> dict[str, Any] | None:
    """What `receiver` measured on its recent fetches from `peer` (link_rates in its state)."""
    if peer is None:
        return None
    host = f"[{peer.address}]" if ":" in peer.address else peer.address  # as agent/rates.peer_key names it
    wanted = f"{host}:{peer.agent_port}"
    for r in (receiver.state or {}).get("link_rates") or []:
        if isinstance(r, dict) and r.get("peer") == wanted and int(r.get("bytes_per_s") or 0) > 0:
            return r
    return None


def window_end(node: ObservedNode, spec: NodeSpec) -> tuple[datetime, str] | None:
    """When the stretch of availability the node is in now ends, and the window that says so: the
    agent's own windows (its state) or fleet.yaml's, whichever closes first. None: no end in sight."""
    ends: list[tuple[datetime, str]] = []
    avail = (node.state or {}).get("availability") or {}
    if avail.get("current_ends_at"):
        ends.append((datetime.fromisoformat(avail["current_ends_at"]),
                     f"{', '.join(avail.get('windows') or [])}, the agent's own"))
    if spec.available and node.observed_at:
        seen = status(tuple(Window.parse(w) for w in spec.available), datetime.fromisoformat(node.observed_at))
        if seen["current_ends_at"]:
            ends.append((datetime.fromisoformat(seen["current_ends_at"]), f"{', '.join(spec.available)}, from fleet.yaml"))
    return min(ends) if ends else None


def duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{max(seconds, 0.1):.1f} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def estimate_replications(changes: list[Change], nodes: Mapping[str, NodeSpec],
                          seen: Mapping[str, ObservedNode]) -> tuple[list[Change], list[Diagnostic]]:
    """Each fetch's estimate from the receiver's measured rate from its peer (details.estimate: the
    node's bytes in this plan, seconds, the rate; "no measurement yet" is seconds null), a fetch
    chained from a peer still receiving ending no sooner than that peer's; and a plan error for each
    whose estimate ends after the receiving node's availability window closes."""
    fetches = {c.address: c for c in changes if "peer" in c.details and "bytes" in c.details}
    received: dict[str, int] = {}
    for c in fetches.values():
        received[c.node] = received.get(c.node, 0) + int(c.details["bytes"])
    seconds: dict[str, float | None] = {}

    def estimate(address: str, depth: int = 0) -> float | None:
        if address not in seconds:
            c = fetches[address]
            rate = link_rate(seen[c.node], nodes.get(c.details["peer"])) if c.node in seen else None
            own = int(c.details["bytes"]) / int(rate["bytes_per_s"]) if rate else None
            upstream = [estimate(d, depth + 1) for d in c.depends_on if d in fetches and depth < len(fetches)]
            known = [u for u in upstream if u is not None]
            seconds[address] = None if own is None else max([own, *known])
        return seconds[address]

    out, diags = [], []
    for c in changes:
        if c.address not in fetches:
            out.append(c)
            continue
        s = estimate(c.address)
        rate = link_rate(seen[c.node], nodes.get(c.details["peer"])) if c.node in seen else None
        note: dict[str, Any] = {"node_bytes": received[c.node], "seconds": None if s is None else round(s, 1),
                                "bytes_per_s": rate["bytes_per_s"] if rate else None,
                                "samples": int(rate.get("samples", 0)) if rate else 0}
        obs, spec = seen.get(c.node), nodes.get(c.node)
        end = window_end(obs, spec) if obs is not None and spec is not None and obs.observed_at else None
        if s is not None and obs is not None and obs.observed_at:
            # Not kept in the details: it moves with the observation's clock, the plan should not.
            finish = datetime.fromisoformat(obs.observed_at) + timedelta(seconds=s)
            if end is not None and finish > end[0]:
                diags.append(error(
                    "replication_exceeds_window",
                    f"fetching {int(c.details['bytes']):,} bytes onto {c.node!r} from {c.details['peer']!r} takes "
                    f"~{duration(s)} at {rate_text(note['bytes_per_s'])} (measured), ending {finish:%H:%M}, after "
                    f"{c.node}'s availability window ({end[1]}) closes at {end[0]:%H:%M}",
                    "Apply it inside a window long enough, widen the window, or pick a nearer source: a fetch "
                    "cut at the window's end is wasted work.", address=c.address))
        out.append(replace(c, details={**c.details, "estimate": note}))
    return out, diags


def rate_text(rate: int | None) -> str:
    if not rate:
        return "no measurement yet"
    return f"{rate / 1e6:.1f} MB/s" if rate >= 1e5 else f"{rate / 1e3:.1f} kB/s"


def receive_lines(changes: Sequence[Change]) -> list[str]:
    """Per node, the bytes the plan fetches onto it and how long that takes at the measured rates
    (fetches onto one node counted one after another: they share its link)."""
    per: dict[str, list[dict[str, Any]]] = {}
    for c in changes:
        if isinstance(c.details.get("estimate"), dict):
            per.setdefault(c.node, []).append({**c.details["estimate"], "peer": c.details["peer"]})
    lines = []
    for node in sorted(per):
        notes = per[node]
        known = [n["seconds"] for n in notes if n["seconds"] is not None]
        if len(known) < len(notes):
            unknown = sorted({n["peer"] for n in notes if n["seconds"] is None})
            how = f"no measurement yet from {', '.join(unknown)}"
            if known:
                how += f" (the rest ~{duration(sum(known))})"
        else:
            rates = ", ".join(f"{rate_text(n['bytes_per_s'])} from {n['peer']}" for n in notes)
            how = f"~{duration(sum(known))} at {rates}"
        lines.append(f"{node} receives {notes[0]['node_bytes']:,} bytes: {how}")
    return lines
