"""A fetch's partial file (agent/transfer/partfile.py): the hash thread beside the receiver ends with the
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
from typing import Any, Callable

import pytest
import trio

from agent.transfer.forward import Partial
from agent.transfer.partfile import FetchError, HashThread, LocalWrite, Take, Wakeup, write_pieced
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
    # agent/transfer/peerhttp.py's does; before, the cancel also cancelled the hashing thread's close, which
    # then waited for a block forever (one thread per cancelled fetch), and the receiver went on.
    # Here it cancels the fetch after its first block, waits until the fetch has ended the hashing
    # thread, then offers the next block, which must be refused.
    data = os.urandom(50 * PIECE)
    f = entry(data)
    part = tmp_path / "m.part"
    partial = Partial(part, len(data), progress=lambda: 0)
    refused: list[str] = []
    ended = threading.Event()
    before = set(hashing_threads())

    async def main() -> None:
        with trio.CancelScope() as scope:
            async def download(path: str, first: int, last: int, take: Take) -> int:
                def feed() -> int:
                    try:
                        take(data[first:first + BLOCK])
                        trio.from_thread.run_sync(scope.cancel)
                        for t in set(hashing_threads()) - before:
                            t.join(10)  # the fetch ends it as it closes, after this receiver's block
                        take(data[first + BLOCK:first + 2 * BLOCK])
                    except LocalWrite as exc:
                        refused.append(str(exc))
                    finally:
                        ended.set()
                    return 2 * BLOCK
                return await trio.to_thread.run_sync(feed, abandon_on_cancel=True)

            await write_pieced(Job(), part, f, partial, download, tmp_path / "dest", "n1")

    trio.run(main)
    assert ended.wait(10), "the abandoned receiver is still inside a block"
    assert refused == ["the fetch ended: no more blocks are taken"]
    assert not set(hashing_threads()) - before, "the whole-file hash thread was left waiting"
    assert part.stat().st_size == partial.verified == 0  # what is kept ends on a piece boundary, for the resume


class HeldJob:
    """A job whose counters, when the receiving thread counts its second block (written, not yet
    checked), cancel the fetch and hold that block in flight until the fetch's own thread touches
    them (which it must not do before that block is done) or the fetch is seen waiting for the
    block's turn to end. No timer decides: a broken fetch, however slow, touches them first;
    SAFETY_S only ends a test whose fetch does neither, which then fails."""

    SAFETY_S = 30.0

    def __init__(self) -> None:
        self.digest, self.peer = "sha256:" + "ab" * 32, "http://peer"
        self.bytes_fetched, self.blocks = 0, 0
        self.cancel: Callable[[], None] = lambda: None
        self.fetch_thread = threading.current_thread()
        self.touched = threading.Event()
        self.touched_in_flight = self.seen_waiting = False
        self.hashers: list[HashThread] = []  # the fetch's hash threads (write_pieced's `hashing`)
        self._done = 0

    def hashing(self, check: Any) -> HashThread:
        made = HashThread(check)
        self.hashers.append(made)
        return made

    def close_waits_for_the_turn(self) -> bool:
        """Whether the fetch has begun closing its hash thread while this receiver, inside its block's
        turn, holds that turn: close marks itself closed before it takes the turn, so it is then
        waiting for this block to end, which is all a fetch may do until the block is done."""
        return any(h.closed for h in self.hashers)

    @property
    def bytes_done(self) -> int:
        return self._done

    @bytes_done.setter
    def bytes_done(self, value: int) -> None:
        if threading.current_thread() is self.fetch_thread:
            self._done = value
            self.touched.set()
            return
        self._done = value
        self.blocks += 1
        if self.blocks == 2:
            self.touched.clear()  # the fetch counted what it found held before the first block
            trio.from_thread.run_sync(self.cancel)
            end = time.monotonic() + self.SAFETY_S
            while not self.touched.wait(0.005) and time.monotonic() < end:
                if self.close_waits_for_the_turn():
                    self.seen_waiting = True
                    break
            self.touched_in_flight = self.touched.is_set()


@pytest.mark.parametrize("form", ["prefixes", "pieces"])
def test_a_cancelled_fetch_cuts_its_file_back_only_after_the_block_in_flight(tmp_path: Path, form: str) -> None:
    # Before, close waited only for the hash of the receiver's block: the fetch truncated the file
    # and settled bytes_done while its abandoned receiver was still writing and counting that
    # block, which then counted it (and published its piece) after the fetch had returned.
    data = os.urandom(8 * PIECE)
    f = entry(data, form)
    part = tmp_path / "m.part"
    partial = Partial(part, len(data), progress=lambda: 0)
    ended = threading.Event()
    at_return: dict[str, int] = {}
    refused: list[int] = []

    async def download(path: str, first: int, last: int, take: Take) -> int:
        def feed() -> int:
            try:
                for at in range(first, last + 1, PIECE):  # a block a piece: each take verifies one
                    try:
                        take(data[at:at + PIECE])
                    except LocalWrite:
                        refused.append(at)
                        break
            finally:
                ended.set()
            return 0
        return await trio.to_thread.run_sync(feed, abandon_on_cancel=True)

    async def main() -> None:
        with trio.CancelScope() as scope:
            job.cancel = scope.cancel
            await write_pieced(job, part, f, partial, download, tmp_path / "dest", "n1", hashing=job.hashing)
        at_return.update(size=part.stat().st_size, verified=partial.verified, done=job.bytes_done)

    job = HeldJob()
    trio.run(main)
    assert ended.wait(10)
    assert not job.touched_in_flight, "the fetch settled its counters while a block was still being written"
    assert job.seen_waiting, "the fetch was not seen waiting for the block in flight"
    assert refused == [2 * PIECE], "the block after the cancelled one was not refused"
    assert at_return == {"size": 2 * PIECE, "verified": 2 * PIECE, "done": 2 * PIECE}
    assert (part.stat().st_size, partial.verified, job.bytes_done) == (2 * PIECE, 2 * PIECE, 2 * PIECE)
    assert part.read_bytes() == data[:2 * PIECE]


class CancelsAsItCounts:
    """A job that cancels its fetch when the fetch counts what it found held: after the re-check,
    before the whole file's hash is read, where a cancel during the re-check is delivered."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.digest, self.peer = "sha256:" + "ab" * 32, "http://peer"
        self.bytes_fetched, self._done = 0, 0
        self.cancel = cancel

    @property
    def bytes_done(self) -> int:
        return self._done

    @bytes_done.setter
    def bytes_done(self, value: int) -> None:
        self._done = value
        self.cancel()


@pytest.mark.parametrize("form", ["prefixes", "pieces"])
def test_a_fetch_cancelled_as_it_rechecks_a_whole_held_file_leaves_no_hashing_thread(tmp_path: Path, form: str) -> None:
    # A held file that is whole needs no download, whose finally was the one place that ended the
    # hashing thread: a cancel landing during the re-check (delivered as hexdigest's thread starts)
    # left that thread waiting for a block forever, one a cancelled fetch.
    data = os.urandom(4 * PIECE + 7)
    part, dest = tmp_path / "m.part", tmp_path / "dest"
    part.write_bytes(data)
    f = entry(data, form)
    partial = Partial(part, len(data), progress=lambda: 0)
    before = set(hashing_threads())

    async def nothing(path: str, first: int, last: int, take: Take) -> int:
        raise AssertionError("the held file is whole: nothing to download")

    async def main() -> bool:
        with trio.CancelScope() as scope:
            await write_pieced(CancelsAsItCounts(scope.cancel), part, f, partial, nothing, dest, "n1")
        return scope.cancelled_caught

    assert trio.run(main), "the fetch ended before its cancel was delivered"
    assert not set(hashing_threads()) - before, "the whole-file hash thread was left waiting"
    assert part.read_bytes() == data and not dest.exists()  # kept whole for the next fetch, which installs it
    trio.run(write_pieced, Job(), part, f, partial, nothing, dest, "n1")
    assert dest.read_bytes() == data and partial.verified == len(data)
    assert not set(hashing_threads()) - before


class SlowToAnswer:
    """The fetch's running check, whose hash of the second block waits for `release`: a hash that
    outlasts the join's wait and goes on after the fetch gave up on it."""

    def __init__(self, check: Any) -> None:
        self.check, self.calls = check, 0
        self.entered, self.release, self.advanced = threading.Event(), threading.Event(), threading.Event()

    def update(self, block: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            self.release.wait(30)
        self.check.update(block)
        if self.calls == 2:
            self.advanced.set()

    def hexdigest(self) -> str:
        return str(self.check.hexdigest())


class ReleasesAsItCutsBack:
    """A job that lets the stuck hash go on as the fetch takes its count back (the cut-back after
    the fetch gave up), and waits for it to move the check's verified mark."""

    def __init__(self, slow: list[SlowToAnswer]) -> None:
        self.digest, self.peer = "sha256:" + "ab" * 32, "http://peer"
        self.bytes_fetched, self._done, self.slow = 0, 0, slow

    @property
    def bytes_done(self) -> int:
        return self._done

    @bytes_done.setter
    def bytes_done(self, value: int) -> None:
        if value < self._done and self.slow and self.slow[0].entered.is_set():
            self.slow[0].release.set()
            self.slow[0].advanced.wait(10)
        self._done = value


def test_a_hash_stuck_past_its_wait_cannot_move_the_cut_back_while_it_is_made(tmp_path: Path) -> None:
    # The join gives up on a block's hash (a stuck machine); that hash may still end and advance the
    # check's verified mark while the fetch cuts the file back and settles its counters, which read
    # the mark more than once: the file was cut to one value and the count and peers told another.
    data = os.urandom(4 * PIECE)
    part, f = tmp_path / "m.part", entry(data)
    partial = Partial(part, len(data), progress=lambda: 0)
    slow: list[SlowToAnswer] = []
    before = set(hashing_threads())

    def hashing(check: Any) -> HashThread:
        slow.append(SlowToAnswer(check))
        return HashThread(slow[-1], wait_s=0.2)

    async def by_piece(path: str, first: int, last: int, take: Take) -> int:
        for at in range(first, last + 1, PIECE):
            await trio.to_thread.run_sync(take, data[at:at + PIECE])
        return 200

    job = ReleasesAsItCutsBack(slow)
    with pytest.raises(LocalWrite, match="took over 0.2 s"):
        trio.run(lambda: write_pieced(job, part, f, partial, by_piece, tmp_path / "dest", "n1", hashing))
    assert slow[0].advanced.is_set() and slow[0].check.verified == 2 * PIECE  # it moved during the cut-back
    assert (part.stat().st_size, partial.verified, job.bytes_done) == (PIECE, PIECE, PIECE)
    assert part.read_bytes() == data[:PIECE]
    for t in set(hashing_threads()) - before:
        t.join(10)
    assert not set(hashing_threads()) - before


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


def test_a_signal_wakes_one_wait_and_a_second_set_before_it_is_the_same_set() -> None:
    signal = Wakeup()
    assert not signal.wait(0.01)  # nothing set: the wait gives up
    signal.set()
    signal.set()  # not counted
    assert signal.wait(0.01) and not signal.wait(0.01)
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(signal.wait(10)))
    waiter.start()
    signal.set()  # from another thread than the one that waits
    waiter.join(10)
    assert woke == [True]
