"""Draining around a replace: apply's Drainer and serve's DrainWatcher meeting on the state store's
drains table, each with its own connection to one SQLite file as the two processes have, on trio's
fake clock. (tests/e2e/test_day_to_day.py runs the real processes under client load.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection

import trio
import trio.testing

from reconciler.agents.errors import AgentHTTPError
from reconciler.applying.drain import Drainer
from reconciler.applying.execute import Executor
from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
from reconciler.planning.plan import Action, Change, Plan
from reconciler.serve.drains import DrainWatcher
from reconciler.serve.heartbeat import View
from reconciler.state.store import Drain, StateStore
from tests.unit.test_execute import FakeClient

SID = "chat@a"
CHANGE = Change(Action.REPLACE, "server.chat@a", "a", "changed: context_length 256 → 512",
                details={"server_id": SID, "cluster": "chat"})


class Serve:
    """serve's side: its own connection, a router's in-flight count, and the refreshes it asked."""

    def __init__(self, tmp: Path) -> None:
        self.store = StateStore(tmp)
        self.view = View()
        self.in_flight = {SID: 0}
        self.refreshed: list[list[str]] = []
        self.watcher = DrainWatcher(self.store.drains, self.view, lambda sid: self.in_flight.get(sid, 0),
                                    self.refresh, now=lambda: "T")

    async def refresh(self, nodes: Collection[str]) -> None:
        self.refreshed.append(list(nodes))


def apply_side(tmp: Path, grace_s: float = 30, ack_s: float = 2) -> tuple[StateStore, Drainer, list[str]]:
    store = StateStore(tmp)
    lock, _ = store.applies.acquire("fleet apply")
    notes: list[str] = []
    return store, Drainer(store.drains, lock.id, clock=trio.current_time, grace_s=grace_s, ack_s=ack_s), notes


def test_drained_at_once_waited_for_then_admitted_after_a_fresh_look(tmp_path: Path) -> None:
    serve = Serve(tmp_path)
    store, drainer, notes = apply_side(tmp_path, grace_s=10)
    serve.in_flight[SID] = 2

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve.watcher.run)

            async def finish_requests() -> None:
                await trio.sleep(1)
                serve.in_flight[SID] = 0

            nursery.start_soon(finish_requests)
            started = trio.current_time()
            async with drainer.around(CHANGE, notes.append):
                assert SID in serve.view.draining  # out of routing
                assert trio.current_time() - started >= 1  # waited for the two requests
                assert serve.refreshed == []
                row = store.drains.get(SID)
                assert row is not None and row.seen == "drained"
            assert SID not in serve.view.draining and serve.refreshed == [["a"]]
            assert store.drains.get(SID) is None
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert notes[0].startswith("draining chat@a: 2 request(s) in flight")
    assert notes[1:] == ["drained chat@a: no request in flight", "chat@a is back in routing"]


def test_seen_within_a_tick(tmp_path: Path) -> None:
    serve = Serve(tmp_path)
    store, drainer, notes = apply_side(tmp_path)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve.watcher.run)
            await trio.sleep(0.2)  # the watcher idles: nothing to drain
            asked = trio.current_time()
            holder = store.applies.holder()
            assert holder is not None
            store.drains.ask(Drain(SID, "a", "chat", holder.id, "drain", 30, "T"))
            while SID not in serve.view.draining:
                await trio.sleep(0.001)
            assert trio.current_time() - asked <= 0.05 + 1e-9
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_grace_period_bounds_the_wait(tmp_path: Path) -> None:
    serve = Serve(tmp_path)
    serve.in_flight[SID] = 1  # a stream that never ends
    _, drainer, notes = apply_side(tmp_path, grace_s=5)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve.watcher.run)
            started = trio.current_time()
            async with drainer.around(CHANGE, notes.append):
                assert 5 <= trio.current_time() - started < 6
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "1 request(s) still in flight after the 5s grace period" in notes[1]


def test_without_a_serve_the_replace_goes_on_after_the_ack_wait(tmp_path: Path) -> None:
    store, drainer, notes = apply_side(tmp_path, ack_s=2)

    async def main() -> None:
        started = trio.current_time()
        async with drainer.around(CHANGE, notes.append):
            assert 2 <= trio.current_time() - started < 2.2
        assert store.drains.get(SID) is None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert notes == ["no fleet serve took chat@a out of routing within 2s (none running?): replacing it "
                     "without draining"]


def test_a_failed_start_is_still_handed_back(tmp_path: Path) -> None:
    serve = Serve(tmp_path)
    store, drainer, notes = apply_side(tmp_path)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve.watcher.run)
            try:
                async with drainer.around(CHANGE, notes.append):
                    raise RuntimeError("server_failed")
            except RuntimeError:
                pass
            assert serve.refreshed == [["a"]] and SID not in serve.view.draining
            assert store.drains.get(SID) is None
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_drain_left_by_an_apply_that_is_gone_holds_nothing_out(tmp_path: Path) -> None:
    serve = Serve(tmp_path)
    store = StateStore(tmp_path)
    store.drains.ask(Drain(SID, "a", "chat", "not-the-lock", "drain", 30, "T"))
    lock, _ = store.applies.acquire("fleet apply")
    store.drains.ask(Drain("chat@b", "b", "chat", lock.id, "drain", 30, "T"))
    trio.run(serve.watcher.tick)
    assert serve.view.draining == {"chat@b"}
    store.applies.release(lock.id)  # the apply ended without cleaning up: its drain counts no more
    trio.run(serve.watcher.tick)
    assert serve.view.draining == set()


def _replace(node: str) -> Change:
    sid = f"chat@{node}"
    return Change(Action.REPLACE, f"server.{sid}", node, "changed: context_length 256 → 512",
                  ("server.chat@a",) if node == "b" else (),
                  {"server_id": sid, "cluster": "chat", "digest": DIGEST, "model": "m", "port": 9001,
                   "host": "0.0.0.0", "settings": {"startup_timeout_s": 60}})


DIGEST = "sha256:" + "ab" * 32


def _desired(members: tuple[str, ...]) -> Desired:
    nodes = {n: NodeSpec(n, f"10.0.0.{i}") for i, n in enumerate(["a", "b"], 1)}
    return Desired(1, ControlPlaneSpec("a"), nodes, {"m": ModelSpec("m", "safetensors", DIGEST, "a")}, (),
                   {"chat": ClusterSpec("chat", "m", members, 9001)})


def test_the_executor_drains_each_member_of_a_cluster_of_several_around_its_replace(tmp_path: Path) -> None:
    """Each member stopped only once drained, and handed back before the next is drained."""
    serve = Serve(tmp_path)
    serve.in_flight["chat@b"] = 0
    _, drainer, _ = apply_side(tmp_path)
    client = FakeClient()
    client.server_states = ["running"]
    events: list[str] = []

    def progress(event: str, data: dict[str, Any]) -> None:
        if event == "drain":
            events.append(data["message"].split(":")[0])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve.watcher.run)
            original = client.stop_server

            async def stop(node: NodeSpec, sid: str) -> None:
                assert serve.view.draining == {sid}  # out of routing while it stops, and alone
                events.append(f"stop {sid}")
                await original(node, sid)

            client.stop_server = stop  # type: ignore[method-assign]
            results = await Executor(_desired(("a", "b")), client, clock=trio.current_time, drains=drainer,
                                     progress=progress).run(Plan((_replace("a"), _replace("b")), ()))
            assert [r.status for r in results] == ["done", "done"]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert events == ["draining chat@a", "drained chat@a", "stop chat@a", "chat@a is back in routing",
                      "draining chat@b", "drained chat@b", "stop chat@b", "chat@b is back in routing"]


def test_a_cluster_of_one_is_replaced_without_a_drain(tmp_path: Path) -> None:
    store, drainer, _ = apply_side(tmp_path)
    client = FakeClient()
    client.server_states = ["running"]

    async def main() -> None:
        change = _replace("a")
        results = await Executor(_desired(("a",)), client, clock=trio.current_time, drains=drainer).run(
            Plan((change,), ()))
        assert results[0].status == "done" and store.drains.get("chat@a") is None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert client.log[:2] == ["stop", "stopped chat@a"]


def test_a_start_refused_for_weights_not_held_is_weights_gone() -> None:
    client = FakeClient()
    refusal = AgentHTTPError(NodeSpec("a", "10.0.0.1"), 409, "model sha256:ab… is not held on this node")
    refusal.agent_code = "model_not_held"
    client.failures["start"] = [refusal]

    async def main() -> None:
        change = Change(Action.START, "server.chat@a", "a", "wanted", (), _replace("a").details)
        (result,) = await Executor(_desired(("a",)), client, clock=trio.current_time).run(Plan((change,), ()))
        assert result.status == "failed" and result.code == "weights_gone"
        assert "is not held on this node" in result.message and "plan again" in result.message

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "weights" not in client.log  # no question before the start: the start's refusal says it
