"""The shared response-head reader (wire/http.py), fed every cut of real heads: the answer never
depends on how the bytes arrived."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.http import MAX_HEAD, HeadTooLarge, MalformedHead, ResponseHead, split_head

HEAD = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 5\r\nX-Odd:  spaced value \r\nContent-Range: bytes 0-4/9\r\n\r\n"
BODY = b"hello"


def feed(pieces: list[bytes], limit: int = MAX_HEAD) -> tuple[ResponseHead, bytes] | None:
    """What a reader loop gets: split_head after each piece, stopping at the first answer."""
    buf = b""
    for piece in pieces:
        buf += piece
        if (got := split_head(buf, limit)) is not None:
            return got
    return None


@pytest.mark.parametrize("cut", range(len(HEAD + BODY) + 1))
def test_a_head_split_anywhere_reads_the_same(cut: int) -> None:
    data = HEAD + BODY
    got = feed([data[:cut], data[cut:]])
    assert got is not None
    head, rest = got
    assert head.status == 206
    assert head.headers == {"content-length": "5", "x-odd": "spaced value", "content-range": "bytes 0-4/9"}
    assert head.content_length() == 5 and not head.chunked
    # The body bytes that came with the head are handed back, no more; a loop reads the rest.
    assert rest == (data[len(HEAD):cut] if cut >= len(HEAD) else BODY)


def test_an_incomplete_head_asks_for_more() -> None:
    for n in range(len(HEAD)):
        assert split_head(HEAD[:n]) is None


@given(st.lists(st.integers(min_value=1, max_value=40), max_size=20), st.integers(min_value=0, max_value=200))
def test_the_limit_holds_at_every_cut(sizes: list[int], extra: int) -> None:
    """A head of L bytes is refused exactly when L > limit, however it is cut."""
    limit = 64
    head = b"HTTP/1.1 200 OK\r\nX: " + b"a" * extra
    data = head + b"\r\n\r\n"
    pieces, at = [], 0
    for n in sizes:
        pieces.append(data[at:at + n])
        at += n
    pieces.append(data[at:])
    if len(head) > limit:
        with pytest.raises(HeadTooLarge):
            feed(pieces, limit)
    else:
        got = feed(pieces, limit)
        assert got is not None and got[0].headers["x"] == "a" * extra


def test_a_head_that_never_ends_is_refused_once_past_the_limit() -> None:
    assert split_head(b"HTTP/1.1 200 OK\r\n" + b"x" * (MAX_HEAD - 17)) is None
    with pytest.raises(HeadTooLarge):
        split_head(b"HTTP/1.1 200 OK\r\n" + b"x" * (MAX_HEAD + 10))


@pytest.mark.parametrize("head", [b"HTTX/1.1 twohundred", b"", b"HTTP/1.1", b"garbage\r\nContent-Length: 3"])
def test_a_bad_status_line_is_malformed(head: bytes) -> None:
    with pytest.raises(MalformedHead, match="malformed HTTP status line"):
        split_head(head + b"\r\n\r\n")


@pytest.mark.parametrize("value, length", [("0", 0), ("12", 12), (None, None)])
def test_content_length(value: str | None, length: int | None) -> None:
    assert ResponseHead(200, {} if value is None else {"content-length": value}).content_length() == length


@pytest.mark.parametrize("value", ["12x", "-1", "+5", "1_0", " ", "", "\u00b2", "0x10"])
def test_a_content_length_that_is_not_plain_digits_is_malformed(value: str) -> None:
    with pytest.raises(MalformedHead, match="malformed Content-Length"):
        ResponseHead(200, {"content-length": value}).content_length()


def test_chunked_is_read_from_transfer_encoding_in_any_case() -> None:
    assert ResponseHead(200, {"transfer-encoding": "gzip, Chunked"}).chunked
    assert not ResponseHead(200, {}).chunked
