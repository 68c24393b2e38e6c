"""A fetch's partial file (agent/partfile.py): the whole-file hash thread beside the receiver ends
with the fetch, cancelled or not, and a receiving thread left running by a cancel stops taking."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from agent.forward import Partial
from agent.partfile import Take, write_pieced
from wire import pieces

PIECE = pieces.MIN_PIECE
BLOCK = 16 << 10


@dataclass
class Job:
    digest: str = "sha256:" + "ab" * 32
    peer: str = "http://peer"
    bytes_done: int = 0
    bytes_fetched: int = 0


def entry(data: bytes) -> dict[str, Any]:
    h = pieces.Hasher(PIECE)
    h.update(data)
    return {"path": "m.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "piece_bytes": PIECE, "pieces": h.finish()}


def hashing_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "whole-file sha256"]


def test_a_cancelled_fetch_leaves_no_hashing_thread_and_its_abandoned_receiver_stops(tmp_path: Path) -> None:
    # The receiver feeds blocks from a worker thread that trio abandons on a cancel, as
    # agent/peerhttp.py's does; before, the cancel also cancelled the hashing thread's close, which
    # then waited for a block forever (one thread per cancelled fetch), and the receiver went on.
    data = os.urandom(50 * PIECE)
    f = entry(data)
    part = tmp_path / "m.part"
    partial = Partial(part, len(data), progress=lambda: 0)
    fed_after_cancel: list[int] = []
    cancelled = threading.Event()
    ended = threading.Event()
    before = set(hashing_threads())

    async def download(path: str, first: int, last: int, take: Take) -> int:
        def feed() -> int:
            try:
                for at in range(first, last + 1, BLOCK):
                    take(data[at:at + BLOCK])
                    if cancelled.is_set():
                        fed_after_cancel.append(at)
                    time.sleep(0.005)
                return last + 1 - first
            finally:
                ended.set()
        return await trio.to_thread.run_sync(feed, abandon_on_cancel=True)

    async def main() -> None:
        with trio.move_on_after(0.3):
            await write_pieced(Job(), part, f, partial, download, tmp_path / "dest", "n1")
        cancelled.set()

    trio.run(main)
    assert ended.wait(5), "the abandoned receiver kept taking blocks"
    assert len(fed_after_cancel) <= 1  # at most the block it was in when the cancel came
    deadline = time.monotonic() + 5
    while set(hashing_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(hashing_threads()) - before, "the whole-file hash thread was left waiting"
    assert part.stat().st_size % PIECE == 0  # what is kept ends on a piece boundary, for the resume


def test_a_whole_fetch_ends_its_hashing_thread_and_installs_the_file(tmp_path: Path) -> None:
    data = os.urandom(10 * PIECE + 123)
    f = entry(data)
    part = tmp_path / "m.part"
    partial = Partial(part, len(data), progress=lambda: 0)
    before = set(hashing_threads())

    async def download(path: str, first: int, last: int, take: Take) -> int:
        for at in range(first, last + 1, BLOCK):
            take(data[at:min(last + 1, at + BLOCK)])
        return 200

    trio.run(write_pieced, Job(), part, f, partial, download, tmp_path / "dest", "n1")
    assert (tmp_path / "dest").read_bytes() == data and partial.verified == len(data)
    assert not set(hashing_threads()) - before
