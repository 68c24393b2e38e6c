"""HTTP/1.1 response heads, byte-level and pure: where a head ends, its status and headers.

Two clients read response heads off raw sockets (net/client.py, the one client: the router's relay
to workers, the agents' bulk fetch, health checks; and the control plane's agent client,
reconciler/agents/transport.py and batch.py); each owns its socket and its errors, and both decide
"is the head complete, is it too large, what does it say" here, the same way at any cut of the
byte stream (tests/unit/test_wire_http.py feeds every split)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_HEAD = 64 * 1024
_END = b"\r\n\r\n"


class HeadError(ValueError):
    """A response head that cannot be used; the subclass says why."""


class HeadTooLarge(HeadError):
    """More than the limit arrived without the blank line that ends a head."""


class MalformedHead(HeadError):
    """The status line or a framing header (Content-Length) does not parse."""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """Status and headers of one response; header names lower-cased, values stripped."""

    status: int
    headers: dict[str, str]

    @classmethod
    def parse(cls, head: bytes) -> ResponseHead:
        """The head's bytes without the final blank line; MalformedHead if the status line is bad."""
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            raise MalformedHead(f"malformed HTTP status line {head[:80]!r}") from None
        return cls(status, {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])})

    @property
    def chunked(self) -> bool:
        return is_chunked(self.headers)

    def content_length(self) -> int | None:
        return content_length(self.headers)


def is_chunked(headers: dict[str, str]) -> bool:
    """Whether the body comes in chunked framing (lower-cased header names, as ResponseHead has them)."""
    return "chunked" in headers.get("transfer-encoding", "").lower()


def content_length(headers: dict[str, str]) -> int | None:
    """The declared body length; None when absent; MalformedHead unless plain ASCII digits."""
    text = headers.get("content-length")
    if text is None:
        return None
    # isdigit alone admits "²" and other Unicode digits that int() then refuses.
    if not (text.isascii() and text.isdigit()):
        raise MalformedHead(f"malformed Content-Length {text[:20]!r}")
    return int(text)


def split_head(buf: bytes, limit: int = MAX_HEAD) -> tuple[ResponseHead, bytes] | None:
    """(head, the body bytes that came with it) once `buf` holds a whole head; None while more is
    needed. HeadTooLarge once the head is known to exceed `limit` bytes, whatever the cuts were;
    MalformedHead for a bad status line."""
    end = buf.find(_END)
    if end < 0:
        # The end marker may straddle the limit: only bytes past limit+3 prove the head too large.
        if len(buf) > limit + len(_END) - 1:
            raise HeadTooLarge(f"response head over {limit} bytes")
        return None
    if end > limit:
        raise HeadTooLarge(f"response head over {limit} bytes")
    return ResponseHead.parse(buf[:end]), buf[end + len(_END):]
