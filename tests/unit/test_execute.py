"""The executor's scheduling with a fake agent client: order, skipping, bounded parallelism."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from reconciler.execute import ActionFailed, Executor
from reconciler.model import ControlPlaneSpec, Desired, NodeSpec
from reconciler.plan import Action, Change, Plan


class FakeClient:
    def __init__(self, fail: set[str]) -> None:
        self.fail = fail
        self.log: list[str] = []
        self.running = 0
        self.peak = 0

    async def stop_server(self, node: NodeSpec, sid: str) -> None:
        self.running += 1
        self.peak = max(self.peak, self.running)
        await trio.sleep(1)
        self.running -= 1
        self.log.append(f"stop {sid}@{node.name}")
        if sid in self.fail:
            raise ActionFailed(f"{sid} refused to stop")

    async def delete_weights(self, node: NodeSpec, digest: str) -> None:
        self.log.append(f"delete {digest}@{node.name}")


def desired(n: int) -> Desired:
    nodes = {f"n{i}": NodeSpec(f"n{i}", f"10.0.0.{i}") for i in range(n)}
    return Desired(1, ControlPlaneSpec("n0"), nodes, {}, (), {})


def stop(i: int, deps: tuple[str, ...] = ()) -> Change:
    return Change(Action.STOP, f"server.s{i}@n{i}", f"n{i}", "drift", deps, {"server_id": f"s{i}"})


def run(plan: Plan, client: FakeClient, parallelism: int = 10) -> Any:
    async def go() -> Any:
        return await Executor(desired(20), client, parallelism=parallelism).run(plan)  # type: ignore[arg-type]
    return trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))


def test_dependents_of_a_failure_are_skipped_and_the_rest_finish() -> None:
    changes = (stop(1), stop(2, ("server.s1@n1",)), stop(3, ("server.s2@n2",)), stop(4))
    client = FakeClient(fail={"s1"})
    results = {r.address: r for r in run(Plan(changes, ()), client)}
    assert results["server.s1@n1"].status == "failed" and "refused" in results["server.s1@n1"].message
    assert results["server.s2@n2"].status == "skipped" and "server.s1@n1" in results["server.s2@n2"].message
    assert results["server.s3@n3"].status == "skipped"
    assert results["server.s4@n4"].status == "done"
    assert "stop s2@n2" not in client.log


def test_parallelism_is_bounded() -> None:
    client = FakeClient(fail=set())
    results = run(Plan(tuple(stop(i) for i in range(12)), ()), client, parallelism=3)
    assert all(r.status == "done" for r in results)
    assert client.peak == 3
