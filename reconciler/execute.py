"""Run a plan: in dependency order, bounded parallelism; a failure skips what depends on it and
lets the rest finish. Progress goes to an injected hook; time to an injected clock."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import trio

from .client import AgentClient, AgentError
from .model import Desired
from .plan import Action, Change, Plan

POLL_S = 0.25
STALL_S = 300.0  # a fetch that makes no progress for this long is failed (it can be resumed)


@dataclass(frozen=True, slots=True)
class Result:
    address: str
    action: str
    status: str  # done | failed | skipped
    message: str
    seconds: float


class ActionFailed(Exception):
    pass


ProgressHook = Callable[[str, dict[str, Any]], None]  # (event, data): started, progress, finished


class Executor:
    def __init__(self, desired: Desired, client: AgentClient, *, parallelism: int = 10,
                 progress: ProgressHook | None = None, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.d = desired
        self.client = client
        self.limiter = trio.CapacityLimiter(max(1, parallelism))
        self.progress = progress or (lambda event, data: None)
        self.poll_s = poll_s
        self.clock = clock

    async def run(self, plan: Plan) -> list[Result]:
        done: dict[str, trio.Event] = {c.address: trio.Event() for c in plan.changes}
        results: dict[str, Result] = {}

        async def one(change: Change) -> None:
            for dep in change.depends_on:
                if dep in done:
                    await done[dep].wait()
            failed = [d for d in change.depends_on if d in results and results[d].status != "done"]
            if failed:
                results[change.address] = Result(change.address, change.action.value, "skipped",
                                                 f"skipped: depends on {', '.join(failed)}, which did not complete", 0.0)
            else:
                async with self.limiter:
                    start = self.clock()
                    self.progress("started", {"change": change})
                    try:
                        message = await self.apply(change)
                        status = "done"
                    except (ActionFailed, AgentError) as exc:
                        message, status = str(exc), "failed"
                    results[change.address] = Result(change.address, change.action.value, status, message,
                                                     self.clock() - start)
            self.progress("finished", {"change": change, "result": results[change.address]})
            done[change.address].set()

        async with trio.open_nursery() as nursery:
            for change in plan.changes:
                nursery.start_soon(one, change)
        return [results[c.address] for c in plan.changes]

    async def apply(self, c: Change) -> str:
        node = self.d.nodes[c.node]
        if c.action is Action.REPLICATE:
            return await self.replicate(c)
        if c.action is Action.STOP:
            await self.client.stop_server(node, c.details["server_id"])
            return f"stopped {c.details['server_id']} on {c.node}"
        if c.action is Action.DELETE:
            await self.client.delete_weights(node, c.details["digest"])
            return f"deleted {c.details['digest']} from {c.node}"
        if c.action is Action.REPLACE:
            await self.client.stop_server(node, c.details["server_id"])
        return await self.start(c)

    async def replicate(self, c: Change) -> str:
        node, digest = self.d.nodes[c.node], c.details["digest"]
        peer = self.d.nodes[c.details["peer"]]
        body: dict[str, Any] = {"peer": peer.agent_url, "name": c.details["model"]}
        if c.details.get("layers"):
            body.update(layers=c.details["layers"], source_digest=c.details["source_digest"])
        await self.client.fetch(node, digest, body)
        last_bytes, last_change = -1, self.clock()
        while True:
            state = await self.client.weights(node, digest)
            if state is None:
                raise ActionFailed(f"{c.node} forgot the fetch of {digest}")
            if state["state"] == "present":
                return f"{c.node} holds {digest} ({state.get('bytes', 0):,} bytes, verified)"
            if state["state"] == "failed":
                raise ActionFailed(f"{c.node} could not fetch {digest} from {c.details['peer']}: {state['error']}")
            self.progress("progress", {"change": c, "done": state.get("bytes_done", 0),
                                       "total": state.get("bytes_total", 0)})
            if state.get("bytes_done", 0) != last_bytes:
                last_bytes, last_change = state.get("bytes_done", 0), self.clock()
            elif self.clock() - last_change > STALL_S:
                raise ActionFailed(f"the fetch of {digest} on {c.node} made no progress for {STALL_S:g}s")
            await trio.sleep(self.poll_s)

    async def start(self, c: Change) -> str:
        node, d = self.d.nodes[c.node], c.details
        # Weights can vanish between plan and apply: ask right before starting.
        held = await self.client.weights(node, d["digest"])
        if held is None or held.get("state") != "present":
            raise ActionFailed(f"{c.node} does not hold {d['model']} ({d['digest']}) any more; plan again")
        await self.client.start_server(node, {"id": d["server_id"], "model": d["digest"], "port": d["port"],
                                              "host": d["host"], "settings": d["settings"]})
        deadline = self.clock() + float(d["settings"].get("startup_timeout_s", 300)) + 30
        while True:
            s = await self.client.server(node, d["server_id"])
            if s is None:
                raise ActionFailed(f"{c.node} lost server {d['server_id']} while it started")
            if s["state"] == "running":
                return f"{d['server_id']} running on {c.node}:{d['port']} (pid {s['pid']})"
            if s["state"] in ("failed", "stopped"):
                raise ActionFailed(f"server {d['server_id']} on {c.node} failed: {s.get('reason')}")
            if self.clock() > deadline:
                raise ActionFailed(f"server {d['server_id']} on {c.node} still {s['state']} past its startup timeout")
            await trio.sleep(self.poll_s)
