"""GET /v1/state asked with the generation the control plane holds: a real fleet-agent answers 304
with no body while nothing it reports has changed, and the heartbeat's observer keeps the very
node it held (no parsing, no schema check); free GPU memory moving by 256 MiB or more is news."""

from __future__ import annotations

import functools
import json
from typing import Callable, Iterator

import httpx
import pytest
import trio

from reconciler.agents.client import AgentClient
from reconciler.core.desired import ControlPlaneSpec, Desired, NodeSpec
from reconciler.agents.observe import HeartbeatObserver, observe
from reconciler.agents.transport import AgentRequest, SocketTransport
from tests.agents import SECRET, Agent, free_port

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e


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


def test_the_heartbeats_transport_keeps_a_connection_per_agent_and_survives_its_close() -> None:
    """A stand-in agent on loopback answering every request on its connection: GETs share one
    connection; after the agent closes it while idle, the next GET goes on a fresh one and
    succeeds; a POST is never sent on a kept connection."""
    accepted: list[trio.SocketStream] = []

    async def agent(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    more = await stream.receive_some(65536)
                    if not more:
                        return
                    buf += more
                head, _, buf = buf.partition(b"\r\n\r\n")
                body = b'{"ok": true}'
                closing = b"connection: close" in head.lower()
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                      b"%d\r\n%s\r\n%s" % (len(body), b"connection: close\r\n" if closing else b"", body))
                if closing:
                    return
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        finally:
            await stream.aclose()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, agent, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            node = NodeSpec("a", "127.0.0.1", port)
            transport = SocketTransport(keep_alive=True, max_idle=4)
            request = AgentRequest("GET", node, "/v1/state", None, SECRET)
            for _ in range(3):
                assert await transport.exchange(request) == (200, b'{"ok": true}')
            assert len(accepted) == 1
            await accepted[0].aclose()  # the agent closes the idle connection between two beats
            await trio.sleep(0.05)
            assert await transport.exchange(request) == (200, b'{"ok": true}')  # on a fresh connection
            assert len(accepted) == 2
            await transport.exchange(AgentRequest("POST", node, "/v1/servers", b"{}", SECRET))
            await transport.exchange(request)
            assert len(accepted) == 3  # the POST on a connection of its own, the GET on the kept one
            transport.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_silent_agent_is_unreachable_after_its_timeout_and_the_others_are_observed(agent: Agent) -> None:
    """Two silent stand-ins (they accept and never answer) among real agents' calls: each silent one
    is node_unreachable after the timeout, each call having its own, and the rest are observed."""
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            nodes = {"a": NodeSpec("a", agent.address, agent.port), "s1": NodeSpec("s1", "127.0.0.1", port),
                     "s2": NodeSpec("s2", "127.0.0.1", port)}
            desired = Desired(1, ControlPlaneSpec("a"), nodes, {}, (), {})
            async with AgentClient(SECRET) as client:
                started = trio.current_time()
                seen = await observe(desired, client, timeout=0.5, concurrency=1)  # one worker: one after another
                took = trio.current_time() - started
            assert seen.nodes["a"].ok
            for name in ("s1", "s2"):
                assert seen.nodes[name].error_code == "node_unreachable"
                assert "did not answer within 0.5s" in (seen.nodes[name].error or "")
            assert 1.0 <= took < 3.0  # 0.5 s each, in turn
            nursery.cancel_scope.cancel()

    trio.run(main)
