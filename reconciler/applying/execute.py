"""Run a plan: in dependency order, bounded parallelism; a failure skips what depends on it and
lets the rest finish. The stages of a pipeline group are one unit (one slot): stopped, started
together and waited for as a whole, failing together. An agent error tagged retryable is retried
a bounded number of times with backoff, and each result says how many retries it took. Progress
goes to an injected hook; time to an injected clock and sleep. A member of a cluster of several is
drained around its replace (reconciler/applying/drain.py), so that the others serve meanwhile."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, TypeVar

import trio

from reconciler.agents.errors import AgentError, AgentHTTPError
from reconciler.applying.drain import Drainer
from reconciler.core.desired import Desired, NodeSpec
from reconciler.planning.pipeline import group_of
from reconciler.planning.plan import Action, Change, Plan

POLL_S = 0.25
# A long fetch is asked about less often: each answer costs its agent ~2.5 ms of CPU (hypercorn,
# the app) on a node busy receiving, 4 a second per fetch; the pause is a quarter of the time the
# fetch has left at its faster rate (the agent's average, or the last two answers'), so the end is
# still seen within POLL_S of the estimate, between POLL_S and FETCH_POLL_MAX_S.
FETCH_POLL_MAX_S = 1.0
STALL_S = 300.0  # a fetch that makes no progress for this long is failed (it can be resumed)
STARTUP_GRACE_S = 30.0  # on top of a server's own startup_timeout_s
RETRIES = 5  # consecutive retryable failures of one call before its action fails
BACKOFF_S = 0.5  # the first wait before a retry; doubled each time, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 8.0

T = TypeVar("T")


class AgentCalls(Protocol):
    """What the executor asks of an agent (AgentClient in production)."""

    async def fetch(self, node: NodeSpec, digest: str, body: dict[str, Any]) -> dict[str, Any]: ...
    async def weights(self, node: NodeSpec, digest: str) -> dict[str, Any] | None: ...
    async def delete_weights(self, node: NodeSpec, digest: str) -> None: ...
    async def start_server(self, node: NodeSpec, body: dict[str, Any]) -> dict[str, Any]: ...
    async def server(self, node: NodeSpec, sid: str) -> dict[str, Any] | None: ...
    async def stop_server(self, node: NodeSpec, sid: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Result:
    address: str
    action: str
    status: str  # done | failed | skipped
    message: str
    seconds: float
    retries: int = 0  # agent calls retried after a retryable error
    code: str | None = None  # the stable code of a failure


class ActionFailed(Exception):
    """An action that cannot complete; `code` is stable (fetch_failed, server_failed, …)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Tally:
    """Retries counted for one action (mutable: the calls of one action add to it)."""

    __slots__ = ("change", "retries")

    def __init__(self, change: Change) -> None:
        self.change, self.retries = change, 0


ProgressHook = Callable[[str, dict[str, Any]], None]  # (event, data): started, progress, retry, finished


class Executor:
    def __init__(self, desired: Desired, client: AgentCalls, *, parallelism: int = 10,
                 progress: ProgressHook | None = None, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Awaitable[None]] = trio.sleep,
                 retries: int = RETRIES, backoff_s: float = BACKOFF_S, drains: Drainer | None = None) -> None:
        self.d = desired
        self.client = client
        self.limiter = trio.CapacityLimiter(max(1, parallelism))
        self.progress = progress or (lambda event, data: None)
        self.poll_s = poll_s
        self.clock = clock
        self.sleep = sleep
        self.retries = retries
        self.backoff_s = backoff_s
        self.drains = drains  # drains a member of a cluster of several before its replace (drain.py)
        self._accepted: dict[str, trio.Event] = {}  # per run: a fetch's PUT was accepted by its agent

    async def run(self, plan: Plan) -> list[Result]:
        done: dict[str, trio.Event] = {c.address: trio.Event() for c in plan.changes}
        # A fetch chained from another (its peer is that fetch's node) starts once that fetch is
        # accepted, not done: the peer forwards pieces as they arrive (reconciler/planning/fanout.py).
        self._accepted = accepted = {c.address: trio.Event() for c in plan.changes}
        by_address = {c.address: c for c in plan.changes}
        results: dict[str, Result] = {}
        units: dict[str, list[Change]] = {}  # a pipeline group's stages, or one change alone
        for c in plan.changes:
            group = group_of(c) if c.action in (Action.START, Action.REPLACE) else None
            units.setdefault(f"group {group}" if group else c.address, []).append(c)

        async def one(unit: list[Change]) -> None:
            inside = {c.address for c in unit}
            deps = list(dict.fromkeys(d for c in unit for d in c.depends_on if d not in inside))
            for dep in deps:
                if dep in done:
                    chained = all(streams_from(c, by_address[dep]) for c in unit)
                    await (accepted if chained else done)[dep].wait()
            failed = [d for d in deps if d in results and results[d].status != "done"]
            if failed:
                for c in unit:
                    results[c.address] = Result(c.address, c.action.value, "skipped", f"skipped: depends on "
                                                f"{', '.join(failed)}, which did not complete", 0.0)
            else:
                async with self.limiter:  # a group takes one slot: its stages cannot form one at a time
                    start = self.clock()
                    for c in unit:
                        self.progress("started", {"change": c})
                    tallies = [_Tally(c) for c in unit]
                    for tally, (message, code) in zip(tallies, await self.apply_unit(tallies)):
                        c = tally.change
                        results[c.address] = Result(c.address, c.action.value, "failed" if code else "done",
                                                    message, self.clock() - start, tally.retries, code)
            for c in unit:
                self.progress("finished", {"change": c, "result": results[c.address]})
                accepted[c.address].set()
                done[c.address].set()

        async with trio.open_nursery() as nursery:
            for unit in units.values():
                nursery.start_soon(one, unit)
        return [results[c.address] for c in plan.changes]

    async def apply_unit(self, tallies: list[_Tally]) -> list[tuple[str, str | None]]:
        """(message, failure code or None) for each change of a unit. A group's stages: every
        replaced one stopped first, then all started at once and waited for together; the first to
        fail stops the waiting and fails every stage with its reason."""
        if len(tallies) == 1 and group_of(tallies[0].change) is None:
            try:
                return [(await self.apply(tallies[0].change, tallies[0]), None)]
            except (ActionFailed, AgentError) as exc:
                return [(str(exc), exc.code)]
        messages: dict[str, str] = {}
        failure: list[tuple[Change, ActionFailed | AgentError]] = []

        async def step(tally: _Tally, stage: Callable[[Change, _Tally], Awaitable[str]],
                       cancel: trio.CancelScope) -> None:
            try:
                messages[tally.change.address] = await stage(tally.change, tally)
            except (ActionFailed, AgentError) as exc:
                failure.append((tally.change, exc))
                cancel.cancel()

        for stage, which in ((self.stop_stage, [t for t in tallies if t.change.action is Action.REPLACE]),
                             (self.start, tallies)):
            async with trio.open_nursery() as nursery:
                for tally in which:
                    nursery.start_soon(step, tally, stage, nursery.cancel_scope)
            if failure:
                break
        if not failure:
            return [(messages[t.change.address] + _stage_of(t.change), None) for t in tallies]
        culprit, err = failure[0]
        p = culprit.details["pipeline"]
        return [(str(err) if t.change is culprit else f"pipeline {culprit.details['cluster']} (group {p['group']}) "
                 f"failed: stage {p['rank']} on {culprit.node}: {err}", err.code) for t in tallies]

    async def stop_stage(self, c: Change, tally: _Tally) -> str:
        sid = c.details["server_id"]
        await self.call(tally, lambda: self.client.stop_server(self.d.nodes[c.node], sid))
        return f"stopped {sid} on {c.node}"

    async def call(self, tally: _Tally, ask: Callable[[], Awaitable[T]]) -> T:
        """`ask()`, asked again after a retryable AgentError, up to `retries` times in a row with
        doubling waits: one lost answer in a long fetch's polling does not fail the fetch."""
        failures = 0
        while True:
            try:
                return await ask()
            except AgentError as exc:
                if not exc.retryable or failures >= self.retries:
                    raise
                failures += 1
                tally.retries += 1
                self.progress("retry", {"change": tally.change, "error": exc, "attempt": failures})
                await self.sleep(min(self.backoff_s * 2 ** (failures - 1), BACKOFF_MAX_S))

    async def poll(self, tally: _Tally, ask: Callable[[], Awaitable[T]], judge: Callable[[T], tuple[bool, Any]],
                   limit: float, stalled: Callable[[T], ActionFailed],
                   pause: Callable[[T], float] | None = None) -> T:
        """Ask every poll_s (or `pause(answer)` seconds) until `judge` says done: judge(answer) is
        (done, progress) or raises ActionFailed. The action fails with `stalled(answer)` once progress
        stays the same for `limit` seconds (progress that never changes makes `limit` a deadline)."""
        last: Any = object()
        since = self.clock()
        while True:
            answer = await self.call(tally, ask)
            finished, progress = judge(answer)
            if finished:
                return answer
            if progress != last:
                last, since = progress, self.clock()
            elif self.clock() - since > limit:
                raise stalled(answer)
            await self.sleep(self.poll_s if pause is None else pause(answer))

    async def apply(self, c: Change, tally: _Tally) -> str:
        node = self.d.nodes[c.node]
        if c.action is Action.REPLICATE or "peer" in c.details:  # a replace of a corrupt replica: fetched again
            return await self.replicate(c, tally)
        if c.action is Action.STOP:
            await self.call(tally, lambda: self.client.stop_server(node, c.details["server_id"]))
            return f"stopped {c.details['server_id']} on {c.node}"
        if c.action is Action.DELETE:
            await self.call(tally, lambda: self.client.delete_weights(node, c.details["digest"]))
            return f"deleted {c.details['digest']} from {c.node}"
        if c.action is Action.REPLACE:
            cluster = self.d.clusters.get(c.details["cluster"])
            if self.drains is not None and cluster is not None and len(cluster.members) > 1:
                # The others serve meanwhile: the planner chains a cluster's replaces, one at a time.
                async with self.drains.around(c, lambda message: self.progress("drain", {"change": c,
                                                                                        "message": message})):
                    await self.call(tally, lambda: self.client.stop_server(node, c.details["server_id"]))
                    return await self.start(c, tally)
            await self.call(tally, lambda: self.client.stop_server(node, c.details["server_id"]))
        return await self.start(c, tally)

    async def replicate(self, c: Change, tally: _Tally) -> str:
        node, digest, peer = self.d.nodes[c.node], c.details["digest"], c.details["peer"]
        source = self.d.nodes[peer]
        body: dict[str, Any] = {"peer": source.agent_url, "name": c.details["model"]}
        if source.tls and source.hostname:  # the agent checks the peer's certificate as we do: by its name
            body["peer_hostname"] = source.hostname
        if "bytes" in c.details:  # the plan's figure: the agent refuses a fetch its window cannot hold
            body["bytes"] = c.details["bytes"]
        if c.details.get("layers"):
            body.update(layers=c.details["layers"], source_digest=c.details["source_digest"])
        resumes = 0
        while True:
            await self.call(tally, lambda: self.client.fetch(node, digest, body))
            self._accepted[c.address].set()
            try:
                state = await self.poll(tally, lambda: self.client.weights(node, digest), self._fetched(c),
                                        STALL_S, lambda _: ActionFailed(
                                            "fetch_stalled", f"the fetch of {digest} on {c.node} made no progress "
                                                             f"for {STALL_S:g}s"), self._fetch_pace())
                assert state is not None  # judged present
                return f"{c.node} holds {digest} ({state.get('bytes', 0):,} bytes, verified)"
            except _Resumable as exc:
                # The agent kept what arrived: asking again resumes the fetch where it broke.
                if resumes >= self.retries:
                    raise ActionFailed("fetch_failed", f"{exc} (resumed {resumes} times)") from None
                resumes += 1
                tally.retries += 1
                self.progress("retry", {"change": c, "error": exc, "attempt": resumes})
                await self.sleep(min(self.backoff_s * 2 ** (resumes - 1), BACKOFF_MAX_S))

    def _fetch_pace(self) -> Callable[[dict[str, Any] | None], float]:
        """The pause before asking about a fetch again (FETCH_POLL_MAX_S): a quarter of its time left."""
        seen: list[tuple[float, int]] = []  # (when, bytes_done) of the last answer

        def pause(state: dict[str, Any] | None) -> float:
            try:  # an agent's figures, not checked by a schema: anything else is asked about every poll_s
                now, done = self.clock(), int((state or {}).get("bytes_done") or 0)
                left = int((state or {}).get("bytes_total") or 0) - done
                rate = float((state or {}).get("rate_bytes_per_s") or 0)
            except (TypeError, ValueError, OverflowError):
                return self.poll_s
            if seen and now > seen[0][0]:
                rate = max(rate, (done - seen[0][1]) / (now - seen[0][0]))
            seen[:] = [(now, done)]
            if rate <= 0 or left <= 0:
                return self.poll_s
            return min(max(self.poll_s, FETCH_POLL_MAX_S), max(self.poll_s, left / rate / 4))
        return pause

    def _fetched(self, c: Change) -> Callable[[dict[str, Any] | None], tuple[bool, Any]]:
        def judge(state: dict[str, Any] | None) -> tuple[bool, Any]:
            if state is None:
                raise ActionFailed("fetch_forgotten", f"{c.node} forgot the fetch of {c.details['digest']}")
            if state["state"] == "present":
                return True, None
            if state["state"] == "failed":
                message = f"{c.node} could not fetch {c.details['digest']} from {c.details['peer']}: {state['error']}"
                raise (_Resumable("fetch_failed", message) if state.get("resumable")
                       else ActionFailed(state.get("code") or "fetch_failed", message))
            done = state.get("bytes_done", 0)
            self.progress("progress", {"change": c, "done": done, "total": state.get("bytes_total", 0)})
            return False, done
        return judge

    async def start(self, c: Change, tally: _Tally) -> str:
        node, d = self.d.nodes[c.node], c.details
        body = {"id": d["server_id"], "model": d["digest"], "port": d["port"], "host": d["host"],
                "settings": d["settings"]}
        if "pipeline" in d:  # a stage: the agent hands its place in the group to the stage worker
            body["pipeline"] = d["pipeline"]
        if "gpus" in d:  # the GPUs the plan gave it: the agent shows the worker exactly these
            body["gpus"] = d["gpus"]
        retried = tally.retries
        answer: dict[str, Any] | None = None
        try:
            answer = await self.call(tally, lambda: self.client.start_server(node, body))
        except AgentHTTPError as exc:
            # Weights can vanish between plan and apply: the agent refuses the start (asking it
            # first cost a call per start, a third of an apply's calls).
            if exc.agent_code == "model_not_held":
                raise ActionFailed("weights_gone", f"{c.node} does not hold {d['model']} ({d['digest']}) any more "
                                                   f"({exc}); plan again") from None
            # A start whose answer was lost may have landed: its retry then finds the server there.
            if exc.status != 409 or tally.retries == retried:
                raise

        def judge(s: dict[str, Any] | None) -> tuple[bool, Any]:
            if s is None:
                raise ActionFailed("server_lost", f"{c.node} lost server {d['server_id']} while it started")
            if s["state"] in ("failed", "stopped"):
                raise ActionFailed("server_failed", f"server {d['server_id']} on {c.node} failed: {s.get('reason')}")
            return s["state"] == "running", None

        if answer is not None and answer.get("state") == "running":  # running already: nothing to wait for
            return f"{d['server_id']} running on {c.node}:{d['port']} (pid {answer.get('pid')})"
        limit = float(d["settings"].get("startup_timeout_s", 300)) + STARTUP_GRACE_S
        s = await self.poll(tally, lambda: self.client.server(node, d["server_id"]), judge, limit,
                            lambda s: ActionFailed("startup_timeout", f"server {d['server_id']} on {c.node} still "
                                                   f"{s['state'] if s else '?'} past its startup timeout"))
        assert s is not None  # judged running
        return f"{d['server_id']} running on {c.node}:{d['port']} (pid {s['pid']})"


def streams_from(c: Change, dep: Change) -> bool:
    """Whether fetch `c` takes its bytes from fetch `dep` while `dep` still receives them."""
    return ("peer" in c.details and "peer" in dep.details and c.details["peer"] == dep.node
            and c.details["digest"] == dep.details["digest"] and "layers" not in c.details)


def _stage_of(c: Change) -> str:
    p = c.details["pipeline"]
    return f", stage {p['rank']} of {p['world_size']} of group {p['group']}"


class _Resumable(ActionFailed):
    """A fetch that failed keeping what it received (the agent says `resumable`)."""
