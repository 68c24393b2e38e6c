"""The shared values of wire/: LayerRange (one parser for config, planner, agent API and fetch)
and server ids and plan addresses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.ids import replica_address, server_address, server_id, split_server_id
from wire.layers import LayerRange, LayerRangeError


@pytest.mark.parametrize("text, first, last, spelled", [
    ("0-39", 0, 39, "0-39"), ("40-79", 40, 79, "40-79"), ("7", 7, 7, "7"), ("7-7", 7, 7, "7"),
    ("0", 0, 0, "0"), ("99999-99999", 99999, 99999, "99999"),
])
def test_parse(text: str, first: int, last: int, spelled: str) -> None:
    rng = LayerRange.parse(text)
    assert (rng.first, rng.last) == (first, last)
    assert str(rng) == spelled  # as fleet.yaml and plans write it
    assert rng.span == f"{first}-{last}"  # as a slice manifest records it, one layer too
    assert rng.count == last - first + 1


@pytest.mark.parametrize("text, message", [
    ("3-1", "layer range '3-1' runs backwards"),
    ("x", "invalid layer range 'x': expected FIRST-LAST, e.g. 0-39"),
    ("07", "invalid layer range"), ("-1", "invalid layer range"), ("1-", "invalid layer range"),
    ("1 - 2", "invalid layer range"), ("100000", "invalid layer range"), ("", "invalid layer range"),
    (5, "invalid layer range '5'"), (None, "invalid layer range 'None'"),
])
def test_bad_ranges_are_one_error_type_that_says_why(text: object, message: str) -> None:
    with pytest.raises(LayerRangeError, match=message.replace("(", r"\(")) as caught:
        LayerRange.parse(text)
    assert isinstance(caught.value, ValueError) and caught.value.text == text


def test_a_backwards_range_cannot_be_built_either() -> None:
    with pytest.raises(LayerRangeError, match="runs backwards"):
        LayerRange(5, 4)
    with pytest.raises(LayerRangeError, match="negative"):
        LayerRange(-1, 4)


def test_containment_and_order() -> None:
    rng = LayerRange(2, 3)
    assert 2 in rng and 3 in rng and 1 not in rng and 4 not in rng and "2" not in rng
    assert sorted([LayerRange(4, 7), LayerRange(0, 3), LayerRange(0, 1)]) == [
        LayerRange(0, 1), LayerRange(0, 3), LayerRange(4, 7)]


@given(st.integers(0, 99999), st.integers(0, 99999))
def test_every_range_reads_back_from_both_spellings(a: int, b: int) -> None:
    rng = LayerRange(min(a, b), max(a, b))
    assert LayerRange.parse(str(rng)) == rng == LayerRange.parse(rng.span)


def test_server_ids_and_addresses() -> None:
    assert server_id("chat", "gpu-a") == "chat@gpu-a"
    assert split_server_id("chat@gpu-a") == ("chat", "gpu-a")
    assert split_server_id("hand-made") == ("hand-made", None)  # a server fleet did not start
    assert server_address("chat", "gpu-a") == "server.chat@gpu-a"
    assert replica_address("big[0-1]", "gpu-a") == "replica.big[0-1]@gpu-a"
