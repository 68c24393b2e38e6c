"""Forwarding while receiving: a file still being fetched is served to peers, but only its verified
prefix, and a request for bytes not there yet waits for them, bounded by the upstream's progress.

A receiver in a chain (reconciler/planning/fanout.py) serves its downstream from its partial file; the bytes
it serves have passed their piece's check (wire/pieces.py), so a corrupt piece is never forwarded. A
file without pieces (imported before them, or smaller than one piece) is forwarded once it is whole
and verified. A wait ends when the file is complete, when its fetch fails (the connection is cut:
the downstream keeps what it verified and resumes), or when the upstream receives nothing for
STALL_S seconds (`piece_wait_timeout` before the answer's head, a cut connection after it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from agent.transfer.blobs import SourceEnded, answer_headers, head_of, parse_range, send_error, send_range, send_unsatisfiable

STALL_S = 30.0  # below the floor a fetch holds a body to (wire/floor.py, 60 s), so the downstream hears why first
POLL_S = 0.01  # how often a file that is not there yet is looked for (agent/transfer/forward.py _open)
TICK_S = 0.5  # a waiter looks at its upstream's liveness this often, between wake-ups by the writer


class UpstreamEnded(SourceEnded):
    """The fetch feeding a forwarded file failed or stalled: the answer is cut short on purpose."""


@dataclass(eq=False)
class Partial:
    """A file being fetched: where it is, how much of it is verified, whether its fetch still runs.
    `verified` only grows; the writer publishes it after flushing those bytes to the file, from any
    thread, and that wakes the answers waiting for them (it was a poll every 10 ms per answer:
    a CPU cost that grows with the wall time, on every node of a chain, and up to 10 ms a piece)."""

    path: Path
    size: int
    progress: Callable[[], int]  # the upstream job's bytes received: liveness for waits
    node: str = ""
    served: int = 0  # bytes of this file served before it was whole
    _verified: int = field(default=0, repr=False)
    _failed: str | None = field(default=None, repr=False)
    _waiters: set[trio.Event] = field(default_factory=set, repr=False)
    _token: trio.lowlevel.TrioToken | None = field(default=None, repr=False)

    @property
    def verified(self) -> int:
        return self._verified

    @verified.setter
    def verified(self, value: int) -> None:
        self._verified = value
        self._wake()

    @property
    def failed(self) -> str | None:
        return self._failed

    @failed.setter
    def failed(self, reason: str | None) -> None:
        self._failed = reason
        self._wake()

    def _wake(self) -> None:
        token = self._token
        if token is None:
            return
        for event in list(self._waiters):  # a copy in one step: the event loop's thread may add one
            try:
                token.run_sync_soon(event.set)  # from the writer's thread or the loop's own
            except trio.RunFinishedError:
                return

    async def wait_for(self, pos: int, stall_s: float) -> None:
        """Until byte `pos` is verified; UpstreamEnded if the fetch fails or stalls first."""
        last, since = self.progress(), trio.current_time()
        self._token = trio.lowlevel.current_trio_token()
        tick = min(TICK_S, stall_s / 4)
        while True:
            woken = trio.Event()
            self._waiters.add(woken)  # before looking: a value published after the look wakes it
            try:
                if self._verified > pos:
                    return
                if self._failed is not None:
                    raise UpstreamEnded(f"the fetch on {self.node!r} feeding it failed: {self._failed}")
                now, seen = trio.current_time(), self.progress()
                if seen != last:
                    last, since = seen, now
                elif now - since > stall_s:
                    raise UpstreamEnded(f"node {self.node!r} has verified {self._verified:,} of {self.size:,} "
                                        f"bytes of {self.path.name} and received nothing for {stall_s:.0f} s")
                with trio.move_on_after(tick):
                    await woken.wait()
            finally:
                self._waiters.discard(woken)


class Partials:
    """The files this agent is fetching, by sha256, for the blob route."""

    def __init__(self) -> None:
        self._by_sha: dict[str, Partial] = {}

    def add(self, sha: str, partial: Partial) -> Partial:
        return self._by_sha.setdefault(sha, partial)

    def get(self, sha: str) -> Partial | None:
        return self._by_sha.get(sha)

    def drop(self, sha: str, partial: Partial) -> None:
        if self._by_sha.get(sha) is partial:
            del self._by_sha[sha]


class PartialBlobResponse(Response):
    """A Range answer over a Partial: the head at once when the first byte is verified, the body as
    the following pieces are."""

    def __init__(self, partial: Partial, range_header: str | None, stall_s: float = STALL_S) -> None:
        self.partial = partial
        self.range_header = range_header
        self.stall_s = stall_s
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        p = self.partial
        rng = parse_range(self.range_header, p.size)
        if rng == "unsatisfiable":
            await send_unsatisfiable(send, self.range_header, p.size)
            return
        status, headers, start, length = head_of(rng if isinstance(rng, tuple) else None, p.size)
        if length:
            ended, left = await self._first_byte(receive, start)
            if left:
                return  # the peer hung up while it waited: nobody to answer
            if ended is not None:
                await send_error(send, 504, "piece_wait_timeout", f"byte {start:,} is not verified here yet: {ended}")
                return
        await send({"type": "http.response.start", "status": status, "headers": answer_headers(scope, headers)})
        if scope["method"] == "HEAD" or length == 0:
            await send({"type": "http.response.body", "body": b""})
            return

        async def ready(pos: int) -> int:
            await p.wait_for(pos, self.stall_s)  # UpstreamEnded cuts the answer: the peer resumes
            return p.verified

        def sending(n: int) -> None:
            if p.verified < p.size:
                p.served += n

        with await _open(p) as fh:
            await send_range(scope, send, fh.fileno(), start, length, ready, sending)


    async def _first_byte(self, receive: Receive, start: int) -> tuple[UpstreamEnded | None, bool]:
        """Wait until byte `start` is verified: (why the wait ended without it, whether the peer
        hung up meanwhile). A peer that leaves ends its wait at once, not when the upstream does."""
        ended: UpstreamEnded | None = None
        left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass  # the GET's (empty) body
            left = True
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            try:
                await self.partial.wait_for(start, self.stall_s)
            except UpstreamEnded as exc:
                ended = exc
            finally:
                nursery.cancel_scope.cancel()
        return ended, left


async def _open(p: Partial) -> IO[bytes]:
    # The partial file is renamed into the store when complete and the writer then points `path`
    # at the blob: between the two neither name may be there, for a moment. An open descriptor
    # survives the rename.
    for _ in range(100):
        try:
            return open(p.path, "rb")
        except FileNotFoundError:
            await trio.sleep(POLL_S)
    raise UpstreamEnded(f"{p.path} is gone")
