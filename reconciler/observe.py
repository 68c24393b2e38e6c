"""Ask every agent for its state, concurrently and bounded, each with its own timeout; then fetch
the full manifests that slices are computed from. The result is typed (reconciler/observed.py)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Awaitable, Callable

import trio

from .client import AgentClient, AgentError
from .model import Desired
from .observed import Observed, ObservedNode, node_from_state

DEFAULT_CONCURRENCY = 64
DEFAULT_TIMEOUT_S = 10.0

Observer = Callable[[float], Awaitable[Observed]]  # a timeout per node → what every node reported


async def observe(desired: Desired, client: AgentClient, *, concurrency: int = DEFAULT_CONCURRENCY,
                  timeout: float = DEFAULT_TIMEOUT_S) -> Observed:
    # Bounded: thousands of tasks queued at once is far slower than a limiter (STYLE.md, habit 6).
    limiter = trio.CapacityLimiter(concurrency)
    nodes: dict[str, ObservedNode] = {}

    async def one(name: str) -> None:
        spec = desired.nodes[name]
        async with limiter:
            try:
                with trio.fail_after(timeout):
                    nodes[name] = node_from_state(name, await client.state(spec))
            except trio.TooSlowError:
                where = f"{spec.address}:{spec.agent_port}"
                nodes[name] = ObservedNode(name, "node_unreachable",
                                           f"node {name!r} at {where} did not answer within {timeout:g}s")
            except AgentError as exc:
                nodes[name] = ObservedNode(name, exc.code, exc.message)

    async with trio.open_nursery() as nursery:
        for name in desired.nodes:
            nursery.start_soon(one, name)

    manifests: dict[str, Any] = {}
    sliced = {r.model for r in desired.replicas if r.layers is not None}
    for model_name in sorted(sliced):
        m = desired.models[model_name]
        holders = [n for n in [m.source, *desired.nodes] if n in nodes and m.digest in nodes[n].weights]
        for holder in holders[:1]:
            try:
                with trio.fail_after(timeout):
                    body = await client.manifest(desired.nodes[holder], m.digest)
            except (AgentError, trio.TooSlowError):
                continue
            if "sha256:" + hashlib.sha256(body).hexdigest() == m.digest:
                manifests[m.digest] = json.loads(body)
    return Observed(dict(sorted(nodes.items())), manifests)


def observer(desired: Desired, client: AgentClient, *, concurrency: int = DEFAULT_CONCURRENCY) -> Observer:
    """observe() for this fleet through this client, as the heartbeat calls it."""
    async def call(timeout: float) -> Observed:
        return await observe(desired, client, concurrency=concurrency, timeout=timeout)
    return call
