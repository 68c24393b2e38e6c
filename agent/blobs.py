"""Serving stored blobs to peers: single-range HTTP with large reads.

Starlette's FileResponse moves 64 KiB per ASGI message and tops out near 130 MB/s here (see
docs/ARCHITECTURE.md); 4 MiB messages cut the per-message cost of h11 and the ASGI hop to noise, which is
what lets replication run near the disk-and-hash limit on one port."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

CHUNK = 4 << 20
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)\Z")
# A position of more digits than this is past the end of any file. Python refuses int() of more
# than 4,300 digits (ValueError, a 500 with a traceback), so long ones are never converted.
_DIGITS = 19
_FAR = 1 << 64


def _position(digits: str) -> int:
    return int(digits) if len(digits) <= _DIGITS else _FAR


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(start, end inclusive), None for the whole file, or "unsatisfiable"."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None  # RFC 9110: an unparseable Range is ignored
    if not m.group(1):  # suffix: the last N bytes
        n = _position(m.group(2))
        return (max(0, size - n), size - 1) if n and size else "unsatisfiable"
    start = _position(m.group(1))
    end = min(_position(m.group(2)), size - 1) if m.group(2) else size - 1
    if start >= size or end < start:
        return "unsatisfiable"
    return start, end


class BlobResponse(Response):
    def __init__(self, path: Path, range_header: str | None) -> None:
        self.path = path
        self.range_header = range_header
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            rng = parse_range(self.range_header, size)
            if rng == "unsatisfiable":
                body = json.dumps({"error": {"code": "range_not_satisfiable", "message": (
                    f"the range asked ({(self.range_header or '')[:64]}) is outside the blob's {size} bytes")}}).encode()
                await send({"type": "http.response.start", "status": 416,
                            "headers": [(b"content-range", f"bytes */{size}".encode()),
                                        (b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            start, end = rng if isinstance(rng, tuple) else (0, size - 1)
            length = end - start + 1 if size else 0
            headers = [(b"content-type", b"application/octet-stream"), (b"accept-ranges", b"bytes"),
                       (b"content-length", str(length).encode())]
            if isinstance(rng, tuple):
                headers.append((b"content-range", f"bytes {start}-{end}/{size}".encode()))
            await send({"type": "http.response.start", "status": 206 if isinstance(rng, tuple) else 200,
                        "headers": headers})
            if scope["method"] == "HEAD" or length == 0:
                await send({"type": "http.response.body", "body": b""})
                return
            fh.seek(start)
            left = length
            while left:
                # A blocking read from the page cache takes about a millisecond per 4 MiB; a thread
                # hop per chunk would cost more than it saves.
                chunk = fh.read(min(CHUNK, left))
                if not chunk:
                    raise OSError(f"{self.path} shrank while being served")
                left -= len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
