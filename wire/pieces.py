"""Per-piece hashes of a file (pure): computed at import, checked by a receiver as bytes land.

A file larger than one piece carries `piece_bytes` and `pieces` (the sha256 of each fixed-size piece,
the last one shorter) in its manifest entry. The list is part of the manifest, and the manifest is
pinned by the model's digest (the sha256 of its canonical JSON), which the plan names and the
receiver checks before it acts on the manifest: a peer cannot forge a piece hash without changing
the digest the receiver asked for. The whole file's sha256 stays in the entry and is checked at
the end too, so pieces add early detection and forwarding, never a weaker pin.

Why 16 MiB: a chain forwards a piece only once it is verified, so each hop adds about one piece's
transfer time (0.14 s at 1 Gbit/s; eight hops add ~1.1 s to a 1 GiB copy's 9 s), while a 140 GB
model still lists only ~8,300 hashes (~560 KB of manifest)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

PIECE_BYTES = 16 << 20
MIN_PIECE = 64 << 10  # smaller pieces would make a manifest larger than the bytes they check
MAX_PIECE = 1 << 30


def count(size: int, piece_bytes: int) -> int:
    return (size + piece_bytes - 1) // piece_bytes


def entry_fields(size: int, pieces: list[str], piece_bytes: int) -> dict[str, Any]:
    """What a file's manifest entry carries about its pieces: nothing for a file of one piece
    (its sha256 is that piece's hash already)."""
    return {"piece_bytes": piece_bytes, "pieces": pieces} if size > piece_bytes else {}


def check_entry(f: dict[str, Any], hex_re: Any) -> str | None:
    """What is wrong with a manifest entry's piece list, or None (an entry without one is fine)."""
    if "pieces" not in f and "piece_bytes" not in f:
        return None
    n, pieces = f.get("piece_bytes"), f.get("pieces")
    if not isinstance(n, int) or isinstance(n, bool) or not MIN_PIECE <= n <= MAX_PIECE:
        return f"piece_bytes must be an integer from {MIN_PIECE} to {MAX_PIECE}"
    if not isinstance(pieces, list) or len(pieces) != count(f["size"], n):
        return f"pieces must list {count(f['size'], n)} hashes for {f['size']} bytes in pieces of {n}"
    if not all(isinstance(p, str) and hex_re.match(p) for p in pieces):
        return "every piece hash must be 64 lowercase hex digits"
    return None


class Hasher:
    """The sha256 of each piece of a stream, fed in chunks of any size."""

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        self.piece_bytes = piece_bytes
        self.pieces: list[str] = []
        self._h = hashlib.sha256()
        self._left = piece_bytes

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            take = min(self._left, len(view))
            self._h.update(view[:take])
            self._left -= take
            view = view[take:]
            if self._left == 0:
                self.pieces.append(self._h.hexdigest())
                self._h, self._left = hashlib.sha256(), self.piece_bytes

    def finish(self) -> list[str]:
        if self._left != self.piece_bytes:
            self.pieces.append(self._h.hexdigest())
            self._h, self._left = hashlib.sha256(), self.piece_bytes
        return self.pieces


@dataclass(frozen=True, slots=True)
class BadPiece:
    index: int
    offset: int
    length: int
    expected: str
    actual: str


class BadPieceError(Exception):
    """A piece that does not hash to its manifest's entry; its bytes must be discarded."""

    def __init__(self, bad: BadPiece) -> None:
        super().__init__(f"piece {bad.index} (bytes {bad.offset}-{bad.offset + bad.length - 1}) hashes to "
                         f"sha256 {bad.actual}, not {bad.expected}")
        self.bad = bad


class Checker:
    """Checks a file's pieces as its bytes arrive from `start` (a piece boundary) on. `verified` is
    the length of the file's good prefix: bytes past it are never served or kept."""

    def __init__(self, pieces: list[str], piece_bytes: int, size: int, start: int = 0) -> None:
        assert start % piece_bytes == 0 or start == size, "a check starts on a piece boundary"
        self.pieces, self.piece_bytes, self.size = pieces, piece_bytes, size
        self.verified = start
        self._h = hashlib.sha256()
        self._at = start  # bytes fed so far, counted from the file's start

    def _end(self) -> int:
        return min(self.verified + self.piece_bytes, self.size)

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
                actual = self._h.hexdigest()
                self._h = hashlib.sha256()
                if actual != self.pieces[index]:
                    self._at = self.verified
                    raise BadPieceError(BadPiece(index, self.verified, self._end() - self.verified,
                                                 self.pieces[index], actual))
                self.verified = self._at
