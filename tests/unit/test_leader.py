"""serve/leader.py with a scripted leadership lock and a SQLite record: one
process leads (its heartbeat beats), follows (routes from the rows), steps down when its lock's
session ends and leads again when it can; a follower keeps the workers' credentials it asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Collection

import trio

from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec, Settings
from reconciler.core.observed import Observed, ObservedNode, ObservedServer
from reconciler.serve.heartbeat import Heartbeat, View
from reconciler.serve.leader import Follower, Roles
from reconciler.state.store import StateStore

DIGEST = "sha256:" + "a" * 64


def desired() -> Desired:
    return Desired(1, ControlPlaneSpec("a"), {"a": NodeSpec("a", "127.0.0.2")},
                   {"m": ModelSpec("m", "gguf", DIGEST, "a")}, (),
                   {"c": ClusterSpec("c", "m", ("a",), 9000, Settings())})


def node(credential: str = "") -> ObservedNode:
    server = ObservedServer("c@a", "running", DIGEST, 9000, {}, credential=credential)
    return ObservedNode("a", state={"servers": [{"id": "c@a", "state": "running", "model": DIGEST, "port": 9000}]},
                        servers={"c@a": server})


class ScriptedLock:
    """Held when `free` says so at the moment it is tried; `lost()` ends the session."""

    def __init__(self) -> None:
        self.free, self.holding, self.tries = False, False, 0

    def try_take(self) -> bool:
        self.tries += 1
        if self.free:
            self.holding = True
        return self.holding

    def held(self) -> bool:
        return self.holding

    def close(self) -> None:
        self.holding = False


def test_follows_leads_when_free_steps_down_when_lost(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    writer = StateStore(tmp_path)  # another process's leader
    writer.serve.put_node("a", "online", "T0", state=node().state, error=None)
    lock, view, beats = ScriptedLock(), View(), []

    async def observe(timeout: float, only: Collection[str] | None = None) -> Observed:
        beats.append(trio.current_time())
        return Observed({"a": node("secret")})

    def make(v: View) -> Heartbeat:
        return Heartbeat(desired(), observe, store.serve, interval=0.2, view=v, now=lambda: "T")

    # A real clock, scaled down: the lock's calls run in threads, which a fake clock jumps over.
    roles = Roles(make, view, store.serve, lock, lambda limit: trio.sleep(limit), poll_s=0.05)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(roles.run)
            assert not roles.leading and view.online == {"a": True} and beats == []  # routes from the rows
            assert view.nodes["a"].servers["c@a"].state == "running"
            lock.free = True
            with trio.fail_after(5):
                while not beats:
                    await trio.sleep(0.01)
            assert roles.leading  # took the lead within a poll, beat at once
            assert view.nodes["a"].servers["c@a"].credential == "secret"
            await trio.sleep(0.5)
            assert len(beats) >= 2  # it beats every interval while it leads
            lock.free, lock.holding = False, False  # its session ended
            with trio.fail_after(5):
                while roles.leading:
                    await trio.sleep(0.01)
            count = len(beats)
            await trio.sleep(0.6)
            assert len(beats) == count  # a follower never beats
            lock.free = True
            with trio.fail_after(5):
                while not roles.leading:  # and leads again once it can
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    store.close()
    writer.close()


def test_a_follower_keeps_the_credentials_it_asked_for(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.serve.put_node("a", "online", "T0", state=node().state, error=None)
    view = View()
    asked: list[Collection[str]] = []

    async def observe(timeout: float, only: Collection[str] | None = None) -> Observed:
        asked.append(only or ())
        return Observed({"a": node("fresh")})

    follower = Follower(store.serve, view, observe)

    async def main() -> None:
        await follower.sync()
        assert view.nodes["a"].servers["c@a"].credential == ""  # the store keeps none
        await follower.refresh(["a"])
        assert asked == [["a"]] and view.nodes["a"].servers["c@a"].credential == "fresh"
        changed = {**(node().state or {}), "generation": "2"}
        store.serve.put_node("a", "online", "T1", state=changed, error=None)
        await follower.sync()  # the leader's new row: re-read, the credential kept
        assert view.nodes["a"].generation == "2" and view.nodes["a"].servers["c@a"].credential == "fresh"

    trio.run(main)
    store.close()
