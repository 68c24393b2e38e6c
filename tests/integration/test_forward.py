"""Forwarding a file while it is fetched (agent/transfer/forward.py), in process on trio: only verified bytes
are served, a request for bytes not there yet waits while the upstream progresses, and a wait ends,
bounded, when the upstream stalls (piece_wait_timeout before the head, a cut answer after it) or
fails (cut, naming the failure)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Awaitable, Callable

import httpx
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agent.transfer.forward import Partial, PartialBlobResponse, UpstreamEnded

PIECE = 64 << 10
DATA = os.urandom(8 * PIECE)


class Upstream:
    """A fetch stand-in: writes DATA into the partial file a piece at a time, publishing each."""

    def __init__(self, path: Path) -> None:
        self.received = 0
        self.partial = Partial(path, len(DATA), lambda: self.received, "up")
        path.write_bytes(b"")

    async def feed(self, pieces: int, every: float = 0.01) -> None:
        with open(self.partial.path, "r+b") as fh:
            for _ in range(pieces):
                await trio.sleep(every)
                at = self.partial.verified
                fh.seek(at)
                fh.write(DATA[at:at + PIECE])
                fh.flush()
                self.received += PIECE
                self.partial.verified = at + PIECE


def client(up: Upstream, stall_s: float) -> httpx.AsyncClient:
    async def blob(request: Request) -> Response:
        return PartialBlobResponse(up.partial, request.headers.get("range"), stall_s=stall_s)

    app = Starlette(routes=[Route("/blob", blob)])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://peer")


def cut(go: Callable[[], Awaitable[None]]) -> str:
    """Why the answer was cut (the app raises UpstreamEnded; the server then closes the connection)."""
    said: list[str] = []
    try:
        trio.run(go)
    except* UpstreamEnded as group:
        said.append(str(group.exceptions[0]))
    assert said, "the answer was not cut"
    return said[0]


def test_a_range_is_served_as_its_pieces_are_verified(tmp_path: Path) -> None:
    up = Upstream(tmp_path / "f.part")

    async def go() -> httpx.Response:
        async with trio.open_nursery() as nursery, client(up, stall_s=5) as c:
            nursery.start_soon(up.feed, 8)
            return await c.get("/blob", headers={"Range": f"bytes={PIECE + 3}-"})

    r = trio.run(go)
    assert r.status_code == 206 and r.content == DATA[PIECE + 3:]
    assert r.headers["content-range"] == f"bytes {PIECE + 3}-{len(DATA) - 1}/{len(DATA)}"
    # most of it went out before the file was whole (the client asked before the first piece)
    assert up.partial.served >= 4 * PIECE, up.partial.served


def test_nothing_verified_and_no_progress_is_piece_wait_timeout_within_the_bound(tmp_path: Path) -> None:
    up = Upstream(tmp_path / "f.part")

    async def go() -> tuple[httpx.Response, float]:
        async with client(up, stall_s=0.3) as c:
            began = trio.current_time()
            r = await c.get("/blob")
            return r, trio.current_time() - began

    r, took = trio.run(go)
    assert r.status_code == 504 and r.json()["error"]["code"] == "piece_wait_timeout", r.text
    assert "node 'up' has verified 0 of 524,288 bytes" in r.json()["error"]["message"]
    assert 0.3 <= took < 2, took


def test_a_stall_after_the_head_cuts_the_answer(tmp_path: Path) -> None:
    up = Upstream(tmp_path / "f.part")

    async def go() -> None:
        async with trio.open_nursery() as nursery, client(up, stall_s=0.3) as c:
            nursery.start_soon(up.feed, 3)  # three pieces, then the upstream goes quiet
            await c.get("/blob")

    assert "has verified 196,608 of 524,288 bytes of f.part and received nothing for 0 s" in cut(go)


def test_a_failed_upstream_cuts_the_answer_naming_its_failure(tmp_path: Path) -> None:
    up = Upstream(tmp_path / "f.part")

    async def fail_later() -> None:
        await up.feed(2)
        up.partial.failed = "piece 2 of m.gguf is corrupt on arrival"

    async def go() -> None:
        async with trio.open_nursery() as nursery, client(up, stall_s=30) as c:
            nursery.start_soon(fail_later)
            await c.get("/blob")

    assert "the fetch on 'up' feeding it failed: piece 2 of m.gguf is corrupt" in cut(go)


def test_a_peer_that_hangs_up_while_it_waits_for_the_first_byte_ends_its_wait_at_once(tmp_path: Path) -> None:
    # Its wait held a descriptor and a task until the upstream ended (with a dripping upstream,
    # far past stall_s): 300 waiters whose clients had gone stayed.
    up = Upstream(tmp_path / "f.part")
    messages = [{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}]
    sent: list[object] = []

    async def receive() -> dict[str, object]:
        if len(messages) == 1:
            await trio.sleep(0.2)  # the hang-up comes while nothing is verified
        return messages.pop(0)

    async def send(message: object) -> None:
        sent.append(message)

    async def go() -> float:
        began = trio.current_time()
        with trio.fail_after(10):
            await PartialBlobResponse(up.partial, None, stall_s=30)(
                {"type": "http", "method": "GET", "headers": []}, receive, send)
        return trio.current_time() - began

    took = trio.run(go)
    assert sent == [] and took < 5, (sent, took)  # not the 30 s stall bound: nobody to answer
    assert not up.partial._waiters
