"""A fetch's partial file on disk: opened for a resume, re-hashed, checked piece by piece as it is
written (a bad piece cut off and named), fsynced and moved into the store; and a fetch's errors."""

from __future__ import annotations

import hashlib
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Awaitable, Callable, Iterator, Protocol

import trio

from wire import pieces

from agent.transfer.forward import Partial
from agent.weights.store import CHUNK, fsync_dir

Take = Callable[[bytes | bytearray | memoryview], None]
# (path on the peer, first byte, last byte, take): the peer GET that feeds `take` (agent/transfer/peerhttp.py)
Download = Callable[[str, int, int, Take], Awaitable[int]]


class FetchError(Exception):
    def __init__(self, message: str, code: str = "fetch_failed") -> None:
        super().__init__(message)
        self.code = code


class LocalWrite(Exception):
    """A write to our own disk failed inside the transfer; not an OSError, so that the peer code,
    which reads every OSError as a broken connection, lets it through."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class Counters(Protocol):
    """The job's byte counters a write advances (agent/transfer/fetch.py Job)."""

    digest: str
    peer: str
    bytes_done: int
    bytes_fetched: int


class Wakeup:
    """One thread wakes another: a plain lock, taken by the waiter and released by the waker, where
    threading.Semaphore's condition variable allocated a lock and ran a dozen Python lines a wait:
    a GiB handed over in 512 KiB blocks cost 0.78-0.83 CPU-s with the hash (0.69 alone), 0.76-0.78
    with this (2,048 hand-overs of one block, both side by side, four rounds). It does not count:
    a second set before the wait is one set, which is all HashThread needs (its thread reads what to do
    from HashThread after each wake; each block's join takes its one set)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already set
            pass

    def wait(self, timeout: float = -1) -> bool:
        return self._lock.acquire(True, timeout)


class HashThread:
    """The file's hashing, in a thread of its own beside the receiving one (hashlib releases the
    GIL): the one running hash that checks each prefix digest and ends as the file's sha256
    (wire/pieces.py PrefixChecker), or, for a manifest with `pieces`, the whole file's sha256 while
    the receiver checks each piece's own. Hashing in the receiving thread halved a fetch here (212
    to 112 MB/s on loopback with both hashes, bench/replication.py). The receiver's block is hashed
    where it lies, no copy: `start` hands it over and `join` waits until the hash is done with it,
    before the receiver reuses the block (one hand-over a block: a copy of each block and a queue
    operation a recv cost the receiver 0.2-0.3 CPU-s per GiB). What the hash raises (a bad piece)
    comes out of the `join` after it. Both are called inside a `turn`, which `close` waits for."""

    WAIT_S = 60.0  # a hasher this far behind is a stuck machine: the fetch fails (and resumes)

    def __init__(self, whole: Any, wait_s: float = WAIT_S) -> None:
        self.whole = whole
        self.wait_s = wait_s
        # A turn is one block's write plus its hash, whose join gives up after wait_s: a turn longer
        # than this is a write stuck on our disk.
        self.turn_s = 2 * wait_s
        self._block: bytes | bytearray | memoryview | None = None
        self._error: Exception | None = None
        self._go = Wakeup()  # a block is handed over, or the end
        self._done = Wakeup()  # the block's hash is done
        self._busy = False
        self._stuck = False  # a join gave up: the thread may still hold a block, so none is handed again
        self._closed = False
        self._ended = False
        # Held for the whole of a receiver's turn with one block (the hand-over, its write, its
        # check, the join, what it publishes): a receiving thread that trio abandoned on a cancel
        # may be anywhere in it while the fetch closes this. close takes it before it marks the end,
        # so once close returns no receiver is inside a turn and the next one is refused before it
        # writes: the fetch may then cut the file back to its verified mark and settle its counters.
        self._turn = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="whole-file sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._go.wait()
            if (block := self._block) is None:
                return
            try:
                self.whole.update(block)
            except Exception as exc:  # handed to the receiver, whose join raises it
                self._error = exc
            self._done.set()

    @contextmanager
    def one_block(self) -> Iterator[None]:
        """The receiver's turn with one block; after close, a LocalWrite before anything is done:
        the receiving thread of a cancelled fetch stops at its next block."""
        with self._turn:
            if self._closed or self._stuck:
                raise LocalWrite(OSError("the fetch ended: no more blocks are taken"))
            yield

    def start(self, block: bytes | bytearray | memoryview) -> None:
        """Hash `block` beside the caller (inside a turn), who leaves it untouched until `join`."""
        self._block, self._busy = block, True
        self._go.set()

    def join(self) -> None:
        if self._busy:
            if not self._done.wait(self.wait_s):
                self._stuck = True
                raise LocalWrite(OSError(f"the whole-file hash took over {self.wait_s:g} s for one block"))
            self._busy, self._block = False, None
            if (error := self._error) is not None:
                self._error = None
                raise error

    def hexdigest(self) -> str:
        if not self.close() or self._thread.is_alive():
            raise LocalWrite(OSError(f"the whole-file hash did not end within {self.wait_s:g} s"))
        return str(self.whole.hexdigest())

    def close(self) -> bool:
        """Wait for the turn in progress, refuse every turn from now on and end the thread (after a
        stuck hash, when that hash ends). Blocks for up to one block's write and hash: call it off
        the event loop. False when the turn outlasted turn_s (a stuck write): its receiver is still
        in it. Idempotent."""
        # Marked before the lock is taken, which a receiver going from one block to the next would
        # win again and again (a lock is not fair): its next turn reads this before it writes.
        self._closed = True
        if not self._turn.acquire(timeout=self.turn_s):
            return False
        try:
            if not self._ended:
                self._ended = True
                self._block = None  # the thread took its own reference to a block it still hashes
                self._go.set()
        finally:
            self._turn.release()
        if not self._stuck:
            self._thread.join(self.wait_s)
        return True

    @property
    def closed(self) -> bool:
        """A close was begun: it may have given up on a stuck write (see close), and is not waited for twice."""
        return self._closed

    @property
    def stuck(self) -> bool:
        """A join gave up on a block's hash: that thread may still be advancing the check."""
        return self._stuck


async def close(hasher: HashThread) -> bool:
    """HashThread.close for a fetch that ends: shielded, since a cancelled fetch must still end the hashing
    thread (it would wait for a block forever) and stop its abandoned receiver; in a thread, since
    close waits for the block that receiver may be writing (one block's write and hash)."""
    with trio.CancelScope(shield=True):
        quiet = await trio.to_thread.run_sync(hasher.close)
    return quiet


async def write_pieced(job: Counters, part: Path, f: dict[str, Any], partial: Partial, download: Download,
                       dest: Path, node: str, hashing: Callable[[Any], HashThread] = HashThread) -> None:
    """Fetch the file `f` (a manifest entry with a piece list) into `part`: each piece checked as it
    lands, then published to `partial` (served to peers); the whole file checked at the end.
    `hashing` makes the HashThread that runs a hash (a test's makes one that is slow to answer)."""
    size, piece_bytes, sha = f["size"], f["piece_bytes"], f["sha256"]
    prefixed = "prefixes" in f
    fh, have = await trio.to_thread.run_sync(open_part, part, size)
    with fh:
        # What an earlier attempt left: whole pieces that still verify are kept (read once, hashed
        # once); a torn or bad tail is cut off and fetched again (at most one piece for a clean break).
        check: pieces.PrefixChecker | pieces.Checker
        if prefixed:
            good, running = await trio.to_thread.run_sync(good_prefix, fh, f["prefixes"], piece_bytes, size)
            check = pieces.PrefixChecker(f["prefixes"], piece_bytes, size, good, running)
            hasher = hashing(check)  # the one running hash, on the other core: it checks and ends as the sha256
        else:
            whole = hashlib.sha256()
            good = await trio.to_thread.run_sync(good_pieces, fh, f["pieces"], piece_bytes, size, whole) if have else 0
            check = pieces.Checker(f["pieces"], piece_bytes, size, good)
            hasher = hashing(whole)
        def take(chunk: bytes | bytearray | memoryview) -> None:
            with hasher.one_block():  # all of it: a cancelled fetch cuts the file back only after this block
                hasher.start(chunk)  # hashed on the other core while this one writes
                try:
                    try:
                        fh.write(chunk)
                    except OSError as exc:
                        raise LocalWrite(exc) from None
                    job.bytes_done += len(chunk)
                    job.bytes_fetched += len(chunk)
                    if not prefixed:
                        check.update(chunk)
                finally:
                    hasher.join()  # the caller reuses the block when this returns; a bad prefix raises here
                if check.verified != partial.verified:
                    fh.flush()  # what peers read must be in the file before they are told it is there
                    partial.verified = check.verified

        try:
            fh.truncate(good)
            job.bytes_done += good
            partial.verified = good
            if good < size:
                fh.seek(good)
                try:
                    await download(f"/v1/blobs/{sha}", good, size - 1, take)
                except pieces.BadPieceError as exc:
                    b = exc.bad
                    of = f"the sha256 of bytes 0-{b.offset + b.length - 1:,} " if b.prefix else "sha256 "
                    raise FetchError(
                        f"piece {b.index} of {f['path']} in {job.digest} (bytes {b.offset:,}-"
                        f"{b.offset + b.length - 1:,}) from peer {job.peer} is corrupt on arrival at node "
                        f"{node!r}: expected {of}{b.expected}, received {b.actual}; the piece was discarded, "
                        f"the {b.offset:,} verified bytes before it are kept and the next fetch resumes there",
                        "piece_corrupt") from None
                finally:
                    # The file is cut back and the counters settled once nothing writes: after close.
                    # A close that gave up (a write stuck on our disk) leaves the file to the next re-check.
                    if await close(hasher):
                        # Read once. After a stuck hash (a join gave up) its thread may still advance
                        # check.verified; what take last published, inside its turn, is written and checked
                        # (a piece checked but not published is fetched again: at most one).
                        kept = partial.verified if hasher.stuck else check.verified
                        job.bytes_done -= fh.tell() - kept
                        fh.truncate(kept)  # only verified pieces are kept: a resume starts on a boundary
                        fh.flush()
                        partial.verified = kept
            actual = await trio.to_thread.run_sync(hasher.hexdigest)
            if actual != sha:  # the pieces are pinned by the digest too: a bad manifest, or a bug
                part.unlink(missing_ok=True)
                raise FetchError(f"{f['path']} of {job.digest} from peer {job.peer}: every piece matched, but "
                                 f"the file hashes to sha256 {actual}, not {sha}; the bytes were discarded")
            await trio.to_thread.run_sync(install, fh, part, dest)
        finally:
            # A fetch that ends before the download's own close still ends the hashing thread: a cancel
            # delivered as hexdigest's thread starts, after a re-check found the file whole (no
            # download), or an error. Not again after a close that gave up: it waited turn_s already.
            if not hasher.closed:
                await close(hasher)
    partial.path = dest
    partial.verified = size


def open_part(part: Path, total: int) -> tuple[IO[bytes], int]:
    """The partial file, opened for writing, and how many of its bytes an earlier attempt left."""
    have = part.stat().st_size if part.exists() else 0
    if have > total:
        have = 0
    fh = open(part, "r+b" if part.exists() else "w+b")
    fh.truncate(have)
    return fh, have


def rehash(fh: IO[bytes], pos: int, count: int, hashers: list[Any]) -> None:
    fh.seek(pos)
    while count:
        chunk = fh.read(min(CHUNK, count))
        if not chunk:
            break
        for x in hashers:
            x.update(chunk)
        count -= len(chunk)


def good_prefix(fh: IO[bytes], prefixes: list[str], piece_bytes: int, size: int) -> tuple[int, Any]:
    """How many bytes at the file's start end on a boundary whose prefix digest matches, and the
    running sha256 of those bytes (a resume goes on from it)."""
    fh.seek(0)
    h, good = hashlib.sha256(), 0
    for expected in prefixes:
        data = fh.read(min(piece_bytes, size - good))
        if len(data) < min(piece_bytes, size - good):
            break
        grown = h.copy()
        grown.update(data)
        if grown.hexdigest() != expected:
            break
        h, good = grown, good + len(data)
    return good, h


def good_pieces(fh: IO[bytes], hashes: list[str], piece_bytes: int, size: int, whole: Any) -> int:
    """How many bytes at the file's start are whole pieces matching their hashes (fed to `whole`)."""
    fh.seek(0)
    good = 0
    for expected in hashes:
        data = fh.read(min(piece_bytes, size - good))
        if len(data) < min(piece_bytes, size - good) or hashlib.sha256(data).hexdigest() != expected:
            break
        whole.update(data)
        good += len(data)
    return good


def install(fh: IO[bytes], part: Path, dest: Path) -> None:
    """fsync the verified file and move it into the store under its digest."""
    fh.flush()
    os.fsync(fh.fileno())
    os.replace(part, dest)
    fsync_dir(dest.parent)
