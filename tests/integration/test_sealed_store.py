"""Encrypted models in the store, on real files: an encrypted import keeps no plaintext anywhere under
the home and nothing under blobs/ (what peers are served from); verification finds a flipped byte
with the key and without it; the unsealer gives engines read-only memfds of exactly the plaintext,
refuses a missing or another key naming the model and key ids, and a file swapped for another
model's (same key, same name: the cipher cannot tell) by its plaintext hash."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from agent.weights.sealed import make_key
from agent.weights.store import Store, StoreError
from agent.simulation.testmodel import Shape, make_safetensors
from agent.weights.unseal import KEY_MISSING, TAMPERED, Refusal, Unsealer
from agent.backends.launch import ProcessLauncher
from agent.weights.verify import check
from agent.serving.supervisor import RequestRefused, Workers
from tests.agents import free_port
from tests.models import flip, tiny_safetensors

KEY = make_key(bytes(range(32)))


def plaintext_runs(model: Path) -> list[bytes]:
    data = (model / "model.safetensors").read_bytes()
    return [data[at:at + 64] for at in range(len(data) // 4, len(data) - 64, len(data) // 5)]


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_safetensors(tmp_path_factory.mktemp("models"))


def test_an_encrypted_import_keeps_no_plaintext(tmp_path: Path, model: Path) -> None:
    store = Store(tmp_path, KEY)
    digest, manifest = store.import_model(model, "tiny", encrypt=True)
    assert manifest["encryption"] == {"cipher": "aes-256-gcm", "chunk_bytes": 1 << 20, "key_id": KEY.id}
    assert KEY.secret.hex() not in store.manifest_bytes(digest).decode()
    assert list(store.blobs.iterdir()) == [] and len(list(store.sealed.iterdir())) == len(manifest["files"])
    needles = plaintext_runs(model)
    assert all(any(n in p.read_bytes() for p in files_under(model)) for n in needles)
    assert not [p for p in files_under(tmp_path) for n in needles if n in p.read_bytes()]
    assert b'"num_hidden_layers"' not in b"".join(p.read_bytes() for p in files_under(store.sealed))
    # The digest pins the plaintext and how it is sealed: the plain import's differs, a second
    # sealing (other nonces) has the same, and replaces the first one's files.
    plain, _ = Store(tmp_path / "plain").import_model(model, "tiny")
    assert plain != digest
    first = set(os.listdir(store.sealed))
    again, _ = store.import_model(model, "tiny", encrypt=True)
    assert again == digest and set(os.listdir(store.sealed)).isdisjoint(first)
    assert len(os.listdir(store.sealed)) == len(manifest["files"])
    entry = store.entry(digest)
    assert entry.get("encryption") == {"cipher": "aes-256-gcm", "key_id": KEY.id, "key_held": True}
    assert Store(tmp_path).entry(digest).get("encryption", {}).get("key_held") is False
    with pytest.raises(StoreError, match="weights key"):
        Store(tmp_path / "nokey").import_model(model, "tiny", encrypt=True)


def test_verification_with_and_without_the_key(tmp_path: Path, model: Path) -> None:
    store = Store(tmp_path, KEY)
    digest, _ = store.import_model(model, "tiny", encrypt=True)
    assert check(store, digest) == [] and check(Store(tmp_path), digest) == []
    held = store.model_dir(digest) / "model.safetensors"
    flip(held, held.stat().st_size - 5)  # in the last chunk's tag
    [(path, why)] = check(store, digest)
    assert path == "model.safetensors" and "fails authentication" in why, why
    [(path, why)] = check(Store(tmp_path), digest)
    assert path == "model.safetensors" and "sealed bytes hash to" in why, why
    assert store.record(digest, check(store, digest))["state"] == "corrupt"
    assert list(store.blobs.iterdir()) == []  # nothing linked back where peers are served from


def test_the_unsealer_serves_read_only_memfds_of_the_plaintext(tmp_path: Path, model: Path) -> None:
    store = Store(tmp_path, KEY)
    digest, manifest = store.import_model(model, "tiny", encrypt=True)
    (tmp_path / "servers").mkdir()
    unsealer = Unsealer(store, tmp_path / "servers")
    entry = store.entry(digest)
    opened = unsealer.prepare("s@cp", entry)
    unsealer.open(opened, entry)
    try:
        links = Path(opened.path)
        assert links.parent == tmp_path / "servers" and links.name.startswith("s@cp.")
        assert sorted(p.name for p in links.iterdir()) == sorted(f["path"] for f in manifest["files"])
        for f in manifest["files"]:
            link = links / f["path"]
            # resolved in the process that follows it: only one holding that descriptor (the worker) reads it
            assert os.readlink(link).startswith("/proc/self/fd/")
            assert link.read_bytes() == (model / f["path"]).read_bytes()
        with pytest.raises(OSError) as exc:
            os.pwrite(opened.fds[0], b"x", 0)
        assert exc.value.errno == errno.EPERM  # sealed: an engine cannot change what it serves
    finally:
        unsealer.close(opened)
    assert list((tmp_path / "servers").iterdir()) == []
    with pytest.raises(Refusal, match=f"^{KEY_MISSING}: model tiny .*under key {KEY.id}.*holds no weights key"):
        Unsealer(Store(tmp_path), tmp_path / "servers").open(opened, entry)
    other = make_key(bytes(range(1, 33)))
    with pytest.raises(Refusal, match=f"under key {KEY.id}, but this agent holds key {other.id}"):
        Unsealer(Store(tmp_path, other), tmp_path / "servers").open(opened, entry)


def test_a_file_swapped_for_another_models_is_refused(tmp_path: Path, model: Path) -> None:
    store = Store(tmp_path, KEY)
    digest, _ = store.import_model(model, "tiny", encrypt=True)
    twin = make_safetensors(tmp_path / "twin", Shape(layers=2))
    other, _ = store.import_model(twin, "twin", encrypt=True)
    target = store.model_dir(digest) / "config.json"
    target.unlink()
    os.link(store.model_dir(other) / "config.json", target)
    (tmp_path / "servers").mkdir()
    unsealer = Unsealer(store, tmp_path / "servers")
    with pytest.raises(Refusal, match=f"^{TAMPERED}: model tiny .*config.json: decrypts to sha256"):
        unsealer.open(unsealer.prepare("s@cp", store.entry(digest)), store.entry(digest))
    assert list((tmp_path / "servers").iterdir()) == []


def test_an_encrypted_draft_model_is_refused(tmp_path: Path, model: Path) -> None:
    store = Store(tmp_path, KEY)
    plain, _ = store.import_model(model, "tiny")
    draft, _ = store.import_model(model, "draft", encrypt=True)
    workers = Workers(tmp_path, store, lambda *a: None, ProcessLauncher(), "127.0.0.1")
    with pytest.raises(RequestRefused) as exc:
        workers.start({"id": "s@cp", "model": plain, "port": free_port("127.0.0.1"),
                       "settings": {"speculative": {"mode": "draft", "draft": "draft", "draft_digest": draft}}})
    assert exc.value.code == "encrypted_draft_unsupported" and draft in exc.value.message
