"""fleet's one HTTP/1.1 codec, parsed by httptools (llhttp) both ways. The server's part
(net/server.py): requests gathered into whole requests, the limits one client is held to, and the
bytes of every refusal. The clients' part (net/client.py, and the control plane's agent calls,
reconciler/agents/transport.py and batch.py): a response's head, bounded, read as it arrives and
handed on with the body's framing to llhttp's same pass. No sockets, no trio."""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Callable

import httptools

REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
STATUS_LINES = {status: b"HTTP/1.1 %d %s\r\n" % (status, reason) for status, reason in REASONS.items()}
# The stable code in the JSON error of each refusal (clients and alerts match on it, not the
# text) where the refusal does not name a more precise one.
CODES = {400: "bad_request", 408: "request_timeout", 413: "body_too_large", 431: "head_too_large",
         500: "internal_error", 503: "unavailable"}
# RFC 9112 3.2 / RFC 3986 3.2.2: a Host is a reg-name, IPv4 or [IP-literal], and an optional port.
HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.vV]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(?::[0-9]*)?")
# Bytes handed to the parser at a time when more than that was read at once: a read holding many
# small pipelined requests is parsed only as far as the next request, so no more than a slice's
# worth of requests is ever parsed ahead.
SLICE = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Bounds on what one client may make the front hold or wait for."""

    max_head: int = 64 * 1024          # request line + headers (431 beyond)
    # A request body larger than this is refused with 413, from its Content-Length before a byte
    # of it is read, or as soon as a chunked one grows past it. 4 MiB: a chat request for a
    # 128k-token context is about 0.5 MiB of English (under 1 MiB as JSON's \u escapes of CJK), and
    # every byte of a body is held, and copied, until the worker has it (at 32 MiB, 40 clients
    # with a key took fleet serve past 3 GB). FLEET_MAX_REQUEST_BODY sets it (serve/run.py).
    max_body: int = 4 * 1024 * 1024
    keep_alive: float = 60.0           # an idle connection is closed after this long
    # ...or after this long, if it never proved its client (Server.trusts); None: keep_alive
    stranger_idle: float | None = None
    read_timeout: float = 30.0         # a head must be whole, and a body keep arriving, within this (408)
    write_timeout: float = 60.0        # a client that takes no bytes for this long is dropped
    grace: float = 10.0                # on shutdown, requests in flight get this long to finish
    # While a response is in flight the client's socket is read only to notice it going away:
    # at most this many bytes of what it sends next are kept (unparsed); beyond that it is not
    # read until the response ends, and TCP makes the client wait.
    read_ahead: int = 16 * 1024
    max_connections: int | None = None  # None: derived from RLIMIT_NOFILE (reconciler/serve/front.py connection_cap)


class Refused(Exception):
    """The request cannot be served: answer `status` with `message` (and `code`), then close."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code or CODES.get(status, "bad_request" if status < 500 else "internal_error")


def error_response(status: int, message: str, code: str, extra: bytes = b"") -> bytes:
    """A whole response: the OpenAI-shaped JSON error, `connection: close` (the caller closes)."""
    body = json.dumps({"error": {"message": message, "type": "fleet_error", "code": code}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n%s"
            % (status, REASONS.get(status, b""), len(body), extra, body))


def response_head(status: int, headers: list[tuple[bytes, bytes]], version: str, *, keep_alive: bool,
                  no_body: bool) -> tuple[bytes, bool, bool, bool]:
    """The head for an app's status and headers: (head, chunked, keep_alive, no_body). Framing and
    persistence are this server's to decide, so the app's Transfer-Encoding and Connection go; an
    app's `connection: close` is kept (its connection ends with the answer)."""
    lines = [STATUS_LINES.get(status) or b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b""))]
    has_length = chunked = False
    for name, value in headers:
        lower = name.lower()
        if lower == b"transfer-encoding" or lower == b"connection":
            if b"\r" in value or b"\n" in value:
                raise ValueError(f"header {name!r} holds a line break")
            keep_alive = keep_alive and not (lower == b"connection" and value.strip().lower() == b"close")
            continue
        has_length = has_length or lower == b"content-length"
        lines.append(b"%s: %s\r\n" % (name, value))
    no_body = no_body or status in (204, 304) or status < 200
    if not (no_body or has_length):
        # A body of unknown length: chunked for HTTP/1.1, ended by closing for HTTP/1.0.
        if version == "1.1":
            chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        else:
            keep_alive = False
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    elif version == "1.0":
        lines.append(b"connection: keep-alive\r\n")
    lines.append(b"\r\n")
    head = b"".join(lines)
    # Each line holds one CR and one LF, at its end: a header holding a line break is found by
    # counting them in the whole head (one pass in C instead of four searches a header).
    if head.count(b"\n") != len(lines) or head.count(b"\r") != len(lines):
        name = next(n for n, v in headers if b"\r" in n or b"\n" in n or b"\r" in v or b"\n" in v)
        raise ValueError(f"header {name!r} holds a line break")
    return head, chunked, keep_alive, no_body


@dataclass(slots=True)
class Request:
    method: bytes = b""
    target: bytes = b""
    version: str = "1.1"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    keep_alive: bool = True
    head_done: bool = False
    size: int = 0
    continued: bool = False  # a "100 Continue" was sent, or not needed
    judged: bool = False  # the server asked whether its head proves its client (Server.trusts)


Admit = Callable[["Request"], None]  # a request's head → nothing, or Refused before its body is read


class Parser:
    """httptools callbacks gathered into whole requests, in arrival order (pipelining). `admit`
    sees each head as soon as it is whole (the router's API key check): what it refuses is
    answered before a byte of the body is read."""

    def __init__(self, limits: Limits, admit: Admit | None = None) -> None:
        self.limits = limits
        self.admit = admit
        self.parser = httptools.HttpRequestParser(self)
        self.ready: deque[Request] = deque()
        self.current: Request | None = None
        self.head_bytes = 0
        # A refusal met while earlier requests of the same read wait in `ready`: raised once they
        # are answered (pipelining), and nothing more is parsed meanwhile.
        self.refused: Refused | None = None

    def feed(self, data: bytes) -> None:
        if self.refused is not None:
            raise self.refused
        try:
            self._feed(data)
        except Refused as exc:
            if not self.ready:
                raise
            self.refused = exc

    def _feed(self, data: bytes) -> None:
        if self.current is None or not self.current.head_done:
            self.head_bytes += len(data)  # an upper bound until the head is complete
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self.ready and any(k == b"upgrade" for k, _ in self.ready[-1].headers):
                self.ready.pop()  # the request that asks for the upgrade is not answered either
            raise Refused(400, "protocol upgrades are not served here") from None
        except httptools.HttpParserCallbackError as exc:
            why = exc.__cause__ or exc.__context__  # what our callback raised
            if isinstance(why, Refused):
                raise why from None
            raise
        except httptools.HttpParserError as exc:
            raise Refused(400, f"malformed HTTP request: {exc}") from None
        if (self.current is None or not self.current.head_done) and self.head_bytes > self.limits.max_head:
            raise Refused(431, f"the request head is over {self.limits.max_head} bytes")

    def release(self) -> None:
        """Drop the httptools parser, which refers back to this one: a cycle that only the garbage
        collector would free otherwise, one a connection (the server calls this as it closes one)."""
        del self.parser

    def feed_some(self, pending: bytearray) -> None:
        """Parse from the front of `pending` until a request is ready or `pending` is spent;
        what is left stays there, unparsed."""
        while pending and not self.ready:
            piece = bytes(pending[:SLICE])
            del pending[:SLICE]
            self.feed(piece)

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.current = Request()

    def on_url(self, url: bytes) -> None:
        assert self.current is not None
        self.current.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        r = self.current
        assert r is not None
        r.head_done, self.head_bytes = True, 0
        # One pass over the headers for the head's size and the few the server reads itself.
        size, hosts, length, expects = len(r.target), [], None, False
        for k, v in r.headers:
            size += len(k) + len(v) + 4
            if k == b"host":
                hosts.append(v)
            elif k == b"content-length":
                length = v if length is None else length
            elif k == b"expect":
                expects = expects or v.lower() == b"100-continue"
        if size > self.limits.max_head:
            raise Refused(431, f"the request head is over {self.limits.max_head} bytes")
        r.method, r.version, r.keep_alive = self.parser.get_method(), self.parser.get_http_version(), \
            self.parser.should_keep_alive()
        check_host(r, hosts)
        if self.admit is not None:
            self.admit(r)
        if length is not None and length.isdigit() and int(length) > self.limits.max_body:
            raise Refused(413, f"the request body is over {self.limits.max_body} bytes")
        r.continued = not expects

    def on_body(self, body: bytes) -> None:
        r = self.current
        assert r is not None
        r.size += len(body)
        if r.size > self.limits.max_body:
            raise Refused(413, f"the request body is over {self.limits.max_body} bytes")
        r.body.append(body)

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.ready.append(self.current)
        self.current = None


def check_host(r: Request, hosts: list[bytes] | None = None) -> None:
    """RFC 9112 3.2: 400 for an HTTP/1.1 request without Host, for any request with more than
    one, and for a Host that is not a host[:port]. (Two Hosts is how a request is made to mean
    one thing to a proxy in front and another here.)"""
    if hosts is None:
        hosts = [v for k, v in r.headers if k == b"host"]
    if len(hosts) > 1:
        raise Refused(400, f"the request has {len(hosts)} Host headers (RFC 9112 3.2 allows one)", "invalid_host")
    if not hosts and r.version == "1.1":
        raise Refused(400, "an HTTP/1.1 request must have a Host header (RFC 9112 3.2)", "invalid_host")
    if hosts and not HOST.fullmatch(hosts[0].strip()):
        raise Refused(400, f"the Host header {hosts[0][:100].decode('latin-1')!r} is not a host[:port]", "invalid_host")


# -- responses: the clients' part ------------------------------------------------------------------

MAX_HEAD = 64 * 1024  # a response head (status line and headers) larger than this is refused
MAX_INTERIM = 8  # interim answers (100 Continue, 103 Early Hints) passed over before an answer


class HeadError(ValueError):
    """A response head that cannot be used; the subclass says why."""


class HeadTooLarge(HeadError):
    """More than the limit arrived without the blank line that ends a head."""


class MalformedHead(HeadError):
    """llhttp refused the head (its status line, a header, the framing headers), or it switched
    protocols, or it was one interim answer too many. The message says which, article first."""


class _Another(Exception):
    """llhttp began a message after the answer's end (ResponseReader.on_message_begin)."""


class ResponseReader:
    """One answer read as its bytes arrive (`feed`), through llhttp: once its head is whole,
    `head_whole`, `status` and `headers` (names lower-cased; filled as they come, to be read once
    the head is whole), and the head_done hook; interim 1xx answers are passed over (at most
    MAX_INTERIM). The body goes to the subclass's take_body and body_done, called by the same pass
    of llhttp that read the head, so the head is parsed once and the body framed as llhttp frames
    it. Once the answer has ended, nothing more is parsed: bytes after it set `after` (the
    connection is not clean), and never become another answer's status or headers. Chunk framing
    and trailers are bounded as a head is (max_head bytes without a byte of body); trailers are
    not kept. Before the head is whole, every failure is
    a HeadError: HeadTooLarge past `max_head` bytes (counted as the server's Parser counts a
    request's), MalformedHead where llhttp refuses the bytes; after it, llhttp's own errors
    (httptools.HttpParserError) are the caller's to judge."""

    def __init__(self, max_head: int = MAX_HEAD) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.max_head = max_head
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_whole = False
        self.interim = 0
        self.answered = False  # the answer's body ended by its framing
        self.after = False  # bytes came after the answer's end
        self._size = 13  # the head's size as its parts come: "HTTP/1.1 200 ", the reason, each header
        self._head_bytes = 0  # an upper bound on the head's size until it is whole
        self._framing = 0  # bytes of the body's reads in a row that brought no byte of body
        self._body_came = False

    def feed(self, data: bytes) -> None:
        if self.after:
            return
        whole = self.head_whole
        if not whole:
            self._head_bytes += len(data)
        self._body_came = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            why = exc.__cause__ or exc.__context__  # what a callback raised
            if isinstance(why, _Another):
                self.after = True
                return
            if isinstance(why, HeadError):
                raise why from None
            raise
        except httptools.HttpParserUpgrade:
            raise MalformedHead(f"an answer that switched protocols ({self.status}), which fleet does not speak") from None
        except httptools.HttpParserError as exc:
            if self.answered:  # what came after the answer is no answer
                self.after = True
                return
            if self.head_whole:
                raise  # the body's framing: the caller's to judge
            raise MalformedHead(self._malformed(str(exc))) from None
        if not self.head_whole:
            if self._head_bytes > self.max_head + 4:  # the blank line that ends it is not counted
                raise HeadTooLarge(f"response head over {self.max_head} bytes")
        elif whole and not self.answered:  # a read of the body
            self._framing = 0 if self._body_came else self._framing + len(data)
            if self._framing > self.max_head:
                raise HeadTooLarge(f"chunk framing or trailers over {self.max_head} bytes without a byte of body")

    @staticmethod
    def _malformed(why: str) -> str:
        if "Content-Length" in why:
            return f"a malformed Content-Length (llhttp: {why})"
        if any(word in why for word in ("HTTP/", "version", "status", "response line")):
            return f"a malformed HTTP status line (llhttp: {why})"
        return f"a malformed response head (llhttp: {why})"

    def head_done(self) -> None:
        """Called once the answer's head is whole (status and headers set), before its body."""

    # httptools callbacks

    def on_status(self, reason: bytes) -> None:
        self._size += len(reason)

    def on_message_begin(self) -> None:
        if self.answered:
            raise _Another  # ends llhttp's pass: feed sets `after`

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_whole:
            return  # a trailer: bounded with the chunk framing, not kept
        self._size += len(name) + len(value) + 4
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if self._size > self.max_head:
            raise HeadTooLarge(f"response head over {self.max_head} bytes")
        if status < 100:
            raise MalformedHead(f"a malformed HTTP status line (status {status})")
        if status < 200 and status != 101:  # an interim answer: the answer follows on the same bytes
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise MalformedHead(f"{self.interim} interim answers and no answer")
            self.headers, self._size, self._head_bytes = {}, 13, 0
            return
        self.status, self.head_whole = status, True
        self.head_done()

    def on_body(self, body: bytes) -> None:
        self._body_came = True
        self.take_body(body)

    def take_body(self, body: bytes) -> None:
        """A piece of the answer's body, de-chunked."""

    def on_message_complete(self) -> None:
        if self.head_whole:  # not an interim answer's end
            self.answered = True
            self.body_done()

    def body_done(self) -> None:
        """Called when the answer's body has ended by its framing (not for one that ends with the connection)."""


def is_chunked(headers: dict[str, str]) -> bool:
    """Whether the body comes in chunked framing (lower-cased header names, as ResponseReader has them)."""
    return "chunked" in headers.get("transfer-encoding", "").lower()


def content_length(headers: dict[str, str]) -> int | None:
    """The declared body length (llhttp has refused any but plain digits); None when absent."""
    text = headers.get("content-length")
    return None if text is None else int(text)
