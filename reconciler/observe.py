"""Ask every agent for its state, concurrently and bounded, each with its own timeout; then fetch
the full manifests that slices are computed from. The result is a snapshot (plain JSON)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import trio

from .client import AgentClient, AgentError
from .model import Desired
from .observed import SNAPSHOT_FORMAT

DEFAULT_CONCURRENCY = 64
DEFAULT_TIMEOUT_S = 10.0


async def observe(desired: Desired, client: AgentClient, *, concurrency: int = DEFAULT_CONCURRENCY,
                  timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    # Bounded: thousands of tasks queued on one connection pool is far slower than a limiter
    # sized to the pool (DESIGN.md).
    limiter = trio.CapacityLimiter(concurrency)
    nodes: dict[str, Any] = {}

    async def one(name: str) -> None:
        spec = desired.nodes[name]
        async with limiter:
            try:
                with trio.fail_after(timeout):
                    nodes[name] = {"state": await client.state(spec), "error": None}
            except trio.TooSlowError:
                nodes[name] = {"state": None, "error": {
                    "code": "node_unreachable",
                    "message": f"node {name!r} at {spec.address}:{spec.agent_port} did not answer within {timeout:g}s"}}
            except AgentError as exc:
                nodes[name] = {"state": None, "error": {"code": exc.code, "message": exc.message}}

    async with trio.open_nursery() as nursery:
        for name in desired.nodes:
            nursery.start_soon(one, name)

    manifests: dict[str, Any] = {}
    sliced = {r.model for r in desired.replicas if r.layers is not None}
    for model_name in sorted(sliced):
        m = desired.models[model_name]
        holders = [n for n in [m.source, *desired.nodes] if (nodes.get(n) or {}).get("state")
                   and any(w["digest"] == m.digest for w in nodes[n]["state"]["weights"])]
        for holder in holders[:1]:
            try:
                with trio.fail_after(timeout):
                    body = await client.manifest(desired.nodes[holder], m.digest)
            except (AgentError, trio.TooSlowError):
                continue
            if "sha256:" + hashlib.sha256(body).hexdigest() == m.digest:
                manifests[m.digest] = json.loads(body)
    return {"format_version": SNAPSHOT_FORMAT, "nodes": dict(sorted(nodes.items())), "manifests": manifests}
