"""A peer fetch holds its upstream to bounds (agent/transfer/peerhttp.py): a peer that takes the request and
says nothing, drips its head, stalls or drips its body (small bodies on the event loop, bulk ones in
a thread) is given up on within the fetch's patience, resumable; a body other than the bytes asked
for (longer, or another range) is refused before a byte of it is handed on. A hostile peer on
loopback, a thread per connection."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, Iterator

import pytest
import trio

from agent.transfer.peerhttp import BULK, PeerError, get
from wire.floor import FLOOR_BYTES

PATIENCE = 0.5


@pytest.fixture
def peer() -> Iterator[Callable[[Callable[[socket.socket, threading.Event], None]], str]]:
    """Start a peer that runs `behaviour(conn, done)` on each connection; `done` is set at the test's end."""
    done = threading.Event()
    listeners: list[socket.socket] = []

    def start(behaviour: Callable[[socket.socket, threading.Event], None]) -> str:
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(4)
        listeners.append(lst)

        def serve() -> None:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)  # the request
                try:
                    behaviour(conn, done)
                except OSError:
                    pass  # the fetch gave up and closed

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{lst.getsockname()[1]}"

    yield start
    done.set()
    for lst in listeners:
        lst.close()


def fetch(base: str, start: int | None = None, end: int | None = None) -> tuple[PeerError | int, int]:
    """(the PeerError, or the status; the bytes handed on), within a generous bound of its own."""
    handed = 0

    def take(chunk: bytes | bytearray | memoryview) -> None:
        nonlocal handed
        handed += len(chunk)

    async def main() -> PeerError | int:
        with trio.fail_after(30):
            try:
                return await get(base, "/v1/blobs/" + "ab" * 32, "s" * 16, take, start=start, end=end,
                                 patience=PATIENCE)
            except PeerError as exc:
                return exc

    return trio.run(main), handed


def silent(conn: socket.socket, done: threading.Event) -> None:
    done.wait(30)


def head_drip(conn: socket.socket, done: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not done.wait(0.05):
        conn.sendall(b"x-drip: 1\r\n")


def head(length: int) -> bytes:
    return f"HTTP/1.1 200 OK\r\ncontent-length: {length}\r\n\r\n".encode()


def small_body_stall(conn: socket.socket, done: threading.Event) -> None:
    conn.sendall(head(3 << 20) + os.urandom(100 << 10))
    done.wait(30)


def bulk_body_drip(conn: socket.socket, done: threading.Event) -> None:
    conn.sendall(head(BULK + (16 << 20)))
    conn.sendall(os.urandom(BULK + (2 << 20)))  # past the head's reads: the rest goes to the bulk thread
    while not done.wait(0.02):
        conn.sendall(b"x")  # a byte every 20 ms: never idle for `patience`, far under the floor


@pytest.mark.parametrize("behaviour, what", [
    (silent, "sent no whole answer head"),
    (head_drip, "sent no whole answer head"),
    (small_body_stall, f"sent under {FLOOR_BYTES >> 20} MiB"),
    (bulk_body_drip, f"sent under {FLOOR_BYTES >> 20} MiB"),
], ids=["silent", "head-drip", "small-body-stall", "bulk-body-drip"])
def test_a_peer_that_stalls_or_drips_is_given_up_on_within_the_patience(
        peer: Callable[..., str], behaviour: Callable[[socket.socket, threading.Event], None], what: str) -> None:
    base = peer(behaviour)
    began = time.monotonic()
    outcome, _ = fetch(base)
    took = time.monotonic() - began
    assert isinstance(outcome, PeerError), outcome
    assert outcome.code == "peer_too_slow" and outcome.resumable, outcome
    assert what in str(outcome) and base in str(outcome) and "/v1/blobs/" in str(outcome)
    if behaviour is small_body_stall:  # what came with the head counts in what it says arrived
        assert f"({100 << 10:,} of {3 << 20:,} bytes so far)" in str(outcome), outcome
    assert took < 10 * PATIENCE + 5  # bounded by the patience, not the 30 s the peer would hold on


def ranged(length: int, content_range: str) -> Callable[[socket.socket, threading.Event], None]:
    def behaviour(conn: socket.socket, done: threading.Event) -> None:
        conn.sendall(f"HTTP/1.1 206 Partial Content\r\ncontent-length: {length}\r\n"
                     f"content-range: {content_range}\r\n\r\n".encode() + os.urandom(length))
        done.wait(5)
    return behaviour


@pytest.mark.parametrize("length, content_range, start, end", [
    (1000, "bytes 0-999/1000", 0, 99),      # longer than asked: would be written before any digest
    (50, "bytes 100-149/1000", 100, 199),   # shorter than asked
    (100, "bytes 0-99/1000", 100, 199),     # another range (a resume answered from the start)
    (100, "bytes 100-199", 100, 199),       # no total: not a Content-Range
], ids=["longer", "shorter", "other-range", "malformed-range"])
def test_an_answer_other_than_the_bytes_asked_for_is_refused_before_any_is_handed_on(
        peer: Callable[..., str], length: int, content_range: str, start: int, end: int) -> None:
    outcome, handed = fetch(peer(ranged(length, content_range)), start, end)
    assert isinstance(outcome, PeerError) and outcome.code == "peer_bad_answer", outcome
    assert handed == 0 and f"{start:,}-{end:,}" in str(outcome)


def test_the_bytes_asked_for_are_taken(peer: Callable[..., str]) -> None:
    outcome, handed = fetch(peer(ranged(100, "bytes 100-199/1000")), 100, 199)
    assert (outcome, handed) == (206, 100)


def test_what_a_bulk_peer_sent_before_it_stalled_is_all_taken(peer: Callable[..., str]) -> None:
    """The bulk reader hands bytes on in blocks: those of a last, short block, there when the peer
    stalls, are still handed on and counted before it is given up on (a resume starts after them)."""
    length, sent = BULK + (16 << 20), BULK + (2 << 20) + 12345  # not a whole number of blocks

    def stall_mid_block(conn: socket.socket, done: threading.Event) -> None:
        conn.sendall(head(length) + os.urandom(sent))
        done.wait(30)

    outcome, handed = fetch(peer(stall_mid_block))
    assert isinstance(outcome, PeerError) and outcome.code == "peer_too_slow" and outcome.resumable, outcome
    assert handed == sent
    assert f"({sent:,} of {length:,} bytes so far)" in str(outcome), outcome
