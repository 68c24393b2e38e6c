"""Ask every agent for its state, concurrently and bounded, each with its own timeout; then fetch
the full manifests that slices are computed from. The result is typed (reconciler/core/observed.py).
The heartbeat's observer asks each agent for news only: an agent whose state is the generation
held answers 304 and the node held is kept, and manifests (content-addressed) are fetched once.
A one-shot command's plain agents are asked all at once on one epoll (burst.py), with the states
its cache held (obscache.py), each brought up to now by the 304 that confirms it."""

from __future__ import annotations

import gc
import hashlib
import logging
import math
from contextlib import contextmanager
from typing import Any, Collection, Iterator, Mapping, Protocol, Sequence

import trio

from reconciler.agents import bounded
from reconciler.agents.batch import TimedOut
from reconciler.agents.client import AgentClient, AgentError, Unchanged
from reconciler.core.desired import Desired
from reconciler.core.observed import Observed, ObservedNode, brought_up, node_from_state

log = logging.getLogger("fleet")

DEFAULT_CONCURRENCY = 64
DEFAULT_TIMEOUT_S = 10.0


class Observer(Protocol):
    """What every node reported (or, with `only`, those nodes), each allowed `timeout` seconds."""

    async def __call__(self, timeout: float, only: Collection[str] | None = None) -> Observed: ...


async def observe(desired: Desired, client: AgentClient, *, concurrency: int = DEFAULT_CONCURRENCY,
                  timeout: float = DEFAULT_TIMEOUT_S, held: Mapping[str, ObservedNode] | None = None,
                  manifests: dict[str, dict[str, Any]] | None = None,
                  only: Collection[str] | None = None, bring_up: bool = False,
                  bare: set[str] | None = None) -> Observed:
    """`held`: nodes from an earlier observation, asked for news only (kept as they are when their
    agent says unchanged; with `bring_up`, brought up to now with the moving values its 304 carries,
    and asked for whole when it carries none); `manifests`: full manifests already fetched, by
    digest, added to; `bare`: the names of nodes whose agent confirmed a generation with a 304 that
    carried no moving values (an agent from before fleet-live), added to: holding their states costs
    a second request each time (obscache.py asks them plainly)."""
    nodes: dict[str, ObservedNode] = {}
    known = held or {}
    asked = [n for n in desired.nodes if only is None or n in only]
    # Plain agents at an address, for a one-shot command: all on one epoll (client.states, burst.py).
    batched = [n for n in asked if client.batches(desired.nodes[n])]
    names = iter([n for n in asked if not client.batches(desired.nodes[n])])

    def generation(name: str) -> str | None:
        before = known.get(name)
        return before.generation if before is not None and before.ok else None

    def misread(name: str, exc: Exception) -> ObservedNode:
        """A node whose answer broke something the bounds (bounded.py) and the schema should have
        caught: logged whole for the bug report, and an error of that node alone."""
        spec = desired.nodes[name]
        log.error("the answer of node %r could not be read", name, exc_info=exc)
        return ObservedNode(name, "agent_protocol_error", f"node {name!r} at {spec.address}:{spec.agent_port} "
                            f"answered a state that could not be read ({type(exc).__name__}: {str(exc)[:200]})")

    def unreachable(name: str) -> ObservedNode:
        spec = desired.nodes[name]
        return ObservedNode(name, "node_unreachable", f"node {name!r} at {spec.address}:{spec.agent_port} did not "
                            f"answer within {timeout:g}s")

    def settle(name: str, answer: dict[str, Any] | Unchanged | AgentError | TimedOut) -> bool:
        """The node for this answer; False when it must be asked for whole (a 304 whose moving
        values do not fit what is held)."""
        if isinstance(answer, Unchanged):  # only ever for a generation asked about: a node held
            before = known[name]
            now = brought_up(before, answer.live) if bring_up else before
            if now is None:
                if bare is not None:
                    bare.add(name)
                return False
            nodes[name] = now
        elif isinstance(answer, TimedOut):
            nodes[name] = unreachable(name)
        elif isinstance(answer, AgentError):
            nodes[name] = ObservedNode(name, answer.code, answer.message)
        else:
            try:
                nodes[name] = node_from_state(name, answer)
            except Exception as exc:  # a state the schema let through and we cannot read: this node's error
                nodes[name] = misread(name, exc)
        return True

    async def batch(asks: Sequence[tuple[str, str | None]]) -> None:
        answers = await client.states([(desired.nodes[n], g) for n, g in asks], concurrency=concurrency,
                                      timeout=timeout)
        again = [(name, None) for (name, _), answer in zip(asks, answers) if not settle(name, answer)]
        if again:
            await batch(again)  # asked with no generation: never Unchanged, so once more at most

    async def one(name: str) -> None:
        spec = desired.nodes[name]
        try:
            if not settle(name, await client.state(spec, unless=generation(name), timeout=math.inf)):
                settle(name, await client.state(spec, timeout=math.inf))
        except AgentError as exc:
            nodes[name] = ObservedNode(name, exc.code, exc.message)
        except Exception as exc:  # whatever one agent's answer does, the other nodes are still observed
            nodes[name] = misread(name, exc)

    async def worker() -> None:
        # A fixed pool of workers taking the next node: at 10,000 nodes, 10,000 tasks parked on a
        # limiter cost more than the calls of a quiet beat (STYLE.md, habit 6). Each call gets
        # `timeout` by moving the worker's one deadline; when it passes, that node is unreachable
        # and the worker goes on in a new scope.
        while True:
            name: str | None = None
            with trio.CancelScope() as scope:
                for name in names:
                    scope.deadline = trio.current_time() + timeout
                    await one(name)
                return
            if name is not None:
                nodes[name] = unreachable(name)

    async with trio.open_nursery() as nursery:
        if batched:
            nursery.start_soon(batch, [(n, generation(n)) for n in batched])
        for _ in range(max(1, concurrency)):
            nursery.start_soon(worker)

    fetched = {} if manifests is None else manifests
    # Manifests the planner reads: the full models slices are cut from, and each LoRA adapter and
    # its base (whether the one fits the other: reconciler/planning/planner.py adapter_misfit).
    sliced = sorted({desired.models[r.model] for r in desired.replicas if r.layers is not None} | {
        desired.models[name] for c in desired.clusters.values() if c.adapter in desired.models
        for name in (c.model, c.adapter)}, key=lambda m: m.name)
    for m in sliced:
        if m.digest in fetched:
            continue
        holders = [n for n in [m.source, *desired.nodes] if n in nodes and m.digest in nodes[n].weights]
        for holder in holders[:1]:
            try:
                with trio.fail_after(timeout):
                    body = await client.manifest(desired.nodes[holder], m.digest)
            except (AgentError, trio.TooSlowError):
                continue
            if "sha256:" + hashlib.sha256(body).hexdigest() == m.digest:
                try:
                    fetched[m.digest] = bounded.loads(body)
                except bounded.Unbounded:
                    continue  # the right bytes, yet no manifest: as if that holder had none
    return Observed({name: nodes[name] for name in sorted(nodes)}, {m.digest: fetched[m.digest] for m in sliced if m.digest in fetched})


@contextmanager
def kept_to_the_end() -> Iterator[None]:
    """Around a one-shot command's observation (fleet plan, apply, observe), whose result lives
    until the process ends: the cyclic collector paused while the states arrive (at 10,000 nodes
    about a million objects, none of them garbage; its passes over them were 360 ms of CPU), and
    what exists afterwards frozen out of later full collections, which walked it again while the
    plan was made and written out (another 320 ms). Around the planning of fleet plan and apply too:
    the plan's objects (with GPUs, a ledger entry for each GPU of the nodes it places on) are none
    of them garbage either, and a full collection over them came with each plan (bench/plan_scale
    --gpu-sizes). Not for the heartbeat: it lets go of old states and plans."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


class HeartbeatObserver:
    """observe() for this fleet through this client, as the heartbeat calls it: it keeps the last
    node each agent reported and the manifests fetched, so that a quiet beat costs a 304 per node."""

    def __init__(self, desired: Desired, client: AgentClient, *, concurrency: int = DEFAULT_CONCURRENCY) -> None:
        self.d, self.client, self.concurrency = desired, client, concurrency
        self.held: dict[str, ObservedNode] = {}
        self.manifests: dict[str, dict[str, Any]] = {}

    async def __call__(self, timeout: float, only: Collection[str] | None = None) -> Observed:
        seen = await observe(self.d, self.client, concurrency=self.concurrency, timeout=timeout, held=self.held,
                             manifests=self.manifests, only=only)
        # An unanswered node keeps its last answer here: when it comes back it may answer 304.
        self.held.update((name, node) for name, node in seen.nodes.items() if node.ok)
        return seen


def observer(desired: Desired, client: AgentClient, *, concurrency: int = DEFAULT_CONCURRENCY) -> Observer:
    return HeartbeatObserver(desired, client, concurrency=concurrency)
