"""net/client.py's body reader (httptools' response parser), fed every split of a real chunked body over a real socket
pair: each piece is sent only once the reader has taken the one before, so it arrives on its own."""

from __future__ import annotations

import functools
import socket
from typing import Any, Awaitable, Callable

import pytest
import trio
import trio.testing

from net import sockio
from net.client import ClientError, Connection, Pool, Response, fetch, get, request, send

EVENTS = [b"data: {\"a\": 1}\n\n", b"data: {\"b\": 22}\n\n", b"x" * 300, b"data: [DONE]\n\n"]
CHUNKED = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


def received(pieces: list[bytes], headers: dict[str, str], rest: bytes = b"") -> tuple[bytes, bool]:
    """(the body read, whether the connection was left reusable) once the worker's end sent each
    piece in turn and then closed."""
    async def go() -> tuple[bytes, bool]:
        ours, theirs = socket.socketpair()
        sockio.prepare(ours)
        head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"%s: %s\r\n" % (k.encode(), v.encode())
                                                  for k, v in headers.items()) + b"\r\n"
        response = Response(Connection(ours))
        response.take(head + rest)
        assert response.head_whole and response.status == 200
        error: ClientError | None = None
        try:
            async with trio.open_nursery() as nursery:
                async def worker() -> None:
                    for piece in pieces:
                        await trio.testing.wait_all_tasks_blocked()  # the reader waits for more
                        theirs.sendall(piece)
                    await trio.testing.wait_all_tasks_blocked()
                    theirs.close()
                nursery.start_soon(worker)
                try:
                    out = b"".join([c async for c in response.chunks()])
                except ClientError as exc:
                    error = exc
                    nursery.cancel_scope.cancel()
            if error is not None:
                raise error
            return out, response.reusable
        finally:
            theirs.close()
            sockio.close(ours)
    return trio.run(go)


def body(pieces: list[bytes], headers: dict[str, str], rest: bytes = b"") -> bytes:
    return received(pieces, headers, rest)[0]


@pytest.mark.parametrize("cut", range(0, len(CHUNKED) + 1, 7))
def test_chunked_split_anywhere(cut: int) -> None:
    assert body([CHUNKED[cut:]], {"transfer-encoding": "chunked"}, rest=CHUNKED[:cut]) == b"".join(EVENTS)


def test_chunked_byte_by_byte() -> None:
    pieces = [CHUNKED[i:i + 1] for i in range(len(CHUNKED))]
    assert body(pieces, {"transfer-encoding": "chunked"}) == b"".join(EVENTS)


def test_content_length_body() -> None:
    assert body([b"hello", b" world", b"IGNORED"], {"content-length": "11"}) == b"hello world"


def test_a_body_without_length_ends_with_the_connection() -> None:
    assert body([b"hello", b" world"], {}) == b"hello world"


@pytest.mark.parametrize("arrives, headers, error", [
    ([CHUNKED[:40]], {"transfer-encoding": "chunked"}, "middle of its answer"),
    ([b"zz\r\nabc\r\n"], {"transfer-encoding": "chunked"}, "malformed chunked framing"),
    ([b"5\r\nhel"], {"transfer-encoding": "chunked"}, "middle of its answer"),
    ([b"5\r\n"], {"transfer-encoding": "chunked"}, "middle of its answer"),
    ([b"abc"], {"content-length": "10"}, "7 bytes before the end"),
], ids=["truncated-chunked", "malformed-size", "short-content-length", "data-cut", "no-data"])
def test_truncated_and_malformed_bodies_are_errors(arrives: list[bytes], headers: dict[str, str], error: str) -> None:
    with pytest.raises(ClientError, match=error):
        body(arrives, headers)


def llhttp_takes(chunked: bytes) -> bool:
    """Whether llhttp (httptools: the parser of uvicorn and of fleet's front) takes this body."""
    import httptools

    parser = httptools.HttpResponseParser(object())
    try:
        parser.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked)
        return True
    except httptools.HttpParserError:
        return False


REFUSED_SIZES = {
    "negative": b"-5", "plus": b"+5", "underscore": b"1_0", "0x": b"0x5", "space-before": b" 5", "space-after": b"5 ",
    "tab": b"5\t", "empty": b"", "not-hex": b"g", "bare-cr": b"5\r5", "over-64-bits": b"1" + b"0" * 16,
    "arabic-digit": b"\xd9\xa5", "space-before-extension": b"5 ;a", "space-in-extension": b"5;a=b c",
    "empty-extension": b"5;", "unterminated-quote": b'5;a="x', "two-equals": b"5;a=b=c",
    "control-in-quoted-pair": b'5;a="\\\x01"'}
TAKEN_SIZES = [b"5", b"0005", b"5;name=value", b'5;a;b="quoted \\" pair"', b"5;a=b;c=d", b"0" * 20 + b"5"]


@pytest.mark.parametrize("size", REFUSED_SIZES.values(), ids=REFUSED_SIZES.keys())
def test_a_chunk_size_llhttp_refuses_is_refused(size: bytes) -> None:
    """int(..., 16) took -5 (the decoder's count then went negative and it relayed garbage), +5,
    1_0, 0x5 and spaces around the digits; llhttp takes hex digits (64 bits at most) and
    extensions of tokens or quoted strings, nothing else."""
    chunked = size + b"\r\nhello\r\n0\r\n\r\n"
    assert not llhttp_takes(chunked)
    with pytest.raises(ClientError, match="malformed chunked framing"):
        body([chunked], {"transfer-encoding": "chunked"})


@pytest.mark.parametrize("size", TAKEN_SIZES)
def test_a_chunk_size_llhttp_takes_is_taken(size: bytes) -> None:
    chunked = size + b"\r\nhello\r\n0\r\n\r\n"
    assert llhttp_takes(chunked)
    assert body([chunked], {"transfer-encoding": "chunked"}) == b"hello"


def test_data_without_crlf_and_a_bare_lf_are_refused() -> None:
    for chunked in (b"5\r\nhelloXY0\r\n\r\n", b"5\nhello\r\n0\r\n\r\n"):
        assert not llhttp_takes(chunked)
        with pytest.raises(ClientError, match="malformed chunked framing"):
            body([chunked], {"transfer-encoding": "chunked"})


def test_a_long_extension_is_taken_as_llhttp_takes_it() -> None:
    """llhttp bounds no extension's length and holds none of it (nor does the reader now): the
    4 KiB bound of the hand-written decoder was its buffer's, which is gone."""
    chunked = b"5;" + b"e" * 5000 + b"\r\nhello\r\n0\r\n\r\n"
    assert llhttp_takes(chunked)
    assert body([chunked[i:i + 1000] for i in range(0, len(chunked), 1000)], {"transfer-encoding": "chunked"}) == b"hello"


@pytest.mark.parametrize("data, reusable", [(CHUNKED, True), (CHUNKED[:-2], False), (CHUNKED + b"HTTP/1.1", False)],
                         ids=["clean", "no-final-line", "bytes-after"])
def test_a_clean_chunked_end_leaves_the_connection_reusable(data: bytes, reusable: bool) -> None:
    assert received([], {"transfer-encoding": "chunked"}, data) == (b"".join(EVENTS), reusable)


def test_a_stale_pooled_connection_is_retried_on_a_fresh_one() -> None:
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
            stale = await sockio.connect("127.0.0.1", port)
            await sockio.send(stale, b"x")
            await trio.sleep(0.05)  # closed by the worker: a dead keep-alive connection
            pool.give(Connection(stale, ("127.0.0.1", port)))
            r = await request("POST", "127.0.0.1", port, "/v1/completions", body=b"{}", pool=pool)
            assert r.status == 200 and b"".join([c async for c in r.chunks()]) == b"ok"
            assert r.reusable
            r.close()
            # Kept for the next request (this stand-in then closes it, which take() would notice).
            assert pool.idle[("127.0.0.1", port)] == [r.conn]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_malformed_content_length_is_an_error_before_anything_is_relayed() -> None:
    async def main() -> None:
        async def handler(stream: trio.SocketStream) -> None:
            async with stream:
                await stream.receive_some(65536)
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: lots\r\n\r\nok")
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            with pytest.raises(ClientError, match="malformed Content-Length") as caught:
                await request("POST", "127.0.0.1", listeners[0].socket.getsockname()[1], "/v1/completions", body=b"{}")
            assert caught.value.started is False  # another member may still be tried
            nursery.cancel_scope.cancel()

    trio.run(main)


def serve_once(answer: bytes, asked: list[bytes] | None = None) -> Any:
    """A server on loopback that answers every request on a connection with `answer`."""
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some(65536):
                if asked is not None:
                    asked.append(data)
                await stream.send_all(answer)
    return functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")


def against(answer: bytes, check: Callable[[int], Awaitable[None]]) -> None:
    """Run `check(port)` with serve_once(answer) listening on that loopback port."""
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(serve_once(answer))
            await check(listeners[0].socket.getsockname()[1])
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_fetch_reads_a_whole_answer_and_pools_its_connection() -> None:
    asked: list[bytes] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(serve_once(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                                                       b"transfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", asked))
            port = listeners[0].socket.getsockname()[1]
            pool = Pool()
            for _ in range(2):
                whole = await fetch("POST", "127.0.0.1", port, "/x", body=b"{}", headers=[("X-A", "b")], pool=pool)
                assert (whole.status, whole.headers["content-type"], whole.content) == (200, "text/plain", b"ok")
            assert len(pool.idle[("127.0.0.1", port)]) == 1  # one connection carried both
            pool.close()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert asked[0] == b"POST /x HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX-A: b\r\nContent-Length: 2\r\n\r\n{}" % int(
        asked[0].split(b":")[2].split(b"\r")[0])


@pytest.mark.parametrize("answer", [b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world",
                                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nb\r\nhello world\r\n0\r\n\r\n"],
                         ids=["content-length", "chunked"])
def test_a_whole_answer_over_its_bound_is_refused(answer: bytes) -> None:
    async def check(port: int) -> None:
        with pytest.raises(ClientError, match="over 10"):
            await fetch("GET", "127.0.0.1", port, "/", limit=10)

    against(answer, check)


def test_get_takes_a_url_and_a_refused_connection_is_a_client_error() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(serve_once(b"HTTP/1.1 204 No Content\r\n\r\n"))
            port = listeners[0].socket.getsockname()[1]
            assert (await get(f"http://127.0.0.1:{port}/health?x=1")).status == 204
            nursery.cancel_scope.cancel()
        with pytest.raises(ClientError, match=f"cannot connect to 127.0.0.1:{port}") as caught:
            await get(f"http://127.0.0.1:{port}/health")
        assert caught.value.started is False

    trio.run(main)


def test_an_oversized_head_is_refused() -> None:
    async def check(port: int) -> None:
        with pytest.raises(ClientError, match="oversized response head"):
            await request("GET", "127.0.0.1", port, "/", max_head=1024)

    against(b"HTTP/1.1 200 OK\r\nx: " + b"y" * 2000 + b"\r\n\r\n", check)


def test_a_pooled_connection_the_server_closed_is_dropped_before_use() -> None:
    async def main() -> None:
        ours, theirs = socket.socketpair()
        quiet, other = socket.socketpair()
        sockio.prepare(ours)
        sockio.prepare(quiet)
        theirs.close()  # the server went away while the connection sat idle
        pool = Pool()
        pool.give(Connection(quiet, ("w", 1)))
        pool.give(Connection(ours, ("w", 1)))
        taken = pool.take(("w", 1))
        assert taken is not None and taken.sock is quiet and ours.fileno() == -1
        assert pool.take(("w", 1)) is None
        sockio.close(quiet)
        other.close()

    trio.run(main)


def test_an_answer_that_switches_protocols_is_a_client_error() -> None:
    """A 101 (or an Upgrade answered) is httptools' HttpParserUpgrade, no HttpParserError: it left
    the client as itself and stopped whatever called it (an agent's health check)."""
    async def check(port: int) -> None:
        with pytest.raises(ClientError, match="switched protocols"):
            await fetch("GET", "127.0.0.1", port, "/health")

    against(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\nwhatever", check)


def test_a_head_that_comes_a_byte_at_a_time_is_read() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-a: b\r\n\r\n"

    async def main() -> None:
        ours, theirs = socket.socketpair()
        sockio.prepare(ours)
        try:
            async with trio.open_nursery() as nursery:
                async def worker() -> None:
                    for i in range(len(head)):
                        await trio.testing.wait_all_tasks_blocked()  # each byte read on its own
                        theirs.sendall(head[i:i + 1])
                    theirs.sendall(b"ok")
                nursery.start_soon(worker)
                r = await send(Connection(ours, ("127.0.0.1", 1)), "GET", "/", peer="the worker")
                assert (r.status, r.headers["x-a"], await r.whole()) == (200, "b", b"ok")
        finally:
            theirs.close()
            sockio.close(ours)

    trio.run(main)


def test_a_malformed_answer_on_a_kept_connection_is_not_sent_again() -> None:
    """Only a kept connection that had gone (closed, reset) is tried again on a fresh one: a server
    that answered, however badly, took the request."""
    asked: list[bytes] = []
    answers = iter([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", b"HTTP/1.1 200 OK\r\ncontent-length: 2x\r\n\r\nok"])

    async def main() -> None:
        async def handler(stream: trio.SocketStream) -> None:
            async with stream:
                while data := await stream.receive_some(65536):
                    asked.append(data)
                    await stream.send_all(next(answers, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"))
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            port, pool = listeners[0].socket.getsockname()[1], Pool()
            assert (await fetch("POST", "127.0.0.1", port, "/", body=b"{}", pool=pool)).content == b"ok"
            with pytest.raises(ClientError, match="malformed Content-Length"):
                await fetch("POST", "127.0.0.1", port, "/", body=b"{}", pool=pool)
            pool.close()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(asked) == 2


def test_a_cancelled_bulk_body_stops_its_thread_at_once() -> None:
    """A body over BULK goes to a blocking receive in a thread, on a descriptor of its own; the
    caller cancelled, the connection is shut down under it: nothing more reaches the sink, and the
    thread ends and closes its descriptor (not up to `patience` later)."""
    import os

    from net.client import BULK

    seen: list[int] = []

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> None:
        async def handler(stream: trio.SocketStream) -> None:
            async with stream:
                await stream.receive_some(65536)
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (BULK * 8))
                await stream.send_all(b"x" * (1 << 20))
                await trio.sleep_forever()  # a peer gone quiet, the connection open
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            r = await request("GET", "127.0.0.1", listeners[0].socket.getsockname()[1], "/blob")
            before = descriptors()
            with trio.move_on_after(1.0):
                await r.into(lambda data: seen.append(len(data)), patience=60)
            got = sum(seen)
            deadline = trio.current_time() + 5
            while descriptors() > before and trio.current_time() < deadline:
                await trio.sleep(0.02)
            assert descriptors() <= before, "the receiving thread still holds its descriptor"
            await trio.sleep(0.2)
            assert sum(seen) == got > 0  # what came before the cancel, nothing after
            r.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_pool_keeps_at_most_its_count_in_all() -> None:
    async def main() -> None:
        pool = Pool(per_host=2, most=3)
        made: list[socket.socket] = []
        for port in (1, 1, 1, 2, 2):
            ours, theirs = socket.socketpair()
            made += [ours, theirs]
            pool.give(Connection(ours, ("h", port)))
        assert [len(v) for v in pool.idle.values()] == [2, 1] and pool.count == 3
        assert sum(s.fileno() == -1 for s in made[::2]) == 2  # the third to port 1, the second to port 2: closed
        pool.close()
        for s in made:
            s.close()

    trio.run(main)


def test_a_kept_connection_that_closes_unanswered_is_tried_again_on_a_fresh_one() -> None:
    """A kept connection that looked open (idle_open) but closed at the request, unanswered: sent
    once more on a fresh connection (the request was not taken)."""
    asked: list[int] = []

    async def main() -> None:
        connections = 0

        async def handler(stream: trio.SocketStream) -> None:
            nonlocal connections
            connections += 1
            mine = connections
            async with stream:
                while await stream.receive_some(65536):
                    asked.append(mine)
                    if mine == 1 and len(asked) == 2:
                        return  # the second request on the first connection: closed, unanswered
                    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            port, pool = listeners[0].socket.getsockname()[1], Pool()
            for _ in range(2):
                assert (await fetch("POST", "127.0.0.1", port, "/", body=b"{}", pool=pool)).content == b"ok"
            pool.close()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert asked == [1, 1, 2]


@pytest.mark.parametrize("interim, answered", [(1, True), (8, True), (9, False)])
def test_interim_answers_are_passed_over_up_to_a_bound(interim: int, answered: bool) -> None:
    """A 100 Continue (or 103) before the answer was taken as the answer, the real one's bytes as
    its body; now passed over, at most MAX_INTERIM of them."""
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" * interim + b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    async def check(port: int) -> None:
        if answered:
            whole = await fetch("GET", "127.0.0.1", port, "/")
            assert (whole.status, whole.content) == (200, b"ok")
        else:
            with pytest.raises(ClientError, match="interim answers"):
                await fetch("GET", "127.0.0.1", port, "/")

    against(answer, check)


AFTER = {
    "switch": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n",
    "interims": b"HTTP/1.1 100 Continue\r\n\r\n" * 9,
    "second-answer": b"HTTP/1.1 401 Unauthorized\r\nwww-authenticate: Bearer\r\ncontent-length: 4\r\n\r\nEVIL",
    "large-second-head": b"HTTP/1.1 200 OK\r\nx: " + b"a" * 40000 + b"\r\n\r\n",
    "garbage": b"NOT HTTP\r\n\r\n",
}


@pytest.mark.parametrize("apart", [False, True], ids=["one-write", "head-first"])
@pytest.mark.parametrize("after", list(AFTER.values()), ids=list(AFTER))
def test_what_comes_after_an_answer_is_no_part_of_it(after: bytes, apart: bool) -> None:
    """Bytes after an answer's end (in the read that ends it, or with its body after its head came
    alone) are neither its status nor its headers, raise nothing, and leave its connection unpooled."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"

    async def main() -> None:
        async def handler(stream: trio.SocketStream) -> None:
            async with stream:
                await stream.receive_some(65536)
                if apart:
                    await stream.send_all(head)
                    await trio.sleep(0.05)  # the client has the head alone, and reads the rest in `whole`
                    await stream.send_all(b"ok" + after)
                else:
                    await stream.send_all(head + b"ok" + after)
                await trio.sleep(1)
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            pool = Pool()
            answer = await fetch("GET", "127.0.0.1", port, "/", pool=pool)
            assert (answer.status, answer.headers, answer.content) == (
                200, {"content-type": "application/json", "content-length": "2"}, b"ok")
            assert not pool.idle.get(("127.0.0.1", port))
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("trailers", [b"".join(b"t%d: %s\r\n" % (i, b"v" * 60) for i in range(2000)),
                                      b"t: " + b"v" * (1 << 20)], ids=["many", "one-long"])
def test_trailers_are_bounded_and_not_taken_as_headers(trailers: bytes) -> None:
    """A chunked body's trailers: a few are read past (and are not its headers); past the head's
    bound without a byte of body, an error, whatever their shape (a value that never ends included)."""
    assert received([b"2\r\nok\r\n0\r\nx-small: 1\r\n\r\n"], {"transfer-encoding": "chunked"})[0] == b"ok"
    with pytest.raises(ClientError, match="chunk framing or trailers over 65536 bytes"):
        body([b"2\r\nok\r\n0\r\n"] + [trailers[i:i + 4096] for i in range(0, len(trailers), 4096)],
             {"transfer-encoding": "chunked"})
