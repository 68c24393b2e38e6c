"""The router's chunked-body decoder, fed every split of a real chunked body."""

from __future__ import annotations

import functools

import pytest
import trio

from reconciler.serve.upstream import UpstreamError, UpstreamResponse

EVENTS = [b"data: {\"a\": 1}\n\n", b"data: {\"b\": 22}\n\n", b"x" * 300, b"data: [DONE]\n\n"]
CHUNKED = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


class FakeStream:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def receive_some(self, n: int) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""

    async def aclose(self) -> None:
        pass


def body(pieces: list[bytes], headers: dict[str, str], rest: bytes = b"") -> bytes:
    async def go() -> bytes:
        r = UpstreamResponse(FakeStream(pieces), 200, headers, rest)  # type: ignore[arg-type]
        return b"".join([c async for c in r.chunks()])
    return trio.run(go)


@pytest.mark.parametrize("cut", range(0, len(CHUNKED) + 1, 7))
def test_chunked_split_anywhere(cut: int) -> None:
    assert body([CHUNKED[cut:]], {"transfer-encoding": "chunked"}, rest=CHUNKED[:cut]) == b"".join(EVENTS)


def test_chunked_byte_by_byte() -> None:
    assert body([CHUNKED[i:i + 1] for i in range(len(CHUNKED))], {"transfer-encoding": "chunked"}) == b"".join(EVENTS)


def test_content_length_body() -> None:
    assert body([b"hello", b" world", b"IGNORED"], {"content-length": "11"}) == b"hello world"


def test_truncated_and_malformed_bodies_are_errors() -> None:
    with pytest.raises(UpstreamError, match="middle of its answer"):
        body([CHUNKED[:40]], {"transfer-encoding": "chunked"})
    with pytest.raises(UpstreamError, match="malformed"):
        body([b"zz\r\nabc\r\n"], {"transfer-encoding": "chunked"})
    with pytest.raises(UpstreamError, match="bytes before the end"):
        body([b"abc"], {"content-length": "10"})


def test_a_clean_chunked_end_leaves_the_connection_reusable() -> None:
    async def go(data: bytes) -> bool:
        r = UpstreamResponse(FakeStream([]), 200, {"transfer-encoding": "chunked"}, data)  # type: ignore[arg-type]
        _ = [c async for c in r.chunks()]
        return r.reusable
    assert trio.run(go, CHUNKED) is True
    assert trio.run(go, CHUNKED[:-2]) is False  # the final empty line never came


def test_a_stale_pooled_connection_is_retried_on_a_fresh_one() -> None:
    from reconciler.serve.upstream import Pool, post

    async def main() -> None:
        async def handler(stream: trio.SocketStream) -> None:
            async with stream:
                if await stream.receive_some(65536) == b"x":
                    return  # the worker dropped this idle connection
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            pool = Pool()
            stale = await trio.open_tcp_stream("127.0.0.1", port)
            await stale.send_all(b"x")
            await trio.sleep(0.05)  # closed by the worker: a dead keep-alive connection
            await pool.give(("127.0.0.1", port), stale)
            r = await post("127.0.0.1", port, "/v1/completions", b"{}", pool)
            assert r.status == 200 and b"".join([c async for c in r.chunks()]) == b"ok"
            await r.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
