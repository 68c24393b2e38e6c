"""Manifests and slices, computed without any weights: what the control plane can promise."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from safetensors.numpy import load

from agent.weights.store import Store
from tests.models import tiny_safetensors
from wire import manifest as mf
from wire.layers import LayerRange


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, str, dict]:
    base = tmp_path_factory.mktemp("m")
    store = Store(base / "home")
    digest, manifest = store.import_model(tiny_safetensors(base), "tiny")
    return store, digest, manifest


def test_manifest_indexes_every_tensor_with_its_own_hash(imported: tuple[Store, str, dict]) -> None:
    import hashlib

    store, digest, manifest = imported
    assert mf.digest_of(manifest) == digest == "sha256:" + hashlib.sha256(store.manifest_bytes(digest)).hexdigest()
    st = next(f for f in manifest["files"] if f["path"] == "model.safetensors")
    data = (store.blobs / st["sha256"]).read_bytes()
    assert len(st["tensors"]) == 4 * 9 + 3
    for t in st["tensors"]:
        assert hashlib.sha256(data[t["begin"]:t["end"]]).hexdigest() == t["sha256"]
    assert manifest["layers"] == 4


@pytest.mark.parametrize("layers, has_embed, has_head, blocks", [
    ("0-1", True, False, {0, 1}), ("2-3", False, True, {2, 3}), ("0-3", True, True, {0, 1, 2, 3}), ("2", False, False, {2}),
])
def test_slices_take_their_layers_and_the_right_aux(imported: tuple[Store, str, dict], layers: str,
                                                    has_embed: bool, has_head: bool, blocks: set[int]) -> None:
    store, digest, manifest = imported
    s = mf.make_slice(manifest, digest, LayerRange.parse(layers))
    names = {t["name"] for f in s["files"] if f.get("assembled") for t in f["tensors"]}
    assert ("model.embed_tokens.weight" in names) is has_embed
    assert ("lm_head.weight" in names) is has_head and ("model.norm.weight" in names) is has_head
    assert {mf.layer_of(n) for n in names} - {None} == blocks
    paths = {f["path"] for f in s["files"]}
    assert paths >= {"config.json", "generation_config.json", "model.safetensors"}
    tokenizer = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert paths & tokenizer == (tokenizer if has_embed else set())  # only the first stage tokenises
    assert s["slice"]["layers"] == LayerRange.parse(layers).span  # "2" is recorded as "2-2": one spelling
    assert mf.digest_of(s) == mf.digest_of(mf.make_slice(manifest, digest, LayerRange.parse(layers)))


def test_the_last_slice_of_a_tied_model_keeps_the_embeddings_as_its_head(imported: tuple[Store, str, dict]) -> None:
    _, digest, manifest = imported
    tied = {**manifest, "files": [{**f, "tensors": [t for t in f["tensors"] if t["name"] != "lm_head.weight"]}
                                  if "tensors" in f else f for f in manifest["files"]]}
    names = {layers: {t["name"] for f in mf.make_slice(tied, digest, LayerRange.parse(layers))["files"]
                      if f.get("assembled") for t in f["tensors"]} for layers in ("0-1", "2-3", "2")}
    assert "model.embed_tokens.weight" in names["0-1"] and "model.embed_tokens.weight" in names["2-3"]
    assert "model.norm.weight" in names["2-3"] and not any("lm_head" in n for n in names["2-3"])
    assert "model.embed_tokens.weight" not in names["2"]


def test_slice_bytes_assembled_by_hand_load_as_safetensors(imported: tuple[Store, str, dict]) -> None:
    store, digest, manifest = imported
    s = mf.make_slice(manifest, digest, LayerRange(1, 2))
    f = next(f for f in s["files"] if f.get("assembled"))
    out = io.BytesIO()
    out.write(mf.slice_header(f["tensors"]))
    for t in f["tensors"]:
        src = (store.blobs / t["source"]["sha256"]).read_bytes()
        out.write(src[t["source"]["begin"]:t["source"]["end"]])
    assert out.tell() == f["size"]
    tensors = load(out.getvalue())
    assert set(tensors) == {t["name"] for t in f["tensors"]}


@pytest.mark.parametrize("layers, message", [("4-5", "outside the model"), ("3-1", "backwards"), ("x", "invalid")])
def test_bad_slices_are_refused(imported: tuple[Store, str, dict], layers: str, message: str) -> None:
    _, digest, manifest = imported
    with pytest.raises(ValueError, match=message):  # ManifestError, or LayerRangeError before it
        mf.make_slice(manifest, digest, LayerRange.parse(layers))


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../b", "a\x00b", "a\\b", "", "x" * 300, "a//b"])
def test_unsafe_paths_in_a_peer_manifest_are_refused(path: str) -> None:
    m = {"version": 1, "format": "gguf", "files": [{"path": path, "size": 1, "sha256": "a" * 64}]}
    with pytest.raises(mf.ManifestError, match="path"):
        mf.validate(m)


def test_digest_checks() -> None:
    assert mf.check_digest("sha256:" + "a" * 64) == "a" * 64
    for bad in ["sha256:" + "A" * 64, "sha256:abc", "md5:" + "a" * 64, "sha256:" + "a" * 64 + "/.."]:
        with pytest.raises(mf.ManifestError):
            mf.check_digest(bad)


def test_import_refuses_what_is_not_a_model(tmp_path: Path) -> None:
    from agent.weights.store import StoreError

    store = Store(tmp_path / "home")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04zip")
    with pytest.raises(StoreError, match="not a GGUF"):
        store.import_model(tmp_path / "not.gguf", "x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "readme.txt").write_text("hi")
    with pytest.raises(StoreError, match="not a safetensors model directory"):
        store.import_model(tmp_path / "dir", "x")
    truncated = tmp_path / "trunc"
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    good = tiny_safetensors(tmp_path / "src") / "model.safetensors"
    (truncated / "model.safetensors").write_bytes(good.read_bytes()[:-100])
    with pytest.raises(StoreError, match="truncated"):
        store.import_model(truncated, "x")
