"""A generation the control plane holds goes into If-None-Match only when it is one an agent makes
(32 hex digits): anything else (a damaged cache, something that is not an agent) is not asked
about, so no byte of it (CR, LF) reaches the request's head. One call (state) and the batch
(states, on real loopback sockets)."""

from __future__ import annotations

import functools

import pytest
import trio

from reconciler.agents.client import AgentClient, AgentError
from reconciler.core.desired import NodeSpec
from tests.memory_transport import MemoryTransport
from tests.unit.test_batch import read_head

SECRET = "s" * 16
GOOD = "0123456789abcdef" * 2
BAD = ["g\r\nX-Injected: 1", GOOD + "\r\nX-Injected: 1", GOOD.upper(), GOOD[:-1], ""]
ANSWER = b'HTTP/1.1 500 Internal Server Error\r\ncontent-length: 36\r\n\r\n{"error": {"message": "stand-in"}}  '


def asked_about(heads: list[bytes]) -> list[bool]:
    assert not any(b"x-injected" in h.lower() for h in heads)
    return [b'if-none-match: "' + GOOD.encode() + b'"' in h.lower() for h in heads]


@pytest.mark.parametrize("unless", BAD, ids=range(len(BAD)))
def test_one_call_asks_about_an_agents_generation_only(unless: str) -> None:
    heads: list[bytes] = []

    async def answer(request: bytes) -> bytes:
        heads.append(request.split(b"\r\n\r\n")[0])
        return ANSWER

    async def main() -> None:
        async with AgentClient(SECRET, transport=MemoryTransport(answer)) as client:
            for held in (GOOD, unless):
                with pytest.raises(AgentError):
                    await client.state(NodeSpec(name="n", address="127.0.0.1", agent_port=1), unless=held)

    trio.run(main)
    assert asked_about(heads) == [True, False] and b"if-none-match" not in heads[1].lower()


def test_the_batch_asks_about_an_agents_generation_only() -> None:
    heads: list[bytes] = []

    async def stand_in(stream: trio.SocketStream) -> None:
        if (buf := await read_head(stream)) is None:
            return
        heads.append(buf.split(b"\r\n\r\n")[0])
        await stream.send_all(ANSWER)
        await stream.aclose()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, stand_in, 0, host="127.0.0.1"))
            node = NodeSpec(name="n", address="127.0.0.1", agent_port=listeners[0].socket.getsockname()[1])
            async with AgentClient(SECRET) as client:
                assert client.batches(node)
                answers = await client.states([(node, GOOD)] + [(node, bad) for bad in BAD], concurrency=1, timeout=5)
            assert len(answers) == 1 + len(BAD)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sorted(asked_about(heads)) == [False] * len(BAD) + [True]
