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


def feed(target: pieces.Hasher | pieces.Checker | pieces.PrefixHasher | pieces.PrefixChecker, data: bytes,
         cuts: list[int]) -> None:
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
    c.update(DATA[index * P:])  # the good piece fed again verifies: the piece's hash started anew
    assert c.verified == len(DATA)


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


def prefixes_of(data: bytes, n: int) -> list[str]:
    return [hashlib.sha256(data[:min(i + n, len(data))]).hexdigest() for i in range(0, len(data), n)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, len(DATA)), max_size=6))
def test_prefix_digests_and_the_sha256_come_from_one_pass_for_any_cut(cuts: list[int]) -> None:
    h = pieces.PrefixHasher(P)
    feed(h, DATA, cuts)
    listed, whole = h.finish()
    assert listed == prefixes_of(DATA, P) and whole == hashlib.sha256(DATA).hexdigest() == listed[-1]
    c = pieces.PrefixChecker(listed, P, len(DATA))
    feed(c, DATA, cuts)
    assert c.verified == len(DATA) and c.hexdigest() == whole


@pytest.mark.parametrize("flip", [0, P - 1, P, 2 * P + 7, len(DATA) - 1], ids=lambda n: f"byte{n}")
def test_a_flipped_byte_names_its_piece_and_the_hash_goes_back_to_the_good_prefix(flip: int) -> None:
    bad = bytearray(DATA)
    bad[flip] ^= 1
    index = flip // P
    c = pieces.PrefixChecker(prefixes_of(DATA, P), P, len(DATA))
    with pytest.raises(pieces.BadPieceError) as err:
        c.update(bytes(bad))
    assert err.value.bad.index == index and err.value.bad.offset == index * P and err.value.bad.prefix
    assert err.value.bad.expected == prefixes_of(DATA, P)[index]
    assert err.value.bad.actual == hashlib.sha256(bytes(bad[:(index + 1) * P])).hexdigest()
    assert c.verified == index * P and f"piece {index} " in str(err.value)
    c.update(DATA[index * P:])  # the good piece fed again verifies: the running hash was restored
    assert c.verified == len(DATA) and c.hexdigest() == hashlib.sha256(DATA).hexdigest()


def test_a_prefix_check_resumes_from_the_running_hash_of_the_held_bytes() -> None:
    held = hashlib.sha256(DATA[:2 * P])
    c = pieces.PrefixChecker(prefixes_of(DATA, P), P, len(DATA), start=2 * P, running=held)
    c.update(DATA[2 * P:])
    assert c.verified == len(DATA)
    wrong = pieces.PrefixChecker(prefixes_of(DATA, P), P, len(DATA), start=2 * P)  # no running hash: a fresh one
    with pytest.raises(pieces.BadPieceError):
        wrong.update(DATA[2 * P:])


def test_a_forged_prefix_is_caught_and_moves_the_digest() -> None:
    good = manifest(entry(**pieces.prefix_fields(len(DATA), prefixes_of(DATA, P), P)))
    assert mf.validate(good) is good
    forged_list = [prefixes_of(DATA, P)[0][::-1]] + prefixes_of(DATA, P)[1:]
    forged = manifest(entry(**pieces.prefix_fields(len(DATA), forged_list, P)))
    assert mf.validate(forged) and mf.digest_of(forged) != mf.digest_of(good)
    with pytest.raises(pieces.BadPieceError, match="piece 0 "):
        pieces.PrefixChecker(forged_list, P, len(DATA)).update(DATA)
    assert pieces.prefix_fields(P, prefixes_of(DATA[:P], P), P) == {}


@pytest.mark.parametrize("extra,wrong", [
    ({"piece_bytes": P, "prefixes": ["a" * 64]}, "prefixes must list 4 hashes"),
    ({"piece_bytes": P, "prefixes": ["A" * 64] * 4}, "every prefix hash must be 64 lowercase hex"),
    ({"piece_bytes": P, "prefixes": ["a" * 64] * 4}, "the last prefix is the whole file"),
    ({"prefixes": ["a" * 64] * 4}, "piece_bytes must be"),
    ({"piece_bytes": P, "prefixes": prefixes_of(DATA, P), "pieces": reference(DATA, P)},
     "pieces and prefixes are two forms of one list: an entry carries one of them, not both"),
], ids=["count", "uppercase", "last-not-sha256", "no-size", "both"])
def test_a_prefix_list_that_does_not_fit_is_refused(extra: dict[str, object], wrong: str) -> None:
    with pytest.raises(mf.ManifestError, match=f"file 'm.gguf': {wrong}"):
        mf.validate(manifest(entry(**extra)))


def test_sized_pieces_are_a_power_of_two_near_a_256th_of_the_file_within_bounds() -> None:
    mib = 1 << 20
    assert pieces.sized(0) == pieces.sized(1) == pieces.sized(1 << 30) == 4 * mib  # 1 GiB / 256 = 4 MiB
    assert pieces.sized((1 << 30) + 1) == 8 * mib  # just past it: the next power of two
    assert pieces.sized(5 << 30) == 32 * mib
    assert pieces.sized(140 * 10**9) == 64 * mib  # a 70B model: ~2,100 digests
    for size in (3, 10**6, 7 * 10**9, 10**12):
        n = pieces.sized(size)
        assert n & (n - 1) == 0 and pieces.SIZED_MIN <= n <= pieces.SIZED_MAX
        assert n == pieces.SIZED_MAX or n == pieces.SIZED_MIN or n // 2 < size / pieces.SIZED_SHARE <= n
