"""Piece hashes (wire/pieces.py): the same list for any chunking, a bad piece named by index and
offset with the good prefix kept, and manifests whose piece lists do not fit refused."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire import manifest as mf
from wire import pieces

P = pieces.MIN_PIECE
DATA = bytes(range(256)) * (P * 3 // 256) + b"tail"  # three pieces and four bytes


def reference(data: bytes, n: int) -> list[str]:
    return [hashlib.sha256(data[i:i + n]).hexdigest() for i in range(0, len(data), n)]


def feed(target: pieces.Hasher | pieces.Checker, data: bytes, cuts: list[int]) -> None:
    at = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        target.update(data[at:cut])
        at = cut


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, len(DATA)), max_size=6))
def test_the_hash_list_does_not_depend_on_how_the_bytes_are_cut(cuts: list[int]) -> None:
    h = pieces.Hasher(P)
    feed(h, DATA, cuts)
    assert h.finish() == reference(DATA, P)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, len(DATA)), max_size=6))
def test_a_good_stream_is_verified_piece_by_piece(cuts: list[int]) -> None:
    c = pieces.Checker(reference(DATA, P), P, len(DATA))
    seen = []
    at = 0
    for cut in sorted(set(cuts)) + [len(DATA)]:
        c.update(DATA[at:cut])
        at = cut
        seen.append(c.verified)
        assert c.verified % P == 0 or c.verified == len(DATA)
        assert c.verified <= at
    assert c.verified == len(DATA)


@pytest.mark.parametrize("flip", [0, P - 1, P, 2 * P + 7, len(DATA) - 1], ids=lambda n: f"byte{n}")
def test_a_flipped_byte_names_its_piece_and_keeps_the_prefix(flip: int) -> None:
    bad = bytearray(DATA)
    bad[flip] ^= 1
    c = pieces.Checker(reference(DATA, P), P, len(DATA))
    with pytest.raises(pieces.BadPieceError) as err:
        c.update(bytes(bad))
    index = flip // P
    assert err.value.bad.index == index and err.value.bad.offset == index * P
    assert err.value.bad.expected == reference(DATA, P)[index]
    assert err.value.bad.actual == hashlib.sha256(bytes(bad[index * P:(index + 1) * P])).hexdigest()
    assert c.verified == index * P  # nothing of the bad piece counts as verified
    assert f"piece {index} " in str(err.value)


def test_a_resume_starts_on_a_piece_boundary() -> None:
    c = pieces.Checker(reference(DATA, P), P, len(DATA), start=2 * P)
    c.update(DATA[2 * P:])
    assert c.verified == len(DATA)
    with pytest.raises(ValueError, match="past the file's end"):
        c.update(b"x")


def entry(**extra: object) -> dict[str, object]:
    return {"path": "m.gguf", "size": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest(), **extra}


def manifest(f: dict[str, object]) -> dict[str, object]:
    return {"version": 1, "format": "gguf", "layers": None, "slice": None, "files": [f]}


def test_a_manifest_carries_its_pieces_and_its_digest_pins_them() -> None:
    good = manifest(entry(**pieces.entry_fields(len(DATA), reference(DATA, P), P)))
    assert mf.validate(good) is good
    forged = manifest(entry(**pieces.entry_fields(len(DATA), ["0" * 64] + reference(DATA, P)[1:], P)))
    assert mf.digest_of(forged) != mf.digest_of(good)  # a peer cannot swap a hash under the same digest
    assert pieces.entry_fields(P, [reference(DATA, P)[0]], P) == {}  # one piece: the file's sha256 says it


@pytest.mark.parametrize("extra,wrong", [
    ({"piece_bytes": P, "pieces": ["a" * 64]}, "must list 4 hashes"),
    ({"piece_bytes": 100, "pieces": []}, "piece_bytes must be an integer"),
    ({"piece_bytes": P, "pieces": ["A" * 64] * 4}, "64 lowercase hex"),
    ({"pieces": ["a" * 64] * 4}, "piece_bytes must be"),
    ({"piece_bytes": True, "pieces": []}, "piece_bytes must be"),
], ids=["count", "too-small", "uppercase", "no-size", "bool"])
def test_a_piece_list_that_does_not_fit_is_refused(extra: dict[str, object], wrong: str) -> None:
    with pytest.raises(mf.ManifestError, match=wrong):
        mf.validate(manifest(entry(**extra)))
