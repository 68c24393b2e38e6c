"""The sealed file format (agent/weights/sealed.py): round trips at every size around the chunk boundaries,
and every way to alter a sealed file (a flipped byte, a cut, reordered or swapped chunks, another
file's or another key's chunks) found by the cipher; and where the key comes from."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.weights.sealed import HEADER, KEY_ENV, KEY_FILE_ENV, MAX_KEY_FILE, TAG_BYTES, Key, KeyProblem, Unsealable, load_key, make_key, parse_key, seal_bytes, unseal

KEY = make_key(bytes(range(32)))
OTHER = make_key(bytes(range(1, 33)))
CHUNK = 16


def opened(sealed: bytes, key: Key = KEY, rel: str = "model.safetensors") -> bytes:
    return b"".join(unseal(io.BytesIO(sealed), len(sealed), key, rel))


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 5])
def test_round_trip(size: int) -> None:
    plain = os.urandom(size)
    sealed = seal_bytes(plain, KEY, "model.safetensors", CHUNK)
    chunks = max(1, -(-size // CHUNK))
    assert len(sealed) == HEADER.size + size + chunks * TAG_BYTES
    assert opened(sealed) == plain
    assert len(plain) < 8 or plain not in sealed  # a byte or two of any plaintext turns up by chance


def test_every_flipped_byte_is_found() -> None:
    sealed = seal_bytes(os.urandom(2 * CHUNK + 3), KEY, "m", CHUNK)
    for i in range(len(sealed)):
        bad = bytearray(sealed)
        bad[i] ^= 0x01
        with pytest.raises(Unsealable):
            opened(bytes(bad), rel="m")


def test_cut_at_a_chunk_boundary_is_found() -> None:
    sealed = seal_bytes(os.urandom(3 * CHUNK), KEY, "m", CHUNK)
    for chunks in (1, 2):
        with pytest.raises(Unsealable, match="fails authentication"):
            opened(sealed[:HEADER.size + chunks * (CHUNK + TAG_BYTES)], rel="m")
    with pytest.raises(Unsealable, match="truncated|fails"):
        opened(sealed[:-1], rel="m")


def test_reordered_chunks_are_found() -> None:
    sealed = seal_bytes(os.urandom(3 * CHUNK), KEY, "m", CHUNK)
    h, n = HEADER.size, CHUNK + TAG_BYTES
    swapped = sealed[:h] + sealed[h + n:h + 2 * n] + sealed[h:h + n] + sealed[h + 2 * n:]
    with pytest.raises(Unsealable, match="chunk 0 of 3"):
        opened(swapped, rel="m")


def test_another_files_chunk_or_name_or_key_is_found() -> None:
    plain = os.urandom(2 * CHUNK)
    a, b = seal_bytes(plain, KEY, "a", CHUNK), seal_bytes(plain, KEY, "a", CHUNK)
    assert a != b  # a random nonce prefix per file
    mixed = a[:HEADER.size + CHUNK + TAG_BYTES] + b[HEADER.size + CHUNK + TAG_BYTES:]
    with pytest.raises(Unsealable):
        opened(mixed, rel="a")
    with pytest.raises(Unsealable):
        opened(a, rel="b")  # the same bytes presented as another file of the model
    with pytest.raises(Unsealable, match="another key"):
        opened(a, key=OTHER, rel="a")


def test_bad_headers() -> None:
    with pytest.raises(Unsealable, match="too short"):
        opened(b"FLT", rel="m")
    with pytest.raises(Unsealable, match="not a sealed file"):
        opened(struct.pack(">8s8sI", b"GGUF\0\0\0\0", b"\0" * 8, 16) + b"\0" * 16, rel="m")


def test_key_forms_and_ids(tmp_path: Path) -> None:
    secret = os.urandom(32)
    assert parse_key(secret, "x") == parse_key(secret.hex().encode() + b"\n", "x")
    assert repr(parse_key(secret, "x")).count(secret.hex()) == 0
    assert make_key(secret).id != make_key(os.urandom(32)).id and len(make_key(secret).id) == 16
    with pytest.raises(KeyProblem, match="32 raw bytes or 64 hex"):
        parse_key(b"short", "the file")


def test_key_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o644)
    with pytest.raises(KeyProblem, match="readable by others"):
        load_key(str(path), {})
    path.chmod(0o600)
    assert load_key(str(path), {}) is not None
    with pytest.raises(KeyProblem, match="cannot read"):
        load_key(str(tmp_path / "missing"), {})
    big = tmp_path / "big"
    big.write_bytes(b"0" * (MAX_KEY_FILE + 1))
    big.chmod(0o600)
    with pytest.raises(KeyProblem, match=f"over {MAX_KEY_FILE} bytes"):
        load_key(str(big), {})
    if os.geteuid() == 0:  # root can give a file away; an unprivileged user cannot, so nothing to check
        os.chown(path, 65534, 65534)
        with pytest.raises(KeyProblem, match="belongs to uid 65534, not to this agent's user"):
            load_key(str(path), {})


def test_key_sources_in_order_and_never_the_environment(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        p.write_bytes(os.urandom(32))
        p.chmod(0o600)
    assert load_key(str(a), {KEY_FILE_ENV: str(b)}) == parse_key(a.read_bytes(), "a")
    assert load_key(None, {KEY_FILE_ENV: str(b)}) == parse_key(b.read_bytes(), "b")
    assert load_key(None, {}) is None
    # The key itself in the environment stays in /proc/PID/environ: refused, saying what to do.
    for given in (str(a), None):
        with pytest.raises(KeyProblem, match=f"\\${KEY_ENV} is not read: .*--key-file PATH"):
            load_key(given, {KEY_FILE_ENV: str(b), KEY_ENV: os.urandom(32).hex()})


@settings(max_examples=60, deadline=None)
@given(plain=st.binary(max_size=300), chunk=st.integers(1, 64), data=st.data())
def test_any_size_round_trips_and_any_flip_is_found(plain: bytes, chunk: int, data: st.DataObject) -> None:
    sealed = seal_bytes(plain, KEY, "f", chunk)
    assert opened(sealed, rel="f") == plain
    at = data.draw(st.integers(0, len(sealed) - 1))
    bad = bytearray(sealed)
    bad[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(Unsealable):
        opened(bytes(bad), rel="f")


def test_a_worker_finds_the_memfds_its_environment_names_and_only_fleet_s() -> None:
    from agent.weights.sealed import MEMFDS_ENV, held_memfds

    mine, other = os.memfd_create("fleet:model.gguf", 0), os.memfd_create("someone-else", 0)
    closed = os.memfd_create("fleet:gone", 0)
    os.close(closed)
    try:
        named = f"{mine},{other},{closed},x,-1,{'9' * 40},,{mine + 100000}"
        assert held_memfds({MEMFDS_ENV: named}) == [mine]
        assert held_memfds({}) == [] and held_memfds({MEMFDS_ENV: ""}) == []
    finally:
        os.close(mine)
        os.close(other)
