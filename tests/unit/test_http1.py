"""The front's pure request parser: the same requests at every cut of the byte stream, parsing
no further ahead than the next request, and RFC 9112's Host rules."""

from __future__ import annotations

import pytest

from net.http1 import SLICE, Limits, Parser, Refused, Request, response_head

TWO = (b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
       b"GET /b?q=1 HTTP/1.1\r\nHost: x:80\r\nConnection: close\r\n\r\n")


def parse(pieces: list[bytes]) -> list[tuple[bytes, bytes, bytes, bool]]:
    parser = Parser(Limits())
    for piece in pieces:
        parser.feed(piece)
    return [(r.method, r.target, b"".join(r.body), r.keep_alive) for r in parser.ready]


def test_two_pipelined_requests_parse_the_same_at_every_cut() -> None:
    whole = parse([TWO])
    assert whole == [(b"POST", b"/a", b"hello", True), (b"GET", b"/b?q=1", b"", False)]
    for cut in range(1, len(TWO)):
        assert parse([TWO[:cut], TWO[cut:]]) == whole, cut


def test_feed_some_parses_only_as_far_as_the_next_request() -> None:
    small = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    pending = bytearray(small * 1000)
    parser = Parser(Limits())
    parser.feed_some(pending)
    assert 1 <= len(parser.ready) <= SLICE // len(small) + 1
    assert len(pending) >= len(small) * 1000 - SLICE  # the rest is left as bytes, unparsed
    taken = 0
    while pending or parser.ready:
        taken += len(parser.ready)
        parser.ready.clear()
        parser.feed_some(pending)
    assert taken == 1000


@pytest.mark.parametrize("head, ok", [
    (b"GET / HTTP/1.1\r\nHost: fleet.example\r\n\r\n", True),
    (b"GET / HTTP/1.1\r\nHost: 10.0.0.1:8080\r\n\r\n", True),
    (b"GET / HTTP/1.1\r\nHost: [fe80::1]:443\r\n\r\n", True),
    (b"GET / HTTP/1.0\r\n\r\n", True),
    (b"GET / HTTP/1.1\r\n\r\n", False),
    (b"GET / HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n", False),
    (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", False),
    (b"GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", False),
    (b"GET / HTTP/1.1\r\nHost: user@a\r\n\r\n", False),
], ids=["name", "ipv4-port", "ipv6", "http10-none", "none", "two", "space", "slash", "userinfo"])
def test_host_rules(head: bytes, ok: bool) -> None:
    parser = Parser(Limits())
    if ok:
        parser.feed(head)
        assert len(parser.ready) == 1
    else:
        with pytest.raises(Refused) as caught:
            parser.feed(head)
        assert caught.value.status == 400 and caught.value.code == "invalid_host"


def test_response_framing() -> None:
    head, chunked, keep_alive, no_body = response_head(200, [(b"content-type", b"text/event-stream"),
                                                             (b"Transfer-Encoding", b"gzip")], "1.1",
                                                       keep_alive=True, no_body=False)
    assert chunked and keep_alive and not no_body
    assert head == b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    head, chunked, keep_alive, _ = response_head(200, [], "1.0", keep_alive=True, no_body=False)
    assert not chunked and not keep_alive and head.endswith(b"connection: close\r\n\r\n")
    with pytest.raises(ValueError):
        response_head(200, [(b"x", b"a\r\nInjected: yes")], "1.1", keep_alive=True, no_body=False)


def refuse_unkeyed(r: Request) -> None:
    if (b"authorization", b"Bearer k") not in r.headers:
        raise Refused(401, "no key", "invalid_api_key")


def test_admit_refuses_from_the_head_before_any_body_is_parsed() -> None:
    parser = Parser(Limits(), refuse_unkeyed)
    with pytest.raises(Refused) as caught:
        parser.feed(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n" + b"x" * 1000)
    assert caught.value.status == 401 and parser.current is not None and parser.current.body == []


def test_a_refusal_behind_pipelined_requests_waits_until_they_are_taken() -> None:
    keyed = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\r\n"
    parser = Parser(Limits(), refuse_unkeyed)
    parser.feed(keyed + keyed + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + keyed)
    assert len(parser.ready) == 2 and parser.refused is not None and parser.refused.status == 401
    with pytest.raises(Refused):  # nothing after the refusal is parsed
        parser.feed(keyed)
    assert len(parser.ready) == 2


@pytest.mark.parametrize("limit, length, refused", [(4 << 20, 4 << 20, False), (4 << 20, (4 << 20) + 1, True)])
def test_the_body_limit_is_checked_from_content_length(limit: int, length: int, refused: bool) -> None:
    parser = Parser(Limits(max_body=limit))
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length
    if refused:
        with pytest.raises(Refused) as caught:
            parser.feed(head)
        assert caught.value.status == 413 and caught.value.code == "body_too_large"
    else:
        parser.feed(head)
        assert parser.current is not None and parser.current.head_done
    assert Limits().max_body == 4 << 20
