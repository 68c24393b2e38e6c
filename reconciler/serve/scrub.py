"""Replace filesystem paths in a byte stream, chunk by chunk, including paths cut across chunks.

Only what can be decided is emitted. The bytes held back are the shortest tail that could still
grow into a path (a suffix of the chunk that is a proper prefix of some path), so an event that
ends in no such tail leaves whole at once: a streamed token is never kept waiting for the next.
A match is accepted only when no longer path could start at its position with the bytes still
to come (so a path is never replaced by a shorter prefix of it, such as the home directory of a
store path)."""

from __future__ import annotations

import re
from functools import lru_cache

# The shortest path replaced: an absolute path of at least two components and MIN_PATH characters.
# What is scrubbed is a node's home and its store's files, replaced wherever they occur in an answer;
# a shorter one is a word of prose, not a secret: "." (a relative --home) replaced every full stop,
# "/srv" or "/tmp" would garble any answer about Linux, and "/a/b" or "/1/24" occur in fractions and
# dates. What a short home hides is one directory name; every store path under it is longer and is
# still replaced.
MIN_PATH = 8


def scrubbable(path: str) -> bool:
    """Whether `path` is one the scrubber replaces (absolute, two components, MIN_PATH characters)."""
    return (path.startswith("/") and len(path) >= MIN_PATH
            and len([part for part in path.split("/") if part]) >= 2)


@lru_cache(maxsize=1024)
def _compile(paths: frozenset[str]) -> tuple[re.Pattern[bytes] | None, tuple[bytes, ...], bytes]:
    pats = tuple(sorted({p.encode() for p in paths if scrubbable(p)}, key=len, reverse=True))  # longest first wins
    regex = re.compile(b"|".join(re.escape(p) for p in pats)) if pats else None
    return regex, pats, bytes(sorted({p[0] for p in pats}))


def _positions(buf: bytes, byte: int, start: int) -> list[int]:
    found, p = [], buf.find(byte, start)
    while p >= 0:
        found.append(p)
        p = buf.find(byte, p + 1)
    return found


class Scrubber:
    def __init__(self, paths: list[str], replacement: str) -> None:
        self.paths = paths
        self.regex, self.pats, self.firsts = _compile(frozenset(paths))  # compiled once per set of paths
        self.maxlen = len(self.pats[0]) if self.pats else 0
        self.repl = replacement.encode()
        self.pending = b""

    def _hold(self, buf: bytes) -> int:
        """Where the undecidable tail of `buf` starts (len(buf) when nothing needs holding)."""
        n = len(buf)
        start = max(0, n - self.maxlen + 1)  # a tail longer than every path is decidable
        candidates = sorted(p for first in self.firsts for p in _positions(buf, first, start))
        for p in candidates:
            tail = buf[p:]
            if any(len(pat) > len(tail) and pat.startswith(tail) for pat in self.pats):
                return p
        return n

    def feed(self, chunk: bytes) -> bytes:
        if self.regex is None:
            return chunk
        buf = self.pending + chunk
        hold = self._hold(buf)
        out, pos = [], 0
        for m in self.regex.finditer(buf):
            if m.start() >= hold:
                break
            out += [buf[pos:m.start()], self.repl]
            pos = m.end()
        cut = max(pos, hold)
        out.append(buf[pos:cut])
        self.pending = buf[cut:]
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return self.regex.sub(self.repl, rest) if self.regex is not None else rest


# An absolute path: a slash that starts no URL or fraction, then one or more path segments.
_ANY_PATH = re.compile(rb"(?<![\w.:/~-])/(?:[\w.@+~-]+/)*[\w.@+~-]+/?")


def scrub_reason(text: str, paths: list[str], replacement: str) -> str:
    """A failure's full reason as a client may see it: the node's known paths (its store, its home)
    replaced as in relayed answers, then every other absolute path (an engine's install directory
    in a traceback, the Python that ran it) replaced by "<path>"; the words around them are kept."""
    scrub = Scrubber(paths, replacement)
    known = scrub.feed(text.encode()) + scrub.flush()
    return _ANY_PATH.sub(b"<path>", known).decode(errors="replace")
