"""Fan-out in chains (reconciler/planning/fanout.py): one chain per holder, every receiver once, nobody's
uplink sending twice; the executor starts a chained fetch as soon as its peer's fetch is accepted
(reconciler/applying/execute.py), not when it is done, and skips it if that fetch was refused."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from reconciler.agents.errors import AgentHTTPError
from reconciler.applying.execute import Executor
from reconciler.planning.fanout import Source, chains, spread
from reconciler.core.desired import NodeSpec
from reconciler.planning.plan import Action, Change, Plan
from tests.unit.test_execute import DIGEST, FakeClient, desired


@pytest.mark.parametrize("holders,receivers", [(1, 8), (2, 8), (3, 8), (8, 3), (1, 1), (4, 4)],
                         ids=lambda n: str(n))
def test_chains_cover_every_receiver_once_and_send_from_every_uplink_at_most_once(holders: int,
                                                                                   receivers: int) -> None:
    hs = [f"h{i}" for i in range(holders)]
    rs = [f"r{i}" for i in range(receivers)]
    out = chains(hs, rs)
    assert sorted(s.receiver for s in out) == sorted(rs)
    peers = [s.peer for s in out]
    assert len(peers) == len(set(peers))  # each node serves one downstream at most
    assert all(s.chained == (s.peer in rs) for s in out)
    lengths = {}
    for s in out:  # walk each chain back to its holder
        n, at = 0, s
        while at.chained:
            at = next(x for x in out if x.receiver == at.peer)
            n += 1
        lengths[s.receiver] = n
    assert max(lengths.values()) == (receivers + min(holders, receivers) - 1) // min(holders, receivers) - 1


def test_one_holder_makes_one_chain_in_the_receivers_order() -> None:
    assert chains(["cp"], ["a", "b", "c"]) == [Source("a", "cp", False), Source("b", "a", True),
                                               Source("c", "b", True)]
    assert spread(["cp", "x"], ["a", "b", "c"]) == [Source("a", "cp", False), Source("b", "x", False),
                                                    Source("c", "cp", False)]


def replicate(node: str, peer: str, deps: tuple[str, ...] = ()) -> Change:
    return Change(Action.REPLICATE, f"replica.m@{node}", node, "wanted", deps,
                  {"digest": DIGEST, "peer": peer, "model": "m"})


class Recording(FakeClient):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[float, str]] = []
        self.done_at: dict[str, float] = {}
        self.polls: dict[str, int] = {}

    async def fetch(self, node: NodeSpec, digest: str, body: dict[str, Any]) -> dict[str, Any]:
        self.asked.append((trio.current_time(), node.name))
        return await super().fetch(node, digest, body)

    async def weights(self, node: NodeSpec, digest: str) -> dict[str, Any] | None:
        n = self.polls[node.name] = self.polls.get(node.name, 0) + 1
        if n < 5:
            return {"state": "fetching", "bytes_done": n, "bytes_total": 10}
        self.done_at[node.name] = trio.current_time()
        return {"state": "present", "bytes": 10}


def run(plan: Plan, client: FakeClient) -> list[Any]:
    async def go() -> list[Any]:
        return await Executor(desired(5), client, clock=trio.current_time, poll_s=1).run(plan)
    return trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_chain_starts_together_and_each_link_before_its_peer_is_done() -> None:
    client = Recording()
    plan = Plan((replicate("n1", "n0"), replicate("n2", "n1", ("replica.m@n1",)),
                 replicate("n3", "n2", ("replica.m@n2",))), ())
    results = run(plan, client)
    assert [r.status for r in results] == ["done"] * 3
    asked = dict((n, t) for t, n in client.asked)
    assert asked["n3"] < client.done_at["n1"] and asked["n2"] < client.done_at["n1"], (asked, client.done_at)


def test_a_chained_fetch_is_skipped_when_its_peer_refused_to_fetch() -> None:
    client = FakeClient()
    client.failures["fetch"] = [AgentHTTPError(NodeSpec("n1", "10.0.0.1"), 400, "peer refused")]
    results = run(Plan((replicate("n1", "n0"), replicate("n2", "n1", ("replica.m@n1",))), ()), client)
    assert [r.status for r in results] == ["failed", "skipped"], results
