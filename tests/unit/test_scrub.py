"""The scrubber finds a path cut at any byte boundary, and never leaves a longer path's prefix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.serve.scrub import Scrubber

HOME = "/var/lib/fleet-agent"
STORE = HOME + "/store/models/6d61a17b10fd54a6"
BODY = (f'data: {{"model":"{STORE}","text":"hi"}}\n\ndata: {{"path":"{HOME}/x","n":1}}\n\n'
        f'data: {{"model":"{STORE}"}}\n\n').encode()
EXPECTED = (b'data: {"model":"chat","text":"hi"}\n\ndata: {"path":"chat/x","n":1}\n\n'
            b'data: {"model":"chat"}\n\n')


def run(chunks: list[bytes]) -> bytes:
    s = Scrubber([HOME, STORE], "chat")
    return b"".join(s.feed(c) for c in chunks) + s.flush()


def test_whole_body() -> None:
    assert run([BODY]) == EXPECTED


@pytest.mark.parametrize("cut", range(len(BODY) + 1))
def test_every_two_chunk_cut(cut: int) -> None:
    assert run([BODY[:cut], BODY[cut:]]) == EXPECTED


def test_byte_by_byte_and_nothing_leaks() -> None:
    out = run([BODY[i:i + 1] for i in range(len(BODY))])
    assert out == EXPECTED and b"/var/lib" not in out


def test_no_paths_is_a_pass_through() -> None:
    s = Scrubber([], "x")
    assert s.feed(b"abc") + s.flush() == b"abc"


def test_an_event_ending_in_no_path_prefix_leaves_whole() -> None:
    s = Scrubber([HOME, STORE], "chat")
    event = f'data: {{"model":"{STORE}","text":"a/b"}}\n\n'.encode()
    assert s.feed(event) == b'data: {"model":"chat","text":"a/b"}\n\n'  # nothing held for the next token
    assert s.feed(b'data: {"x":"/var/l') == b'data: {"x":"'  # this tail may still grow into HOME
    assert s.feed(b'ib/fleet-agent/store"}') + s.flush() == b'chat/store"}'


def test_two_paths_hold_from_the_earliest() -> None:
    s = Scrubber(["/srv/home", "/opt/fleet"], "m")
    assert s.feed(b"ab/opt/fl") == b"ab"
    assert s.feed(b"eet /srv/h") == b"m "
    assert s.feed(b"ome.") + s.flush() == b"m."


@pytest.mark.parametrize("short", [".", "./", "/", "/srv", "/tmp/", "/a/b", "/1/24", "fleet/home", "~/fleet-agent"])
def test_a_path_shorter_than_the_minimum_or_relative_is_never_replaced(short: str) -> None:
    text = b"The capital of France is Paris. See /srv, /tmp/x, /a/b, 1/24, fleet/home and ~/fleet-agent./"
    s = Scrubber([short, HOME], "smol")
    assert s.feed(text) + s.flush() == text
    assert s.feed(f"at {HOME}.".encode()) + s.flush() == b"at smol."  # a real home still is


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(BODY)), max_size=12))
def test_any_number_of_cuts(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(BODY)]
    assert run([BODY[a:b] for a, b in zip(bounds, bounds[1:])]) == EXPECTED
