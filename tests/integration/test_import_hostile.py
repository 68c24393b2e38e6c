"""`fleet-agent import` as an operator runs it, on model directories and files a hostile party made:
a link out of the model (a secret, the weights key) is refused naming it, and nothing of the
target reaches the store; a FIFO or a device is never read; a JSON config or safetensors header
nested 200,000 deep, a GGUF truncated, header-only, of version 99 or claiming 2^63-1 tensors, a
safetensors header with a dtype not in the format, a shape its bytes cannot hold, float offsets,
a tensor named like a path, a name twice, or more tensors than the bound: each exits 3 with its
own stable code and one line naming the file, never a traceback. Links inside the model (and a
Hugging Face cache snapshot's links into its blobs/) still import, to the same digest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.weights.headers import MAX_SAFETENSORS_HEADER, MAX_TENSORS
from agent.weights.store import Store
from tests.agents import agent_env, enroll
from tests.conftest import fleet_bin
from tests.models import tiny_gguf, tiny_safetensors

pytestmark = pytest.mark.e2e  # every test runs `fleet-agent` as a process
SECRET_BYTES = b"the weights key: 0123456789abcdef0123456789abcdef\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("models")
    tiny_safetensors(base)
    tiny_gguf(base)
    return base


@pytest.fixture
def home(tmp_path: Path) -> Path:
    enroll(tmp_path / "home", "n")
    return tmp_path / "home"


def run_import(home: Path, path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(home), str(path), "--json", *extra],
                          capture_output=True, text=True, timeout=300, env=agent_env(), stdin=subprocess.DEVNULL)


def stored(home: Path) -> set[str]:
    """Every file of the store (blobs, sealed copies, partial imports), by name."""
    store = home / "store"
    return {p.name for p in store.rglob("*") if p.is_file()} if store.exists() else set()


def refused(proc: subprocess.CompletedProcess[str], code: str, *words: str) -> dict[str, Any]:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3 and "Traceback" not in out, out
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == 3 and doc["error"]["code"] == code, doc
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("fleet-agent import: "), proc.stderr
    for w in words:
        assert w in doc["error"]["message"], (w, doc)
    return doc  # type: ignore[no-any-return]


def model_dir(models: Path, where: Path) -> Path:
    out = where / "model"
    shutil.copytree(models / "tiny-llama", out)
    return out


# ---- links and special files (item 6) ----

@pytest.mark.parametrize("how", ["absolute", "relative", "directory", "chained"])
def test_a_link_out_of_the_model_is_refused_and_nothing_of_it_is_stored(
        models: Path, home: Path, tmp_path: Path, how: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "weights.key"
    secret.write_bytes(SECRET_BYTES)
    model = model_dir(models, tmp_path)
    link = model / ("keys" if how == "directory" else "tokenizer_extra.json")
    if how == "absolute":
        link.symlink_to(secret)
    elif how == "relative":
        link.symlink_to(Path("..") / "outside" / "weights.key")
    elif how == "directory":
        link.symlink_to(outside, target_is_directory=True)
    else:  # a link to a link inside, which points out
        (model / "inner").symlink_to(secret)
        link.symlink_to("inner")
    before = stored(home)
    proc = run_import(home, model)
    refused(proc, "symlink_outside_model", str(model), "outside the model directory")
    assert stored(home) == before
    assert hashlib.sha256(SECRET_BYTES).hexdigest() not in stored(home)


@pytest.mark.parametrize("kind", ["fifo", "device", "link-to-device", "socket"])
def test_a_fifo_a_device_or_a_socket_is_never_read(models: Path, home: Path, tmp_path: Path, kind: str) -> None:
    model = model_dir(models, tmp_path)
    special = model / "extra.bin"
    if kind == "fifo":
        os.mkfifo(special)
    elif kind == "device":
        if not os.access("/dev", os.W_OK):
            pytest.skip("making a device node needs root")
        os.mknod(special, 0o600 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's numbers
    elif kind == "link-to-device":
        special.symlink_to("/dev/zero")
    else:
        import socket

        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(special))
        sock.close()
    proc = run_import(home, model)  # a FIFO read would hang; /dev/zero would never end
    refused(proc, "symlink_outside_model" if kind == "link-to-device" else "not_a_regular_file", str(special))
    assert stored(home) == set()


def test_a_fifo_named_as_the_model_is_refused(home: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    refused(run_import(home, fifo), "not_a_regular_file", str(fifo), "FIFO")


def test_links_inside_the_model_and_a_hugging_face_snapshot_import_as_the_plain_copy(
        models: Path, home: Path, tmp_path: Path) -> None:
    """A link that resolves inside the model directory is followed (to a regular file) and imported
    under the link's own name; a Hugging Face cache snapshot, all links into its repository's
    blobs/, imports to the same digest as the plain directory."""
    plain = json.loads(run_import(home, models / "tiny-llama").stdout)["digest"]
    inside = model_dir(models, tmp_path)
    (inside / "weights").mkdir()
    os.rename(inside / "model.safetensors", inside / "weights" / "w.bin")
    (inside / "weights" / "latest").symlink_to("w.bin")
    (inside / "model.safetensors").symlink_to(Path("weights") / "latest")  # a link to a link, both inside
    proc = run_import(home, inside)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    store = Store(home)
    files = {f["path"]: f for f in store.load_manifest(json.loads(proc.stdout)["digest"])["files"]}
    want = {f["path"]: f for f in store.load_manifest(plain)["files"]}["model.safetensors"]
    assert files["model.safetensors"] == want and files["weights/w.bin"]["sha256"] == want["sha256"]
    assert "weights/latest" in files
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in sorted((models / "tiny-llama").iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / sha)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / sha)
    hf = run_import(home, snap)
    assert hf.returncode == 0, hf.stdout + hf.stderr
    assert json.loads(hf.stdout)["digest"] == plain


# ---- headers (item 7) ----

def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def gguf(version: int = 3, n_tensors: int = 1, n_kv: int = 0, rest: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + rest


@pytest.mark.parametrize("case", ["truncated", "header-only", "version-99", "2^63-1-tensors", "no-tensors",
                                  "2^63-1-keys"])
def test_a_hostile_gguf_is_refused_naming_it(models: Path, home: Path, tmp_path: Path, case: str) -> None:
    real = (models / "tiny-llama.gguf").read_bytes()
    path = tmp_path / f"{case}.gguf"
    path.write_bytes({
        "truncated": real[: len(real) // 2],
        "header-only": real[:4096],  # the metadata and tensor infos, none of the tensors' bytes
        "version-99": b"GGUF" + struct.pack("<I", 99) + real[8:],
        "2^63-1-tensors": gguf(n_tensors=2**63 - 1) + os.urandom(4096),
        "no-tensors": gguf(n_tensors=0),
        "2^63-1-keys": gguf(n_kv=2**63 - 1) + os.urandom(4096),
    }[case])
    words = {"version-99": "version 99", "2^63-1-tensors": "9,223,372,036,854,775,807 tensors",
             "no-tensors": "no tensors", "2^63-1-keys": "metadata keys"}.get(case, "")
    refused(run_import(home, path), "invalid_gguf", str(path), words)
    assert stored(home) == set()


def safetensors_file(header: bytes | dict[str, Any], data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def many_tensors(n: int) -> bytes:
    entries = ",".join(f'"t{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' for i in range(n))
    return ("{" + entries + "}").encode()


ST_CASES: dict[str, tuple[bytes, str, str]] = {
    "dtype-Q99": (safetensors_file({"w": {"dtype": "Q99", "shape": [2], "data_offsets": [0, 2]}}, b"ab"),
                  "invalid_safetensors", "'Q99'"),
    "shape-2^62x2^62": (safetensors_file({"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}},
                                         bytes(8)), "invalid_safetensors", "data_offsets of 8 bytes"),
    "float-offsets": (safetensors_file({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0.0, 2.0]}}, b"ab"),
                      "invalid_safetensors", "data_offsets"),
    "bool-shape": (safetensors_file({"w": {"dtype": "U8", "shape": [True, 2], "data_offsets": [0, 2]}}, b"ab"),
                   "invalid_safetensors", "shape"),
    "path-name": (safetensors_file({"../../etc/passwd": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}},
                                   b"ab"), "invalid_safetensors", "path separator"),
    "name-twice": (safetensors_file(b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                    b'"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"ab"),
                   "invalid_safetensors", "twice"),
    "overlapping": (safetensors_file({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                                      "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"abc"),
                    "invalid_safetensors", "does not start where the previous one ends"),
    "past-the-data": (safetensors_file({"w": {"dtype": "U8", "shape": [9], "data_offsets": [0, 9]}}, b"ab"),
                      "invalid_safetensors", "truncated"),
    "metadata-not-strings": (safetensors_file({"__metadata__": {"format": 1},
                                               "w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"ab"),
                             "invalid_safetensors", "__metadata__"),
    "200000-deep": (safetensors_file(b'{"w":' + deep(200_000) + b"}"), "invalid_safetensors", "nested"),
    "too-many-tensors": (safetensors_file(many_tensors(MAX_TENSORS + 1)), "invalid_safetensors",
                         f"more than {MAX_TENSORS:,} tensors"),
    "1M-tensors": (safetensors_file(many_tensors(1_000_000)), "invalid_safetensors",
                   f"at most {MAX_SAFETENSORS_HEADER:,} are read"),
}


@pytest.mark.parametrize("case", list(ST_CASES))
def test_a_hostile_safetensors_header_is_refused_naming_it(models: Path, home: Path, tmp_path: Path,
                                                           case: str) -> None:
    content, code, words = ST_CASES[case]
    model = model_dir(models, tmp_path)
    (model / "model-00002-of-00002.safetensors").write_bytes(content)  # after the good shard: found before a copy
    refused(run_import(home, model), code, str(model / "model-00002-of-00002.safetensors"), words)
    assert stored(home) == set()


@pytest.mark.parametrize("case", ["200000-deep", "over-16-MiB", "not-json", "5000-digits"])
def test_a_hostile_config_json_is_refused_naming_it(models: Path, home: Path, tmp_path: Path, case: str) -> None:
    model = model_dir(models, tmp_path)
    config = model / "config.json"
    if case == "200000-deep":
        config.write_bytes(b'{"num_hidden_layers": 2, "x": ' + deep(200_000) + b"}")
    elif case == "over-16-MiB":
        config.write_bytes(b'{"x": "' + b"a" * (16 << 20) + b'"}')
    elif case == "not-json":
        config.write_bytes(b"{not json")
    else:
        config.write_bytes(b'{"num_hidden_layers": ' + b"9" * 5000 + b"}")
    words = {"200000-deep": "nested more than 64 levels", "over-16-MiB": "larger than"}.get(case, "is not JSON")
    refused(run_import(home, model), "invalid_json", str(config), words)
    assert stored(home) == set()


def test_the_real_models_still_import(models: Path, home: Path) -> None:
    for path, fmt in ((models / "tiny-llama", "safetensors"), (models / "tiny-llama.gguf", "gguf")):
        proc = run_import(home, path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.loads(proc.stdout)["format"] == fmt
