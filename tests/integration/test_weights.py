"""Weights between real agents on loopback: import, replicate onward, resume after SIGKILL,
corruption caught, layer slices, and untrusted input refused."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from safetensors.numpy import load_file

from tests.agents import SECRET, Agent, free_port
from tests.fleets import import_model
from tests.models import tiny_gguf, tiny_safetensors
from wire import manifest as mf
from wire.layers import LayerRange

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
    src.write_bytes(b"GGUF" + os.urandom(3 << 20))
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
    src.write_bytes(b"GGUF" + os.urandom(4096))
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
        model.write_bytes(b"GGUF" + os.urandom(size - 4))
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


def test_resume_after_the_peer_dies_mid_transfer(tmp_path: Path) -> None:
    port = free_port("127.0.0.2", "127.0.0.3")
    src = Agent("src", "127.0.0.2", port, tmp_path / "src").start()
    dst = Agent("dst", "127.0.0.3", port, tmp_path / "dst").start()
    try:
        size = 64 << 20
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF" + os.urandom(size - 4))
        digest = import_model(src, model)
        put(dst, digest, src)
        while dst.get(f"/v1/weights/{digest}").json()["bytes_done"] < size // 3:
            time.sleep(0.002)
        src.stop(signal.SIGKILL)
        failed = wait(dst, digest)
        assert failed["state"] == "failed" and src.url in failed["error"]
        assert failed["resumable"] is True  # what arrived is kept: the executor asks again to resume
        assert dst.proc is not None and dst.proc.poll() is None  # the fetching agent is unharmed
        src.start()
        put(dst, digest, src)
        done = wait(dst, digest)
        assert done["state"] == "present", done
        assert 0 < done["fetch"]["bytes_fetched"] < size  # the second job fetched only what was missing
    finally:
        src.stop()
        dst.stop()
