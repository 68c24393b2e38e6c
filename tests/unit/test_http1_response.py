"""net/http1.py's ResponseReader (llhttp): a response head fed at every cut of real bytes reads the
same, its bound holds however it is cut, and what llhttp refuses is a HeadError that says what."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from net.http1 import (MAX_HEAD, MAX_INTERIM, HeadTooLarge, MalformedHead, ResponseReader, content_length,
                       is_chunked)

HEAD = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 5\r\nX-Odd:  spaced value \r\nContent-Range: bytes 0-4/9\r\n\r\n"
BODY = b"hello"


class Reader(ResponseReader):
    """A ResponseReader that keeps the body and counts its hooks."""

    def __init__(self, max_head: int = MAX_HEAD) -> None:
        super().__init__(max_head)
        self.body, self.heads, self.ends = b"", 0, 0

    def head_done(self) -> None:
        self.heads += 1

    def take_body(self, body: bytes) -> None:
        self.body += body

    def body_done(self) -> None:
        self.ends += 1


def fed(pieces: list[bytes], max_head: int = MAX_HEAD) -> Reader:
    reader = Reader(max_head)
    for piece in pieces:
        reader.feed(piece)
    return reader


@pytest.mark.parametrize("cut", range(len(HEAD + BODY) + 1))
def test_a_head_split_anywhere_reads_the_same(cut: int) -> None:
    data = HEAD + BODY
    reader = fed([data[:cut], data[cut:]])
    assert reader.head_whole and reader.status == 206 and reader.heads == 1
    assert reader.headers == {"content-length": "5", "x-odd": "spaced value", "content-range": "bytes 0-4/9"}
    assert content_length(reader.headers) == 5 and not is_chunked(reader.headers)
    assert reader.body == BODY and reader.ends == 1  # the same pass of llhttp framed the body


def test_an_incomplete_head_asks_for_more() -> None:
    for n in range(len(HEAD)):
        reader = fed([HEAD[:n]])
        assert not reader.head_whole and reader.heads == 0


@given(st.lists(st.integers(min_value=1, max_value=40), max_size=20), st.integers(min_value=0, max_value=200))
def test_the_limit_holds_at_every_cut(sizes: list[int], extra: int) -> None:
    """A head of L bytes (without the blank line that ends it) is refused exactly when L > limit,
    however it is cut."""
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
            fed(pieces, limit)
    else:
        reader = fed(pieces, limit)
        assert reader.head_whole and reader.headers["x"] == "a" * extra


def test_a_head_that_never_ends_is_refused_once_past_the_limit() -> None:
    start = b"HTTP/1.1 200 OK\r\nX: "
    assert not fed([start + b"x" * (MAX_HEAD - len(start))]).head_whole
    with pytest.raises(HeadTooLarge):
        fed([start + b"x" * (MAX_HEAD + 10)])
    reader = fed([start])
    with pytest.raises(HeadTooLarge):  # then a byte a read
        for _ in range(MAX_HEAD):
            reader.feed(b"x")


@pytest.mark.parametrize("head", [b"HTTX/1.1 twohundred", b"HTTP/1.1", b"HTTP/1.1 20 OK", b"HTTP/1.1 2000 OK",
                                  b"HTTP/1.1 099 Low", b"garbage\r\nContent-Length: 3"])
def test_a_bad_status_line_is_malformed(head: bytes) -> None:
    with pytest.raises(MalformedHead, match="malformed HTTP status line"):
        fed([head + b"\r\n\r\n"])


@pytest.mark.parametrize("value", ["12x", "-1", "+5", "1_0", " ", "", "\u00b2", "0x10", "5\r\nContent-Length: 6"])
def test_a_content_length_that_is_not_plain_digits_is_malformed(value: str) -> None:
    with pytest.raises(MalformedHead, match="malformed Content-Length"):
        fed([f"HTTP/1.1 200 OK\r\nContent-Length: {value}\r\n\r\n".encode()])


@pytest.mark.parametrize("head, says", [
    (b"HTTP/1.1 200 OK\r\nbad line", "malformed response head .*Invalid header token"),
    (b"HTTP/1.1 200 OK\r\nX: a\r\n folded", "malformed response head"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3", "Content-Length can't be present with"),
])
def test_a_head_llhttp_refuses_is_malformed(head: bytes, says: str) -> None:
    with pytest.raises(MalformedHead, match=says):
        fed([head + b"\r\n\r\n"])


def test_interim_answers_are_passed_over_up_to_a_bound() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    reader = fed([interim * (MAX_INTERIM // 2), answer])
    assert reader.status == 200 and reader.headers == {"content-length": "2"} and reader.body == b"ok"
    assert reader.interim == MAX_INTERIM and reader.heads == reader.ends == 1
    with pytest.raises(MalformedHead, match="interim answers and no answer"):
        fed([interim * (MAX_INTERIM // 2) + b"HTTP/1.1 100 Continue\r\n\r\n" + answer])


def test_a_switch_of_protocols_is_malformed() -> None:
    with pytest.raises(MalformedHead, match="switched protocols \\(101\\)"):
        fed([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n"])


def test_chunked_is_read_from_transfer_encoding_in_any_case() -> None:
    assert is_chunked({"transfer-encoding": "gzip, Chunked"})
    assert not is_chunked({})


def test_a_header_without_a_colon_after_a_status_line_without_a_reason_is_the_head_s_fault() -> None:
    with pytest.raises(MalformedHead, match="malformed response head .*Invalid header token"):
        fed([b"HTTP/1.1 200\r\nno colon\r\n\r\n"])


def test_nothing_after_the_answer_is_read_as_part_of_it() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    for after in (b"HTTP/1.1 401 Unauthorized\r\nx-evil: 1\r\ncontent-length: 4\r\n\r\nEVIL",
                  b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n", b"HTTP/1.1 100 Continue\r\n\r\n" * 9,
                  b"garbage"):
        for cut in (len(answer), len(answer) + 3):
            reader = fed([(answer + after)[:cut], (answer + after)[cut:]])
            assert (reader.status, reader.headers, reader.body, reader.ends) == (200, {"content-length": "2"}, b"ok", 1)
            assert reader.answered and reader.after


def test_trailers_are_not_headers_and_are_bounded_with_the_chunk_framing() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    reader = fed([head, b"2\r\nok\r\n0\r\nx-trailer: 1\r\ncontent-type: text/evil\r\n\r\n"])
    assert reader.headers == {"transfer-encoding": "chunked"} and reader.body == b"ok" and reader.answered
    reader = fed([head, b"2\r\nok\r\n0\r\n"])
    with pytest.raises(HeadTooLarge, match="chunk framing or trailers"):
        for _ in range(MAX_HEAD // 1000 + 1):
            reader.feed(b"t: " + b"v" * 995 + b"\r\n")
