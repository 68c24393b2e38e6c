"""Weights between real agents on loopback: import, replicate onward, resume after SIGKILL,
corruption caught, layer slices, and untrusted input refused."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from safetensors.numpy import load_file

from tests.agents import SECRET, Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import import_model
from tests.models import gguf_header, random_gguf, tiny_gguf, tiny_safetensors
from wire import manifest as mf
from wire.layers import LayerRange
from wire.pieces import sized

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {SECRET}"}
ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def put(agent: Agent, digest: str, peer: Agent, **extra: Any) -> httpx.Response:
    return httpx.put(f"{agent.url}/v1/weights/{digest}", json={"peer": peer.url, **extra}, headers=AUTH, timeout=10)


def wait(agent: Agent, digest: str) -> dict[str, Any]:
    return agent.wait_for(f"/v1/weights/{digest}", ("present", "failed"), every=0.02)


def blob_bytes(agent: Agent, digest: str) -> dict[str, bytes]:
    model_dir = agent.home / "store" / "models" / digest[7:]
    return {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("models")
    return tiny_safetensors(base), tiny_gguf(base)


@pytest.fixture(scope="module")
def trio_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Agent]]:
    base = tmp_path_factory.mktemp("weights")
    port = free_port(*ADDRS)
    agents = [Agent(f"n{i}", addr, port, base / f"n{i}") for i, addr in enumerate(ADDRS)]
    try:
        yield [a.start() for a in agents]
    finally:
        for a in agents:
            a.stop()


def test_replicates_onward_byte_for_byte(trio_agents: list[Agent], models: tuple[Path, Path]) -> None:
    a, b, c = trio_agents
    for model in models:
        digest = import_model(a, model)
        assert put(b, digest, a, name=model.name).status_code == 202
        assert wait(b, digest)["state"] == "present"
        assert put(c, digest, b).status_code == 202  # from the copy b verified, not from the source
        done = wait(c, digest)
        assert done["state"] == "present", done
        assert blob_bytes(a, digest) == blob_bytes(b, digest) == blob_bytes(c, digest)
        held = {w["digest"]: w for w in c.get("/v1/state").json()["weights"]}
        assert held[digest]["bytes"] == sum(len(v) for v in blob_bytes(a, digest).values())
        assert held[digest]["format"] == ("gguf" if model.suffix == ".gguf" else "safetensors")
        assert Path(held[digest]["path"]).exists()
        # A second PUT of a held model does nothing.
        assert put(c, digest, b).json()["state"] == "present"


def test_corrupt_peer_is_named_and_bad_bytes_are_not_kept(trio_agents: list[Agent], tmp_path: Path) -> None:
    a, b, _ = trio_agents
    src = tmp_path / "corrupt.gguf"
    src.write_bytes(random_gguf((3 << 20) + 4))
    digest = import_model(a, src)
    sha = json.loads(a.get(f"/v1/manifests/{digest}").content)["files"][0]["sha256"]
    blob = a.home / "store" / "blobs" / sha
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    put(b, digest, a)
    result = wait(b, digest)
    assert result["state"] == "failed" and result["resumable"] is False  # asking again would fetch the same bytes
    assert "digest mismatch" in result["error"] and a.url in result["error"] and "corrupt.gguf" in result["error"]
    assert not (b.home / "store" / "blobs" / sha).exists()
    assert list((b.home / "store" / "partial").glob(f"{sha}*")) == []
    assert digest not in [w["digest"] for w in b.get("/v1/state").json()["weights"]]


def test_slice_of_layers_2_3(trio_agents: list[Agent], models: tuple[Path, Path]) -> None:
    a, _, c = trio_agents
    full_digest = import_model(a, models[0])
    full = json.loads(a.get(f"/v1/manifests/{full_digest}").content)
    slice_digest = mf.digest_of(mf.make_slice(full, full_digest, LayerRange(2, 3)))  # what a plan promises
    assert put(c, slice_digest, a, source_digest=full_digest, layers="2-3").status_code == 202
    result = wait(c, slice_digest)
    assert result["state"] == "present", result
    tensors = load_file(str(c.home / "store" / "models" / slice_digest[7:] / "model.safetensors"))
    expected = {n for n in load_file(str(models[0] / "model.safetensors"))
                if any(f"layers.{i}." in n for i in (2, 3))} | {"model.norm.weight", "lm_head.weight"}
    assert set(tensors) == expected  # the last slice: plus the final norm and the head, no embeddings
    original = load_file(str(models[0] / "model.safetensors"))
    assert all((tensors[n] == original[n]).all() for n in tensors)
    entry = {w["digest"]: w for w in c.get("/v1/state").json()["weights"]}[slice_digest]
    assert entry["slice"] == {"of": full_digest, "layers": "2-3", "total_layers": 4}
    full_bytes = sum(f["size"] for f in full["files"])
    progress = c.get(f"/v1/weights/{slice_digest}").json()
    assert progress["bytes"] < full_bytes
    assert 0 < result["fetch"]["bytes_fetched"] < full_bytes  # only the slice's bytes crossed the wire
    held = c.home / "store" / "models" / slice_digest[7:]
    assert (held / "config.json").exists() and not (held / "tokenizer.json").exists()  # the first slice tokenises


def test_a_wrong_slice_digest_is_refused(trio_agents: list[Agent], models: tuple[Path, Path]) -> None:
    a, b, _ = trio_agents
    full_digest = import_model(a, models[0])
    wrong = "sha256:" + "0" * 64
    put(b, wrong, a, source_digest=full_digest, layers="0-1")
    result = wait(b, wrong)
    assert result["state"] == "failed" and "not the " + wrong in result["error"]


@pytest.mark.parametrize("method, path, body, status", [
    ("GET", "/v1/weights/sha256:abc", None, 400),
    ("GET", "/v1/weights/..%2F..%2Fidentity.json", None, 404),
    ("GET", "/v1/blobs/" + "g" * 64, None, 400),
    ("GET", "/v1/blobs/..%2Fidentity.json", None, 404),
    ("GET", "/v1/manifests/sha256:" + "a" * 64, None, 404),
    ("PUT", "/v1/weights/sha256:" + "a" * 64, {"peer": "file:///etc/passwd"}, 400),
    ("PUT", "/v1/weights/sha256:" + "a" * 64, {"peer": "http://127.0.0.2:1/x?y"}, 400),
    ("PUT", "/v1/weights/sha256:" + "a" * 64, {"peer": "http://127.0.0.2:1", "layers": "3-1",
                                               "source_digest": "sha256:" + "b" * 64}, 400),
    ("PUT", "/v1/weights/sha256:" + "a" * 64, {"peer": "http://127.0.0.2:1", "layers": "0-1"}, 400),
    ("PUT", "/v1/weights/sha256:" + "a" * 64, {"peer": "http://127.0.0.2:1", "name": "x\x00y"}, 400),
    ("DELETE", "/v1/weights/sha256:" + "a" * 64, None, 404),
    # A pattern guards the whole name: `$` under re.match let a final newline through.
    ("GET", "/v1/weights/sha256:" + "a" * 64 + "%0A", None, 400),
    ("GET", "/v1/blobs/" + "a" * 64 + "%0A", None, 400),
    ("PUT", "/v1/weights/sha256:" + "a" * 64, {"peer": "http://127.0.0.2:1\n"}, 400),
    ("POST", "/v1/servers", {"id": "chat@n0\n", "model": "sha256:" + "a" * 64, "port": 9000}, 400),
])
def test_untrusted_input_is_refused(trio_agents: list[Agent], method: str, path: str, body: Any, status: int) -> None:
    r = httpx.request(method, trio_agents[0].url + path, json=body, headers=AUTH, timeout=10)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"] if "error" in r.json() else r.json()["state"] == "absent"


def test_range_past_the_end_is_refused(trio_agents: list[Agent], models: tuple[Path, Path]) -> None:
    a = trio_agents[0]
    digest = import_model(a, models[1])
    f = json.loads(a.get(f"/v1/manifests/{digest}").content)["files"][0]
    r = httpx.get(f"{a.url}/v1/blobs/{f['sha256']}", headers={**AUTH, "Range": f"bytes={f['size']}-"}, timeout=10)
    assert r.status_code == 416
    r = httpx.get(f"{a.url}/v1/blobs/{f['sha256']}", headers={**AUTH, "Range": "bytes=4-11"}, timeout=10)
    assert r.status_code == 206 and r.content == models[1].read_bytes()[4:12]


def test_delete_removes_the_model_and_its_blobs(trio_agents: list[Agent], tmp_path: Path) -> None:
    a = trio_agents[0]
    src = tmp_path / "gone.gguf"
    src.write_bytes(random_gguf(4100))
    digest = import_model(a, src)
    sha = json.loads(a.get(f"/v1/manifests/{digest}").content)["files"][0]["sha256"]
    r = httpx.delete(f"{a.url}/v1/weights/{digest}", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "deleted"
    assert a.get(f"/v1/weights/{digest}").status_code == 404
    assert not (a.home / "store" / "blobs" / sha).exists()
    assert src.exists()  # the original was never touched


def test_resume_after_sigkill_at_random_points(tmp_path: Path) -> None:
    """Kill the fetching agent at several random points of a 96 MiB transfer; each restart and
    repeated PUT continues from what is on disk. The model is never reported present early."""
    port = free_port("127.0.0.2", "127.0.0.3")
    src_agent = Agent("src", "127.0.0.2", port, tmp_path / "src").start()
    dst = Agent("dst", "127.0.0.3", port, tmp_path / "dst")
    try:
        size = 96 << 20
        model = tmp_path / "big.gguf"
        model.write_bytes(random_gguf(size))
        digest = import_model(src_agent, model)
        sha = json.loads(src_agent.get(f"/v1/manifests/{digest}").content)["files"][0]["sha256"]
        partial = dst.home / "store" / "partial" / f"{sha}.part"
        rng = random.Random(1234)
        kill_at = sorted(rng.uniform(0.1, 0.8) for _ in range(3))
        kept_before = 0
        transferred = 0
        for fraction in kill_at:
            dst.start()
            assert dst.get(f"/v1/weights/{digest}").status_code == 404  # a partial is not present
            assert digest not in [w["digest"] for w in dst.get("/v1/state").json()["weights"]]
            put(dst, digest, src_agent)
            deadline = time.monotonic() + 60
            # Watch the partial file itself: a stat is cheap enough to poll finely, so the kill
            # lands near its mark even when the transfer runs at hundreds of MB/s.
            while not partial.exists() or partial.stat().st_size < fraction * size:
                assert time.monotonic() < deadline
                time.sleep(0.0005)
            dst.stop(signal.SIGKILL)
            on_disk = partial.stat().st_size
            assert kept_before <= on_disk <= size
            transferred += on_disk - kept_before
            kept_before = on_disk
        dst.start()
        put(dst, digest, src_agent)
        result = wait(dst, digest)
        assert result["state"] == "present", result
        final = dst.get(f"/v1/weights/{digest}").json()
        assert final["state"] == "present"
        transferred += size - kept_before
        assert transferred < 1.5 * size
        assert (dst.home / "store" / "blobs" / sha).read_bytes() == model.read_bytes()
        assert not partial.exists()
    finally:
        src_agent.stop()
        dst.stop()


SIZE_KILLED = 256 << 20  # still copying when the kill comes after a poll's answer (below)


@contextmanager
def killed_mid_transfer(tmp_path: Path) -> Iterator[tuple[Agent, Agent, str, dict[str, Any]]]:
    """Two agents; dst fetches a model of SIZE_KILLED bytes from src, which is killed (SIGKILL) once
    dst holds an eighth of it: (src, dst, the digest, dst's failed fetch). Both are stopped after."""
    port = free_port("127.0.0.2", "127.0.0.3")
    src = Agent("src", "127.0.0.2", port, tmp_path / "src").start()
    dst = Agent("dst", "127.0.0.3", port, tmp_path / "dst").start()
    try:
        # Large enough that the copy is still going when the kill comes after the poll's answer: a
        # receiver hashing each byte once copied 64 MiB between a poll and the kill at load 3.
        model = tmp_path / "m.gguf"
        model.write_bytes(random_gguf(SIZE_KILLED))
        digest = import_model(src, model)
        put(dst, digest, src)
        while dst.get(f"/v1/weights/{digest}").json()["bytes_done"] < SIZE_KILLED // 8:
            time.sleep(0.002)
        src.stop(signal.SIGKILL)
        yield src, dst, digest, wait(dst, digest)
    finally:
        src.stop()
        dst.stop()


def test_resume_after_the_peer_dies_mid_transfer(tmp_path: Path) -> None:
    with killed_mid_transfer(tmp_path) as (src, dst, digest, failed):
        assert failed["state"] == "failed" and src.url in failed["error"]
        assert failed["resumable"] is True  # what arrived is kept: the executor asks again to resume
        assert dst.proc is not None and dst.proc.poll() is None  # the fetching agent is unharmed
        src.start()
        put(dst, digest, src)
        done = wait(dst, digest)
        assert done["state"] == "present", done
        assert 0 < done["fetch"]["bytes_fetched"] < SIZE_KILLED  # the second job fetched only what was missing


def test_a_delete_after_a_failed_fetch_removes_what_it_kept_for_a_resume(tmp_path: Path) -> None:
    """Nothing else removes a failed fetch's partial file (a restart keeps it, for a resume): a
    DELETE of its digest does, says how much, and forgets the fetch; the next DELETE finds nothing."""
    with killed_mid_transfer(tmp_path) as (_, dst, digest, failed):
        assert failed["state"] == "failed" and failed["resumable"] is True, failed
        partial = dst.home / "store" / "partial"
        kept = sum(p.stat().st_size for p in partial.iterdir())
        assert kept >= SIZE_KILLED // 8
        r = httpx.delete(f"{dst.url}/v1/weights/{digest}", headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json() == {"digest": digest, "state": "deleted", "partial_bytes_removed": kept}
        assert list(partial.iterdir()) == []
        assert dst.get(f"/v1/weights/{digest}").json()["state"] == "absent"
        again = httpx.delete(f"{dst.url}/v1/weights/{digest}", headers=AUTH, timeout=10)
        assert again.status_code == 404 and again.json()["error"]["code"] == "weights_not_held"


# ---- disk work off the event loop, and a disk that is (nearly) full ----

def sparse_gguf(path: Path, size: int, length: int | None = None) -> Path:
    """A GGUF of `size` bytes, nearly all a hole: hashing it costs CPU, writing it nothing (only its
    first `length` bytes, when given: what an earlier attempt at fetching it kept)."""
    with open(path, "wb") as fh:
        fh.write(gguf_header(size))
        fh.truncate(size if length is None else length)
    return path


def hashed_in(seconds: float) -> int:
    """About how many bytes this machine hashes in `seconds` (sha256 of zeros, as a sparse file
    reads), in whole MiB, so that a test of what happens during hashing lasts about that long."""
    block, began, done = bytes(8 << 20), time.monotonic(), 0
    h = hashlib.sha256()
    while time.monotonic() - began < 0.25:
        h.update(block)
        done += len(block)
    rate = done / (time.monotonic() - began)
    return int(min(max(rate * seconds, 256 << 20), 16 << 30)) >> 20 << 20


def import_linked(agent: Agent, path: Path) -> str:
    proc = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(agent.home), str(path), "--json",
                           "--link"], capture_output=True, text=True, timeout=300, env=agent_env(), check=True)
    return str(json.loads(proc.stdout)["digest"])


def test_a_resume_rehashes_what_it_finds_without_stalling_the_api(tmp_path: Path) -> None:
    """A fetch that finds all but the last byte of a model on disk re-hashes it (sized to take
    about 3 s here) and fetches its last piece again; GET /v1/state answers meanwhile as usual."""
    port = free_port("127.0.0.2", "127.0.0.3")
    src = Agent("src", "127.0.0.2", port, tmp_path / "src", args=["--verify-every", "off"]).start()
    dst = Agent("dst", "127.0.0.3", port, tmp_path / "dst", args=["--verify-every", "off"]).start()
    try:
        size = hashed_in(3)
        digest = import_linked(src, sparse_gguf(tmp_path / "big.gguf", size))
        entry = json.loads(src.get(f"/v1/manifests/{digest}").content)["files"][0]
        sha, piece = entry["sha256"], entry["piece_bytes"]
        assert piece == sized(size) and "prefixes" in entry  # an import's pieces, by the file's size
        sparse_gguf(dst.home / "store" / "partial" / f"{sha}.part", size, size - 1)  # an earlier attempt's bytes
        began = time.monotonic()
        assert put(dst, digest, src).status_code == 202
        slowest = 0.0
        while True:
            asked = time.monotonic()
            progress = dst.get(f"/v1/weights/{digest}").json()
            assert dst.get("/v1/state").status_code == 200
            slowest = max(slowest, (time.monotonic() - asked) / 2)
            if progress["state"] != "fetching":
                break
            time.sleep(0.01)
        took = time.monotonic() - began
        assert progress["state"] == "present", progress
        # The whole pieces found on disk were verified and kept; the unfinished last one (a torn
        # tail after a crash looks the same) is fetched again.
        assert progress["fetch"]["bytes_fetched"] == size - (size - 1) // piece * piece
        assert took > 1, took  # long enough for a stall to show
        assert slowest < took / 3, (slowest, took)
    finally:
        src.stop()
        dst.stop()


@contextmanager
def tmpfs(path: Path, size: str = "50m") -> Iterator[Path]:
    """A real small filesystem (root only): skipped, saying why, where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs (needs root and CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def free(path: Path) -> int:
    return shutil.disk_usage(path).free


def test_a_fetch_past_the_reserve_is_refused_naming_node_and_free_space(tmp_path: Path) -> None:
    port = free_port("127.0.0.2", "127.0.0.3")
    src = Agent("src", "127.0.0.2", port, tmp_path / "src", args=["--verify-every", "off"]).start()
    with tmpfs(tmp_path / "small") as small:
        dst = Agent("dst", "127.0.0.3", port, small / "dst").start()  # default reserve: a tenth of 50 MiB
        try:
            model = tmp_path / "big.gguf"
            model.write_bytes(random_gguf(64 << 20))  # more than the whole disk
            digest = import_model(src, model)
            disk = dst.get("/v1/state").json()["inventory"]["disk"]
            assert disk["reserve_bytes"] == (50 << 20) // 10
            before = free(small)
            put(dst, digest, src)
            failed = wait(dst, digest)
            assert failed["state"] == "failed" and failed["code"] == "disk_full" and not failed["resumable"], failed
            assert "disk full on node 'dst'" in failed["error"] and "bytes free" in failed["error"], failed
            assert f"{disk['reserve_bytes']:,} in reserve" in failed["error"], failed
            assert list((small / "dst" / "store" / "partial").iterdir()) == []
            assert free(small) >= before - (64 << 10), (free(small), before)  # nothing was written
        finally:
            dst.stop()
            src.stop()


def test_two_fetches_that_fit_only_one_at_a_time(tmp_path: Path) -> None:
    """Each fits the free space alone: the second one started is refused, naming what the first
    has promised, instead of both failing halfway with the disk full."""
    port = free_port("127.0.0.2", "127.0.0.3")
    src = Agent("src", "127.0.0.2", port, tmp_path / "src", args=["--verify-every", "off"]).start()
    with tmpfs(tmp_path / "small") as small:
        dst = Agent("dst", "127.0.0.3", port, small / "dst", args=["--disk-reserve", "0"]).start()
        try:
            digests = []
            for i in range(2):
                model = tmp_path / f"m{i}.gguf"
                model.write_bytes(random_gguf(30 << 20))
                digests.append(import_model(src, model))
            for d in digests:
                put(dst, d, src)
            results = [wait(dst, d) for d in digests]
            assert sorted(r["state"] for r in results) == ["failed", "present"], results
            refused = next(r for r in results if r["state"] == "failed")
            assert refused["code"] == "disk_full" and "promised to fetches running" in refused["error"], refused
            assert [p.name for p in (small / "dst" / "store" / "partial").iterdir()] == []
        finally:
            dst.stop()
            src.stop()


class SlowPeer:
    """A peer serving one GGUF model: its manifest, then its blob, held halfway until `go` is set."""

    def __init__(self, address: str, port: int, data: bytes, held_at: int) -> None:
        sha = hashlib.sha256(data).hexdigest()
        manifest = {"version": 1, "format": "gguf", "layers": None, "slice": None,
                    "files": [{"path": "m.gguf", "size": len(data), "sha256": sha}]}
        self.digest, self.go = mf.digest_of(manifest), threading.Event()
        routes = {f"/v1/manifests/{self.digest}": mf.canonical(manifest), f"/v1/blobs/{sha}": data}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = routes[self.path]
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:held_at])
                if len(body) > held_at:
                    outer.go.wait(60)
                    self.wfile.write(body[held_at:])

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((address, port), Handler)
        self.url = f"http://{address}:{port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.go.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_disk_that_fills_during_a_fetch_is_named_and_given_back(tmp_path: Path) -> None:
    """The fetch fits when it starts; something else fills the disk while it runs: it fails as
    disk_full naming the node and the free space, not as a resumable broken connection, and its
    partial file is removed."""
    port = free_port("127.0.0.2", "127.0.0.3")
    peer = SlowPeer("127.0.0.2", port, b"GGUF" + os.urandom((30 << 20) - 4), held_at=10 << 20)
    with tmpfs(tmp_path / "small") as small:
        dst = Agent("dst", "127.0.0.3", port, small / "dst", args=["--disk-reserve", "0"]).start()
        try:
            before = free(small)
            assert httpx.put(f"{dst.url}/v1/weights/{peer.digest}", json={"peer": peer.url}, headers=AUTH,
                             timeout=10).status_code == 202
            partial = small / "dst" / "store" / "partial"
            deadline = time.monotonic() + 30
            while sum(p.stat().st_size for p in partial.iterdir()) < 10 << 20:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with open(small / "filler", "wb") as filler:  # another writer takes what is left
                try:
                    while True:
                        filler.write(b"\0" * (1 << 20))
                        filler.flush()
                except OSError:
                    pass
            peer.go.set()
            failed = wait(dst, peer.digest)
            assert failed["state"] == "failed" and failed["code"] == "disk_full" and not failed["resumable"], failed
            assert "disk full on node 'dst' while writing" in failed["error"] and "bytes free" in failed["error"]
            assert "partial file was removed" in failed["error"], failed
            assert list(partial.iterdir()) == []
            (small / "filler").unlink()
            assert free(small) >= before - (64 << 10), (free(small), before)  # the space is given back
        finally:
            dst.stop()
            peer.close()


def test_what_a_dead_process_left_half_written_is_removed_at_start(tmp_path: Path) -> None:
    agent = Agent("n", "127.0.0.2", free_port("127.0.0.2"), tmp_path / "n", args=["--verify-every", "off"]).start()
    agent.stop()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has any more
    store = agent.home / "store"
    left = [store / "partial" / f".import-{gone.pid}-0123456789abcdef", store / "models" / f".tmp-{'a' * 64}-{gone.pid}",
            store / "meta" / f".{'b' * 64}.json.{gone.pid}-1.tmp"]
    kept = [store / "partial" / f"{'c' * 64}.part",  # a fetch resumes it
            store / "partial" / f".import-{os.getpid()}-0123456789abcdef"]  # its importer still runs
    left[1].mkdir()
    (left[1] / "config.json").write_text("{}")
    for p in [left[0], left[2], *kept]:
        p.write_bytes(b"x" * 1000)
    agent.start()
    try:
        assert [p for p in left if p.exists()] == [] and all(p.exists() for p in kept)
    finally:
        agent.stop()
