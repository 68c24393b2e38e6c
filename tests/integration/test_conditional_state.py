"""GET /v1/state asked with the generation the control plane holds: a real fleet-agent answers 304
with no body while nothing it reports has changed, and the heartbeat's observer keeps the very
node it held (no parsing, no schema check); free GPU memory moving by 256 MiB or more is news."""

from __future__ import annotations

import json
from typing import Callable, Iterator

import httpx
import pytest
import trio

from reconciler.client import AgentClient
from reconciler.model import ControlPlaneSpec, Desired, NodeSpec
from reconciler.observe import HeartbeatObserver
from tests.agents import SECRET, Agent, free_port


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    base = tmp_path_factory.mktemp("conditional")
    gpus = base / "gpus.json"
    gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30,
                                 "memory_free_bytes": (79 << 30) + (128 << 20)}]))
    a = Agent("node-a", "127.0.0.2", free_port("127.0.0.2"), base / "a", args=["--simulate-gpus", str(gpus)])
    try:
        yield a.start()
    finally:
        a.stop()


def twice(check: Callable[[], bool]) -> None:
    """The agent's home is on a disk other tests write to: its free space may cross a 256 MiB
    step between two calls, which is news. Three tries, so only a state that never repeats fails."""
    assert any(check() for _ in range(3))


def test_the_agent_answers_304_for_the_generation_held(agent: Agent) -> None:
    headers = {"Authorization": f"Bearer {SECRET}"}

    def check() -> bool:
        first = httpx.get(agent.url + "/v1/state", headers=headers, timeout=10)
        generation = first.json()["generation"]
        assert first.headers["etag"] == f'"{generation}"'
        again = httpx.get(agent.url + "/v1/state", headers={**headers, "If-None-Match": f'"{generation}"'},
                          timeout=10)
        assert again.status_code in (200, 304)
        other = httpx.get(agent.url + "/v1/state", headers={**headers, "If-None-Match": '"old"'}, timeout=10)
        assert other.status_code == 200 and other.json()["observed_at"] != first.json()["observed_at"]
        # The clock moved between the three calls: not news.
        return again.status_code == 304 and again.content == b"" and other.json()["generation"] == generation

    twice(check)


def test_the_observer_keeps_the_node_it_holds_until_the_state_changes(agent: Agent) -> None:
    gpus = agent.home.parent / "gpus.json"
    node = NodeSpec("a", agent.address, agent.port)
    desired = Desired(1, ControlPlaneSpec("a"), {"a": node}, {}, (), {})

    async def main() -> None:
        async with AgentClient(SECRET) as client:
            observer = HeartbeatObserver(desired, client)
            first = (await observer(10.0)).nodes["a"]
            assert first.ok and first.generation
            for _ in range(3):  # see twice()
                second = (await observer(10.0)).nodes["a"]
                if second is first:
                    break
                first = second
            assert second is first  # 304: the same object, so the drift plan is not made again
            # The agent reads its (simulated) GPUs when asked: 100 MiB less free within the same 256
            # MiB step is not news, 1 GiB less is.
            gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30,
                                         "memory_free_bytes": (79 << 30) + (28 << 20)}]))
            assert (await observer(10.0)).nodes["a"] is first
            gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30,
                                         "memory_free_bytes": 78 << 30}]))
            third = (await observer(10.0)).nodes["a"]
            assert third is not first and third.gpus[0][1] == 78 << 30

    trio.run(main)
