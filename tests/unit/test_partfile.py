"""A fetch's partial file (agent/partfile.py): the hash thread beside the receiver ends with the
fetch, cancelled or not, and a receiving thread left running by a cancel stops taking; a file is
checked by its prefix digests (or, in a manifest written before them, its pieces' own hashes): a
corrupt piece is discarded and named, a resume re-checks what is held and goes on from there."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from agent.forward import Partial
from agent.partfile import FetchError, Take, write_pieced
from wire import pieces

PIECE = pieces.MIN_PIECE
BLOCK = 16 << 10


@dataclass
class Job:
    digest: str = "sha256:" + "ab" * 32
    peer: str = "http://peer"
    bytes_done: int = 0
    bytes_fetched: int = 0


def entry(data: bytes, form: str = "prefixes") -> dict[str, Any]:
    """A manifest entry as an import writes it now (`prefixes`), or as it did before (`pieces`)."""
    if form == "pieces":
        h = pieces.Hasher(PIECE)
        h.update(data)
        listed = h.finish()
    else:
        p = pieces.PrefixHasher(PIECE)
        p.update(data)
        listed = p.finish()[0]
    return {"path": "m.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "piece_bytes": PIECE, form: listed}


def serving(data: bytes, asked: list[int] | None = None) -> Any:
    """A peer's download that hands `data`'s asked range over in blocks, noting where each starts."""
    async def download(path: str, first: int, last: int, take: Take) -> int:
        if asked is not None:
            asked.append(first)
        for at in range(first, last + 1, BLOCK):
            take(data[at:min(last + 1, at + BLOCK)])
        return 200
    return download


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


@pytest.mark.parametrize("form", ["prefixes", "pieces"])
def test_a_whole_fetch_ends_its_hashing_thread_and_installs_the_file(tmp_path: Path, form: str) -> None:
    data = os.urandom(10 * PIECE + 123)
    f = entry(data, form)
    part = tmp_path / "m.part"
    partial = Partial(part, len(data), progress=lambda: 0)
    before = set(hashing_threads())
    trio.run(write_pieced, Job(), part, f, partial, serving(data), tmp_path / "dest", "n1")
    assert (tmp_path / "dest").read_bytes() == data and partial.verified == len(data)
    assert not set(hashing_threads()) - before


@pytest.mark.parametrize("form", ["prefixes", "pieces"])
def test_a_corrupt_middle_piece_is_discarded_and_named_and_the_next_fetch_goes_on_after_the_good_ones(
        tmp_path: Path, form: str) -> None:
    data = os.urandom(8 * PIECE + 99)
    bad = bytearray(data)
    bad[5 * PIECE + 17] ^= 1  # in piece 5
    f = entry(data, form)
    part, dest = tmp_path / "m.part", tmp_path / "dest"
    partial = Partial(part, len(data), progress=lambda: 0)
    job = Job()
    with pytest.raises(FetchError) as err:
        trio.run(write_pieced, job, part, f, partial, serving(bytes(bad)), dest, "n1")
    assert err.value.code == "piece_corrupt"
    for said in ("piece 5 ", f"bytes {5 * PIECE:,}-{6 * PIECE - 1:,}", "from peer http://peer", "node 'n1'",
                 f"the {5 * PIECE:,} verified bytes before it are kept"):
        assert said in str(err.value), (said, str(err.value))
    if form == "prefixes":
        assert f"expected the sha256 of bytes 0-{6 * PIECE - 1:,} {f['prefixes'][5]}" in str(err.value)
    assert part.read_bytes() == data[:5 * PIECE] and partial.verified == 5 * PIECE and not dest.exists()
    assert job.bytes_done == 5 * PIECE
    asked: list[int] = []
    again = Job()
    trio.run(write_pieced, again, part, f, partial, serving(data, asked), dest, "n1")
    assert asked == [5 * PIECE] and again.bytes_fetched == len(data) - 5 * PIECE
    assert dest.read_bytes() == data and partial.verified == len(data)


@pytest.mark.parametrize("held,kept", [(3 * PIECE + 1000, 3 * PIECE), (6 * PIECE, 6 * PIECE), (PIECE - 1, 0)],
                         ids=["torn", "on-a-boundary", "less-than-a-piece"])
def test_a_resume_after_a_kill_checks_the_held_prefix_and_fetches_only_the_rest(
        tmp_path: Path, held: int, kept: int) -> None:
    data = os.urandom(8 * PIECE + 99)
    f = entry(data)
    part, dest = tmp_path / "m.part", tmp_path / "dest"
    part.write_bytes(data[:held])  # what a killed receiver left: its written bytes, whole pieces or not
    partial = Partial(part, len(data), progress=lambda: 0)
    asked: list[int] = []
    job = Job()
    trio.run(write_pieced, job, part, f, partial, serving(data, asked), dest, "n1")
    assert asked == [kept] and job.bytes_fetched == len(data) - kept
    assert dest.read_bytes() == data and partial.verified == len(data)


def test_a_held_piece_that_rotted_is_fetched_again_with_everything_after_it(tmp_path: Path) -> None:
    data = os.urandom(8 * PIECE + 99)
    held = bytearray(data[:6 * PIECE])
    held[2 * PIECE + 3] ^= 1  # the prefix after piece 1 no longer matches, whatever follows
    part, dest = tmp_path / "m.part", tmp_path / "dest"
    part.write_bytes(bytes(held))
    asked: list[int] = []
    trio.run(write_pieced, Job(), part, entry(data), Partial(part, len(data), progress=lambda: 0),
             serving(data, asked), dest, "n1")
    assert asked == [2 * PIECE] and dest.read_bytes() == data
