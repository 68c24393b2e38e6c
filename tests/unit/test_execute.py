"""The executor with a fake agent client on a fake clock: order, skipping, bounded parallelism,
and bounded retries of retryable errors (counted in each result)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from reconciler.agents.errors import AgentError, AgentHTTPError, NodeAuthRejected, NodeUnreachable
from reconciler.applying.execute import RETRIES, ActionFailed, Executor, Result
from reconciler.core.desired import ControlPlaneSpec, Desired, NodeSpec
from reconciler.planning.plan import Action, Change, Plan
from reconciler.cli.render import result_line

DIGEST = "sha256:" + "ab" * 32


class FakeClient:
    """An agent per node, in memory. `failures[call]` lists errors the next calls of that kind
    raise, one per call, before they answer again."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.fail = fail or set()
        self.failures: dict[str, list[AgentError]] = {}
        self.log: list[str] = []
        self.running = 0
        self.peak = 0
        self.fetch_progress = [0, 40, 80]  # bytes_done on successive polls, then present
        self.fetch_end: dict[str, Any] = {"state": "present", "bytes": 100}
        self.server_states = ["starting", "starting", "running"]
        self.servers: set[str] = set()
        # Pipeline stages: running only once every stage of the group was started (the group formed);
        # a stage in `dies` fails with that reason once the group formed.
        self.group: set[str] = set()
        self.dies: dict[str, str] = {}
        self.bodies: dict[str, dict[str, Any]] = {}

    def _maybe_fail(self, call: str) -> None:
        self.log.append(call)
        queue = self.failures.get(call)
        if queue:
            raise queue.pop(0)

    async def stop_server(self, node: NodeSpec, sid: str) -> None:
        self.running += 1
        self.peak = max(self.peak, self.running)
        await trio.sleep(1)
        self.running -= 1
        self._maybe_fail("stop")
        self.log.append(f"stopped {sid}")
        if sid in self.fail:
            raise ActionFailed("stop_refused", f"{sid} refused to stop")

    async def delete_weights(self, node: NodeSpec, digest: str) -> None:
        self._maybe_fail("delete")

    async def fetch(self, node: NodeSpec, digest: str, body: dict[str, Any]) -> dict[str, Any]:
        self._maybe_fail("fetch")
        return {"state": "fetching"}

    async def weights(self, node: NodeSpec, digest: str) -> dict[str, Any] | None:
        self._maybe_fail("weights")
        if self.fetch_progress:
            return {"state": "fetching", "bytes_done": self.fetch_progress.pop(0), "bytes_total": 100}
        return self.fetch_end

    async def start_server(self, node: NodeSpec, body: dict[str, Any]) -> dict[str, Any]:
        self.servers.add(body["id"])  # lands even when the answer is then lost
        self.bodies[body["id"]] = body
        self._maybe_fail("start")
        self.log.append(f"start {body['id']}")
        return {"state": "starting"}

    async def server(self, node: NodeSpec, sid: str) -> dict[str, Any] | None:
        self._maybe_fail("server")
        if sid in self.group:
            formed = self.group <= self.servers
            if formed and sid in self.dies:
                return {"id": sid, "state": "failed", "pid": 7, "reason": self.dies[sid]}
            return {"id": sid, "state": "running" if formed else "starting", "pid": 7, "reason": None}
        state = self.server_states.pop(0) if len(self.server_states) > 1 else self.server_states[0]
        return {"id": sid, "state": state, "pid": 42, "reason": "exited with code 1"}


def desired(n: int) -> Desired:
    nodes = {f"n{i}": NodeSpec(f"n{i}", f"10.0.0.{i}") for i in range(n)}
    return Desired(1, ControlPlaneSpec("n0"), nodes, {}, (), {})


def stop(i: int, deps: tuple[str, ...] = ()) -> Change:
    return Change(Action.STOP, f"server.s{i}@n{i}", f"n{i}", "drift", deps, {"server_id": f"s{i}"})


REPLICATE = Change(Action.REPLICATE, "replica.m@n1", "n1", "wanted", (),
                   {"digest": DIGEST, "peer": "n0", "model": "m"})
START = Change(Action.START, "server.chat@n1", "n1", "wanted", (),
               {"server_id": "chat@n1", "digest": DIGEST, "model": "m", "port": 9001, "host": "0.0.0.0",
                "settings": {"startup_timeout_s": 60}})


def run(plan: Plan, client: FakeClient, parallelism: int = 10, events: list[str] | None = None) -> list[Result]:
    def progress(event: str, data: dict[str, Any]) -> None:
        if events is not None and event == "retry":
            events.append(f"retry {data['attempt']}: {data['error'].code}")

    async def go() -> list[Result]:
        return await Executor(desired(20), client, parallelism=parallelism, clock=trio.current_time,
                              progress=progress).run(plan)
    return trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))


def one(change: Change, client: FakeClient, events: list[str] | None = None) -> Result:
    if change.action is Action.START:
        client.fetch_progress = []  # the weights are there to start from
    (result,) = run(Plan((change,), ()), client, events=events)
    return result


def unreachable(node: str = "n1") -> NodeUnreachable:
    return NodeUnreachable(NodeSpec(node, "10.0.0.1"), "connection refused")


def test_dependents_of_a_failure_are_skipped_and_the_rest_finish() -> None:
    changes = (stop(1), stop(2, ("server.s1@n1",)), stop(3, ("server.s2@n2",)), stop(4))
    client = FakeClient(fail={"s1"})
    results = {r.address: r for r in run(Plan(changes, ()), client)}
    assert results["server.s1@n1"].status == "failed" and "refused" in results["server.s1@n1"].message
    assert results["server.s1@n1"].code == "stop_refused"
    assert results["server.s2@n2"].status == "skipped" and "server.s1@n1" in results["server.s2@n2"].message
    assert results["server.s3@n3"].status == "skipped"
    assert results["server.s4@n4"].status == "done"
    assert sorted(e for e in client.log if e.startswith("stopped")) == ["stopped s1", "stopped s4"]


def test_parallelism_is_bounded() -> None:
    client = FakeClient()
    results = run(Plan(tuple(stop(i) for i in range(12)), ()), client, parallelism=3)
    assert all(r.status == "done" for r in results)
    assert client.peak == 3


def test_a_replicate_goes_on_through_a_lost_answer_while_polling() -> None:
    client = FakeClient()
    client.failures["weights"] = [unreachable()]
    events: list[str] = []
    result = one(REPLICATE, client, events)
    assert result.status == "done" and result.retries == 1 and "holds" in result.message
    assert events == ["retry 1: node_unreachable"]
    assert result_line(result).endswith(", 1 retry)")


@pytest.mark.parametrize("call, change", [("fetch", REPLICATE), ("weights", REPLICATE), ("stop", stop(1)),
                                          ("server", START), ("delete", Change(Action.DELETE, "replica.m@n1", "n1",
                                                                                 "unwanted", (), {"digest": DIGEST}))])
def test_retryable_errors_are_retried_until_the_call_answers(call: str, change: Change) -> None:
    client = FakeClient()
    client.failures[call] = [unreachable(), AgentHTTPError(NodeSpec("n1", "10.0.0.1"), 503, "busy"), unreachable()]
    result = one(change, client)
    assert result.status == "done" and result.retries == 3 and result.code is None


def test_retries_are_bounded_and_the_error_keeps_its_code() -> None:
    client = FakeClient()
    client.failures["weights"] = [unreachable() for _ in range(100)]
    result = one(REPLICATE, client)
    assert result.status == "failed" and result.code == "node_unreachable"
    assert result.retries == RETRIES and client.log.count("weights") == RETRIES + 1
    assert "did not answer: connection refused" in result.message
    line = result_line(result)
    assert "[node_unreachable]" in line and f"{RETRIES} retries)" in line


def test_a_final_error_is_not_retried() -> None:
    client = FakeClient()
    client.failures["stop"] = [NodeAuthRejected(NodeSpec("n1", "10.0.0.1"), "wrong secret")]
    result = one(stop(1), client)
    assert result.status == "failed" and result.code == "node_auth_rejected" and result.retries == 0


def test_a_start_whose_answer_was_lost_finds_its_server_on_the_retry() -> None:
    client = FakeClient()
    node = NodeSpec("n1", "10.0.0.1")
    client.failures["start"] = [unreachable(), AgentHTTPError(node, 409, "server chat@n1 is already starting")]
    result = one(START, client)
    assert result.status == "done" and result.retries == 1 and "pid 42" in result.message


def test_a_server_that_exists_before_the_start_is_a_failure() -> None:
    client = FakeClient()
    client.failures["start"] = [AgentHTTPError(NodeSpec("n1", "10.0.0.1"), 409, "server chat@n1 is already running")]
    result = one(START, client)
    assert result.status == "failed" and "409" in result.message and result.retries == 0


def test_a_resumable_fetch_failure_is_resumed_a_bounded_number_of_times() -> None:
    client = FakeClient()
    client.fetch_progress = []
    client.fetch_end = {"state": "failed", "error": "peer closed the connection", "resumable": True}
    result = one(REPLICATE, client)
    assert result.status == "failed" and result.code == "fetch_failed"
    assert client.log.count("fetch") == RETRIES + 1 and result.retries == RETRIES
    assert f"resumed {RETRIES} times" in result.message


def test_a_final_fetch_failure_is_not_resumed() -> None:
    client = FakeClient()
    client.fetch_progress = []
    client.fetch_end = {"state": "failed", "error": "digest mismatch"}
    result = one(REPLICATE, client)
    assert result.status == "failed" and result.code == "fetch_failed" and client.log.count("fetch") == 1


def test_a_fetch_without_progress_stalls_and_a_server_past_its_timeout_fails() -> None:
    client = FakeClient()
    client.fetch_progress = [5] * 100_000
    stalled = one(REPLICATE, client)
    assert stalled.code == "fetch_stalled" and "no progress for 300s" in stalled.message
    client = FakeClient()
    client.server_states = ["starting"]
    late = one(START, client)
    assert late.code == "startup_timeout" and "still starting past its startup timeout" in late.message
    assert 90 <= late.seconds <= 91  # 60 s of its own startup_timeout_s, 30 s of grace


def test_a_server_that_fails_to_start_says_why() -> None:
    client = FakeClient()
    client.server_states = ["starting", "failed"]
    result = one(START, client)
    assert result.code == "server_failed" and "exited with code 1" in result.message


def stage(rank: int, action: Action = Action.START, deps: tuple[str, ...] = (), world: int = 3) -> Change:
    stages = [{"node": f"n{i + 1}", "address": f"10.0.0.{i + 1}", "layers": f"{10 * i}-{10 * i + 9}"}
              for i in range(world)]
    details: dict[str, Any] = {
        "cluster": "big", "server_id": f"big@n{rank + 1}", "digest": DIGEST, "model": "m", "port": 9003,
        "host": f"10.0.0.{rank + 1}", "settings": {"startup_timeout_s": 60},
        "pipeline": {"group": "0123456789abcdef", "rank": rank, "world_size": world,
                     "rendezvous": {"address": "10.0.0.1", "port": 9103}, "stages": stages}}
    if action is Action.REPLACE:
        details["before"] = {"model": DIGEST, "port": 9003, "settings": {}}
    return Change(action, f"server.big@n{rank + 1}", f"n{rank + 1}", "stage", deps, details)


def group_client(world: int = 3) -> FakeClient:
    client = FakeClient()
    client.fetch_progress = []  # every stage's slice is there
    client.group = {f"big@n{i + 1}" for i in range(world)}
    return client


def test_a_group_takes_one_slot_and_forms_under_parallelism_1() -> None:
    """Started one at a time, no stage would ever run: they need each other. A group is one unit."""
    client = group_client()
    changes = (stage(0), stage(1), stage(2), stop(7))
    results = run(Plan(changes, ()), client, parallelism=1)
    assert [r.status for r in results] == ["done"] * 4, [r.message for r in results]
    assert results[1].message == "big@n2 running on n2:9003 (pid 7), stage 1 of 3 of group 0123456789abcdef"
    # The agent is handed each stage's place in its group.
    assert client.bodies["big@n3"]["pipeline"]["rank"] == 2
    assert client.bodies["big@n3"]["pipeline"]["rendezvous"] == {"address": "10.0.0.1", "port": 9103}
    assert client.bodies["big@n1"]["model"] == DIGEST


def test_one_stage_failing_fails_the_group_with_its_reason() -> None:
    client = group_client()
    client.dies["big@n2"] = "pipeline stage 1 (node n2, 10.0.0.2:9003, layers 10-19) could not load: out of memory"
    results = {r.address: r for r in run(Plan((stage(0), stage(1), stage(2)), ()), client)}
    assert {r.status for r in results.values()} == {"failed"}
    assert {r.code for r in results.values()} == {"server_failed"}
    assert results["server.big@n2"].message == ("server big@n2 on n2 failed: pipeline stage 1 (node n2, "
                                                "10.0.0.2:9003, layers 10-19) could not load: out of memory")
    other = results["server.big@n1"].message
    assert other.startswith("pipeline big (group 0123456789abcdef) failed: stage 1 on n2: server big@n2 on n2 failed:")
    assert other.endswith("could not load: out of memory")
    assert "[server_failed]" in result_line(results["server.big@n3"])


def test_a_replaced_group_is_stopped_everywhere_before_any_stage_starts() -> None:
    client = group_client(2)
    results = run(Plan((stage(0, Action.REPLACE, world=2), stage(1, Action.REPLACE, world=2)), ()), client)
    assert [r.status for r in results] == ["done", "done"]
    order = [e for e in client.log if e.startswith(("stopped", "start "))]
    assert sorted(order[:2]) == ["stopped big@n1", "stopped big@n2"]
    assert sorted(order[2:]) == ["start big@n1", "start big@n2"]


def test_a_stage_that_cannot_stop_fails_the_group_before_anything_starts() -> None:
    client = group_client(2)
    client.fail = {"big@n2"}
    results = run(Plan((stage(0, Action.REPLACE, world=2), stage(1, Action.REPLACE, world=2)), ()), client)
    assert [r.code for r in results] == ["stop_refused", "stop_refused"]
    assert "stage 1 on n2: big@n2 refused to stop" in results[0].message
    assert not any(e.startswith("start ") for e in client.log)


def test_a_group_whose_stage_waits_on_a_failure_is_skipped_whole() -> None:
    client = group_client(2)
    client.fail = {"s5"}
    changes = (stop(5), stage(0, world=2), stage(1, deps=("server.s5@n5",), world=2))
    results = {r.address: r for r in run(Plan(changes, ()), client)}
    assert results["server.big@n1"].status == results["server.big@n2"].status == "skipped"
    assert "server.s5@n5" in results["server.big@n1"].message
    assert not any(e.startswith("start ") for e in client.log)


def test_a_group_that_never_forms_times_out_as_a_whole() -> None:
    client = group_client(3)
    client.group.add("big@n9")  # a stage that is never started: the group cannot form
    results = run(Plan((stage(0), stage(1), stage(2)), ()), client)
    assert {r.code for r in results} == {"startup_timeout"}
    assert all(90 <= r.seconds <= 91 for r in results)


class TimedFetch(FakeClient):
    """A fetch of `total` bytes at `rate` bytes/s on the run's clock, reporting its average rate."""

    def __init__(self, total: int, rate: float) -> None:
        super().__init__()
        self.total, self.rate, self.began, self.asked = total, rate, 0.0, 0

    async def fetch(self, node: NodeSpec, digest: str, body: dict[str, Any]) -> dict[str, Any]:
        self.began = trio.current_time()
        return {"state": "fetching"}

    async def weights(self, node: NodeSpec, digest: str) -> dict[str, Any] | None:
        self.asked += 1
        elapsed = trio.current_time() - self.began
        done = min(self.total, int(elapsed * self.rate))
        if done >= self.total:
            return {"state": "present", "bytes": self.total}
        return {"state": "fetching", "bytes_done": done, "bytes_total": self.total,
                "rate_bytes_per_s": round(done / elapsed) if elapsed else 0}


def test_a_long_fetch_is_asked_about_less_often_and_its_end_seen_as_soon() -> None:
    # 30 s at a steady rate: every 0.25 s was 120 answers (each ~2.5 ms of the busy agent's CPU);
    # paced by the time left, at most one a second until the last seconds.
    client = TimedFetch(3_000_000_000, 100_000_000.0)

    async def go() -> tuple[list[Result], float]:
        results = await Executor(desired(3), client, clock=trio.current_time).run(Plan((REPLICATE,), ()))
        return results, trio.current_time()
    (result,), ended = trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))
    assert result.status == "done"
    assert client.asked <= 45, client.asked
    assert ended - 30.0 <= 0.26  # the end is seen within one short poll


def test_a_fetch_whose_rate_rises_is_asked_about_by_its_recent_rate() -> None:
    # The agent's average counts a slow start (a chained fetch waiting for its peer's first piece):
    # the last two answers' rate is the faster one, and the end is not overshot by a long pause.
    class SlowStart(TimedFetch):
        async def weights(self, node: NodeSpec, digest: str) -> dict[str, Any] | None:
            self.asked += 1
            elapsed = trio.current_time() - self.began
            done = 0 if elapsed < 20 else min(self.total, int((elapsed - 20) * self.rate))
            if done >= self.total:
                return {"state": "present", "bytes": self.total}
            return {"state": "fetching", "bytes_done": done, "bytes_total": self.total,
                    "rate_bytes_per_s": round(done / elapsed) if elapsed else 0}

    client = SlowStart(1_000_000_000, 100_000_000.0)

    async def go() -> float:
        await Executor(desired(3), client, clock=trio.current_time).run(Plan((REPLICATE,), ()))
        return trio.current_time()
    ended = trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ended - 30.0 <= 0.26


def test_a_fetch_whose_agent_reports_figures_that_are_not_numbers_is_asked_about_every_poll() -> None:
    class Garbled(FakeClient):
        async def weights(self, node: NodeSpec, digest: str) -> dict[str, Any] | None:
            answer = await super().weights(node, digest)
            if answer is not None and answer["state"] == "fetching":
                answer = {**answer, "bytes_total": "lots", "rate_bytes_per_s": [1]}
            return answer

    result = one(REPLICATE, Garbled())
    assert result.status == "done" and "holds" in result.message
