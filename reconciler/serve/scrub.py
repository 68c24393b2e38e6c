"""Replace filesystem paths in a byte stream, chunk by chunk, including paths cut across chunks.

Only what can be decided is emitted: a match is accepted when every pattern that could start at
its position fits in the bytes seen so far (so a path is never replaced by a shorter prefix of it,
such as the home directory of a store path); the undecided tail waits for the next chunk."""

from __future__ import annotations

import re
from functools import lru_cache


@lru_cache(maxsize=1024)
def _compile(paths: frozenset[str]) -> tuple[re.Pattern[bytes] | None, int]:
    pats = sorted({p.encode() for p in paths if p}, key=len, reverse=True)  # longest first wins
    return (re.compile(b"|".join(re.escape(p) for p in pats)) if pats else None,
            max((len(p) for p in pats), default=0))


class Scrubber:
    def __init__(self, paths: list[str], replacement: str) -> None:
        self.regex, self.maxlen = _compile(frozenset(paths))  # one compile per node's set of paths
        self.repl = replacement.encode()
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        if self.regex is None:
            return chunk
        buf = self.pending + chunk
        limit = len(buf) - self.maxlen + 1  # a match starting before here is fully decidable
        out, pos = [], 0
        for m in self.regex.finditer(buf):
            if m.start() >= limit:
                break
            out += [buf[pos:m.start()], self.repl]
            pos = m.end()
        cut = max(pos, limit)
        out.append(buf[pos:cut])
        self.pending = buf[cut:]
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return self.regex.sub(self.repl, rest) if self.regex is not None else rest
