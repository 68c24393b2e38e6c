"""What a plan says about each node beyond its changes: engine builds that cannot use its GPUs. Pure."""

from __future__ import annotations

from typing import Any, Mapping

from .diagnostics import Diagnostic, warning
from .observed import ObservedNode


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
