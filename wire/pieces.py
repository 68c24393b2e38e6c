"""Piece digests of a file (pure): computed at import, checked by a receiver as bytes land.

A file larger than one piece carries `piece_bytes` and one list in its manifest entry: `prefixes`
(imports from now on), the sha256 of the file's bytes [0, (k+1)*piece_bytes) for each piece k, the
last therefore the file's own sha256 (check_entry requires it); or `pieces` (manifests written
before: their digests are pinned in fleet files, so they are still read and checked as they were),
the sha256 of each piece on its own. Never both. The list is part of the manifest, and the manifest
is pinned by the model's digest (the sha256 of its canonical JSON), which the plan names and the
receiver checks before it acts on the manifest: a peer cannot forge an entry without changing the
digest the receiver asked for.

A prefix digest verifies piece k given pieces 0..k-1: those were verified the same way, and finding
other bytes for piece k with the same prefix digest is a sha256 collision (or second preimage).
So a receiver keeps one running sha256 over the file in order, compares a copy's digest at each
boundary (a copy and one padding block: nothing) and forwards the piece at once; at the end the
running hash is the file's sha256, checked as before. One pass per byte where `pieces` took two
(each piece's own hash, then the whole file's): 0.7 CPU-s per GiB less on every receiver here.

Piece size, by the file's size (`sized`, unless the import names one): a chain forwards a piece
only once it is verified, so each hop adds about one piece's transfer time, and a hop's share of
the copy is piece/size. The smallest power of two of at least 1/256 of the file keeps eight hops
within ~3% of the copy (16 MiB pieces, fixed before, added 8 x 0.14 s = 12% to a 1 GiB copy at
1 Gbit/s: bench/fanout 1.39 -> 1.12 at 0.5 GiB), from 4 MiB (256 boundaries a GiB, each a hash copy
and a wake-up) to 64 MiB, so that a 140 GB model lists ~2,100 digests (~140 KB of manifest) and a
hop of it adds 0.56 s at 1 Gbit/s to a 19-minute copy."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

PIECE_BYTES = 16 << 20  # what imports used before `sized`
SIZED_MIN, SIZED_MAX, SIZED_SHARE = 4 << 20, 64 << 20, 256
MIN_PIECE = 64 << 10  # smaller pieces would make a manifest larger than the bytes they check
MAX_PIECE = 1 << 30


def sized(size: int) -> int:
    """The piece size for a file of `size` bytes: the smallest power of two of at least
    size / SIZED_SHARE, from SIZED_MIN to SIZED_MAX."""
    return min(SIZED_MAX, max(SIZED_MIN, 1 << max(0, -(-size // SIZED_SHARE) - 1).bit_length()))


def count(size: int, piece_bytes: int) -> int:
    return (size + piece_bytes - 1) // piece_bytes


def entry_fields(size: int, pieces: list[str], piece_bytes: int) -> dict[str, Any]:
    """What a file's manifest entry carried about its pieces before prefixes (tests and old
    manifests): nothing for a file of one piece (its sha256 is that piece's hash already)."""
    return {"piece_bytes": piece_bytes, "pieces": pieces} if size > piece_bytes else {}


def prefix_fields(size: int, prefixes: list[str], piece_bytes: int) -> dict[str, Any]:
    """What a file's manifest entry carries about its pieces: nothing for a file of one piece."""
    return {"piece_bytes": piece_bytes, "prefixes": prefixes} if size > piece_bytes else {}


def listed(f: dict[str, Any]) -> bool:
    """Whether a (valid) manifest entry can be verified and forwarded piece by piece."""
    return "prefixes" in f or "pieces" in f


def check_entry(f: dict[str, Any], hex_re: Any) -> str | None:
    """What is wrong with a manifest entry's piece list, or None (an entry without one is fine)."""
    if "pieces" not in f and "prefixes" not in f and "piece_bytes" not in f:
        return None
    if "pieces" in f and "prefixes" in f:
        return "pieces and prefixes are two forms of one list: an entry carries one of them, not both"
    key = "prefixes" if "prefixes" in f else "pieces"
    n, hashes = f.get("piece_bytes"), f.get(key)
    if not isinstance(n, int) or isinstance(n, bool) or not MIN_PIECE <= n <= MAX_PIECE:
        return f"piece_bytes must be an integer from {MIN_PIECE} to {MAX_PIECE}"
    if not isinstance(hashes, list) or len(hashes) != count(f["size"], n):
        return f"{key} must list {count(f['size'], n)} hashes for {f['size']} bytes in pieces of {n}"
    if not all(isinstance(p, str) and hex_re.match(p) for p in hashes):
        return f"every {'prefix' if key == 'prefixes' else 'piece'} hash must be 64 lowercase hex digits"
    if key == "prefixes" and hashes[-1] != f.get("sha256"):
        return "the last prefix is the whole file, so its hash must be the file's sha256"
    return None


class _Hashing:
    """What both listings share: a stream fed in chunks of any size, a digest listed at the end of
    each piece (`_at_piece_end`: the piece's own, or the prefix's)."""

    def __init__(self, piece_bytes: int) -> None:
        self.piece_bytes = piece_bytes
        self.listed: list[str] = []
        self._h = hashlib.sha256()
        self._left = piece_bytes

    def _at_piece_end(self) -> str:
        raise NotImplementedError

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            take = min(self._left, len(view))
            self._h.update(view[:take])
            self._left -= take
            view = view[take:]
            if self._left == 0:
                self.listed.append(self._at_piece_end())
                self._left = self.piece_bytes


class Hasher(_Hashing):
    """The sha256 of each piece of a stream, fed in chunks of any size."""

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        super().__init__(piece_bytes)
        self.pieces = self.listed

    def _at_piece_end(self) -> str:
        digest = str(self._h.hexdigest())
        self._h = hashlib.sha256()
        return digest

    def finish(self) -> list[str]:
        if self._left != self.piece_bytes:
            self.pieces.append(self._at_piece_end())
            self._left = self.piece_bytes
        return self.pieces


@dataclass(frozen=True, slots=True)
class BadPiece:
    index: int
    offset: int
    length: int
    expected: str
    actual: str
    prefix: bool = False  # expected/actual are the digests of bytes [0, offset + length), not of the piece


class BadPieceError(Exception):
    """A piece that does not hash to its manifest's entry; its bytes must be discarded."""

    def __init__(self, bad: BadPiece) -> None:
        what = f"bytes 0-{bad.offset + bad.length - 1} then hash" if bad.prefix else "it hashes"
        super().__init__(f"piece {bad.index} (bytes {bad.offset}-{bad.offset + bad.length - 1}) is corrupt: {what} "
                         f"to sha256 {bad.actual}, not {bad.expected}")
        self.bad = bad


class _Checking:
    """What both checks share: bytes fed from a piece boundary on, each piece judged as it ends
    (`_digest`), after which `_settle` readies the hash for the next piece or, after a bad piece,
    puts it back where the good prefix ends, so that the piece can be fed again."""

    expected: list[str]
    prefix = False

    def __init__(self, piece_bytes: int, size: int, start: int) -> None:
        assert start % piece_bytes == 0 or start == size, "a check starts on a piece boundary"
        self.piece_bytes, self.size = piece_bytes, size
        self.verified = start
        self._at = start  # bytes fed so far, counted from the file's start
        self._h: Any = None

    def _end(self) -> int:
        return min(self.verified + self.piece_bytes, self.size)

    def _digest(self) -> str:
        raise NotImplementedError

    def _settle(self, good: bool) -> None:
        raise NotImplementedError

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes; raises BadPieceError at the first piece that does not match."""
        view = memoryview(data)
        if len(view) > self.size - self._at:
            raise ValueError(f"{len(view)} bytes fed past the file's end ({self.size - self._at} left)")
        while len(view):
            take = min(self._end() - self._at, len(view))
            self._h.update(view[:take])
            self._at += take
            view = view[take:]
            if self._at == self._end():
                index = self.verified // self.piece_bytes
                actual = self._digest()
                if actual != self.expected[index]:
                    self._settle(good=False)
                    self._at = self.verified
                    raise BadPieceError(BadPiece(index, self.verified, self._end() - self.verified,
                                                 self.expected[index], actual, prefix=self.prefix))
                self._settle(good=True)
                self.verified = self._at


class Checker(_Checking):
    """Checks a file's pieces as its bytes arrive from `start` (a piece boundary) on. `verified` is
    the length of the file's good prefix: bytes past it are never served or kept."""

    def __init__(self, pieces: list[str], piece_bytes: int, size: int, start: int = 0) -> None:
        super().__init__(piece_bytes, size, start)
        self.pieces = self.expected = pieces
        self._h = hashlib.sha256()

    def _digest(self) -> str:
        return str(self._h.hexdigest())

    def _settle(self, good: bool) -> None:
        self._h = hashlib.sha256()  # each piece is hashed on its own, good or bad


class PrefixHasher(_Hashing):
    """The sha256 of each prefix of a stream ending on a piece boundary (the last at its end), and
    the whole stream's sha256, in one pass, fed in chunks of any size."""

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        super().__init__(piece_bytes)
        self.prefixes = self.listed

    def _at_piece_end(self) -> str:
        return str(self._h.copy().hexdigest())

    def finish(self) -> tuple[list[str], str]:
        """(the prefix digests, the whole stream's sha256); an empty stream has no prefix."""
        whole = self._h.hexdigest()
        if self._left != self.piece_bytes:
            self.prefixes.append(whole)
            self._left = self.piece_bytes
        return self.prefixes, whole


class PrefixChecker(_Checking):
    """Checks a file's prefix digests as its bytes arrive from `start` (a piece boundary, with
    `running` the sha256 of the bytes before it) on: the one hash of each byte, the whole file's
    at the end. `verified` is the length of the file's good prefix; after a bad piece the hash is
    back where that prefix ends, so the piece can be fed again."""

    prefix = True

    def __init__(self, prefixes: list[str], piece_bytes: int, size: int, start: int = 0,
                 running: Any = None) -> None:
        super().__init__(piece_bytes, size, start)
        self.prefixes = self.expected = prefixes
        self._h = running if running is not None else hashlib.sha256()
        self._good = self._h.copy()  # the hash at `verified`: what a bad piece falls back to

    def _digest(self) -> str:
        return str(self._h.copy().hexdigest())

    def _settle(self, good: bool) -> None:
        if good:
            self._good = self._h.copy()
        else:
            self._h = self._good.copy()

    def hexdigest(self) -> str:
        """The sha256 of the bytes verified so far: the whole file's once `verified` is its size."""
        return str(self._good.hexdigest())
