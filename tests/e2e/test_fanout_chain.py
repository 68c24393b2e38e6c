"""Fan-out in a chain on real agents (cp → a → b → c on loopback, no shaping), driven by fleet apply:
receivers forward verified pieces before they hold the whole file; a corrupt piece is discarded and
named where it arrives and never reaches the receivers after it; a middle receiver killed mid-copy
is resumed by the next apply, each receiver keeping the pieces it verified."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.agents import Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.models import random_gguf

pytestmark = pytest.mark.e2e
PIECE = 1 << 20
NODES = ("cp", "a", "b", "c")


class Chain:
    def __init__(self, base: Path, agents: dict[str, Agent]) -> None:
        self.base, self.agents = base, agents
        self.file = base / "fleet.yaml"
        self.models: dict[str, str] = {}

    def model(self, name: str, size: int) -> tuple[str, bytes]:
        """A GGUF-looking model of random bytes imported on cp in pieces of PIECE: its digest and bytes."""
        data = random_gguf(size)
        path = self.base / f"{name}.gguf"
        path.write_bytes(data)
        proc = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(self.agents["cp"].home), str(path),
                               "--json", "--piece-size", str(PIECE)], capture_output=True, text=True, timeout=300,
                              env=agent_env(), check=True)
        return str(json.loads(proc.stdout)["digest"]), data

    def old_model(self, name: str, size: int) -> tuple[str, bytes]:
        """The same kind of model committed on cp as a fleet from before prefix digests wrote it:
        its entry lists each piece's own sha256 (`pieces`), under the digest that pins that list."""
        from agent.weights.store import Store
        from wire import manifest as mf
        from wire import pieces

        digest, data = self.model(name, size)
        store = Store(self.agents["cp"].home)
        manifest = store.load_manifest(digest)
        (f,) = manifest["files"]
        h = pieces.Hasher(PIECE)
        h.update(data)
        del f["prefixes"]
        f["pieces"] = h.finish()
        old = mf.digest_of(manifest)
        store.commit(old, mf.validate(manifest), {f["path"]: f["sha256"]}, f"{name}-old")
        store.delete(digest)
        return old, data

    def write(self, name: str, digest: str) -> None:
        """The fleet file with every model written so far replicated to a, b and c (one left out would
        be planned for deletion)."""
        self.models[name] = digest
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in self.agents.items())
        models = "".join(f"  {m}: {{format: gguf, digest: \"{d}\", source: cp}}\n" for m, d in self.models.items())
        replicas = "".join(f"  {m}: [a, b, c]\n" for m in self.models)
        self.file.write_text(f"version: 1\ncontrol_plane: {{node: cp}}\nnodes:\n{nodes}\nmodels:\n{models}"
                             f"replicas:\n{replicas}clusters: {{}}\n")

    def apply(self, *, wait: bool = True) -> Any:
        args = [fleet_bin(), "apply", "--auto-approve", "-f", str(self.file)]
        env = agent_env(FLEET_STATE_DIR=str(self.base / "state"))
        if wait:
            return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                stdin=subprocess.DEVNULL)

    def weights(self, node: str, digest: str) -> dict[str, Any]:
        return self.agents[node].get(f"/v1/weights/{digest}").json()  # type: ignore[no-any-return]

    def part(self, node: str, data: bytes) -> bytes:
        import hashlib

        path = self.agents[node].home / "store" / "partial" / f"{hashlib.sha256(data).hexdigest()}.part"
        return path.read_bytes() if path.exists() else b""


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    base = tmp_path_factory.mktemp("chain")
    port = free_port(*(f"127.0.0.{i}" for i in range(2, 6)))
    agents = {n: Agent(n, f"127.0.0.{i}", port, base / n, args=["--verify-every", "off"])
              for i, n in enumerate(NODES, start=2)}
    try:
        for a in agents.values():
            a.start()
        yield Chain(base, agents)
    finally:
        for a in agents.values():
            a.stop()


def test_a_chain_of_three_forwards_pieces_before_the_first_holds_the_file(chain: Chain) -> None:
    size = 160 << 20
    digest, _ = chain.model("m1", size)
    chain.write("m1", digest)
    assert "prefixes" in chain.agents["cp"].get(f"/v1/manifests/{digest}").json()["files"][0]  # imported now
    applied = chain.apply()
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "from a as it arrives there" in applied.stdout and "from b as it arrives there" in applied.stdout, \
        applied.stdout
    fetch = {n: chain.weights(n, digest) for n in ("a", "b", "c")}
    assert all(w["state"] == "present" and w["integrity"]["state"] == "verified" for w in fetch.values()), fetch
    for n in ("a", "b", "c"):  # each received the file once, from its own peer
        assert fetch[n]["fetch"]["bytes_fetched"] == size, fetch[n]
    # a and b served bytes of the file to the next receiver while they were still receiving it
    assert fetch["a"]["fetch"]["bytes_forwarded"] > 0, fetch["a"]
    assert fetch["b"]["fetch"]["bytes_forwarded"] > 0, fetch["b"]
    assert fetch["c"]["fetch"]["bytes_forwarded"] == 0


def test_a_corrupt_piece_is_discarded_and_named_and_never_reaches_the_receivers_after_it(chain: Chain) -> None:
    size, bad = 96 << 20, 40
    digest, data = chain.model("m2", size)
    blob = chain.agents["cp"].home / "store" / "blobs" / __import__("hashlib").sha256(data).hexdigest()
    with open(blob, "r+b") as fh:  # the source's copy rots in piece 40 after it was imported
        fh.seek(bad * PIECE + 5)
        fh.write(bytes([data[bad * PIECE + 5] ^ 1]))
    chain.write("m2", digest)
    applied = chain.apply()
    assert applied.returncode != 0, applied.stdout
    a = chain.weights("a", digest)
    assert a["state"] == "failed" and a["code"] == "piece_corrupt", a
    for said in (f"piece {bad} ", f"{bad * PIECE:,}-", "node 'a'", digest, chain.agents["cp"].url):
        assert said in a["error"], (said, a["error"])
    assert "piece_corrupt" in applied.stdout + applied.stderr
    for n in ("a", "b", "c"):
        assert chain.weights(n, digest)["state"] != "present"
        kept = chain.part(n, data)
        # only verified pieces were kept or forwarded: a good prefix, never the bad piece
        assert len(kept) % PIECE == 0 and len(kept) <= bad * PIECE and kept == data[:len(kept)], (n, len(kept))
    assert len(chain.part("a", data)) == bad * PIECE
    with open(blob, "r+b") as fh:  # the source repaired: the next apply resumes from the last good piece
        fh.seek(bad * PIECE + 5)
        fh.write(data[bad * PIECE + 5:bad * PIECE + 6])
    again = chain.apply()
    assert again.returncode == 0, again.stdout + again.stderr
    a = chain.weights("a", digest)
    assert a["state"] == "present" and a["fetch"]["bytes_fetched"] == size - bad * PIECE, a


def test_a_middle_receiver_killed_mid_copy_is_resumed_by_the_next_apply(chain: Chain) -> None:
    size = 256 << 20
    digest, data = chain.model("m3", size)
    chain.write("m3", digest)
    proc = chain.apply(wait=False)
    b = chain.agents["b"]
    deadline, killed_at = time.monotonic() + 120, None
    while time.monotonic() < deadline and killed_at is None:
        jobs = [j for j in b.get("/v1/state").json()["fetches"] if j["digest"] == digest]
        if jobs and 8 * PIECE <= jobs[0]["bytes_done"] < size // 2:
            b.stop(signal.SIGKILL)
            killed_at = jobs[0]["bytes_done"]
        time.sleep(0.005)
    assert killed_at is not None, "b never was mid-copy"
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    assert chain.weights("c", digest)["state"] != "present"
    kept_b = chain.part("b", data)
    assert len(kept_b) >= killed_at - PIECE and kept_b == data[:len(kept_b)]
    b.start()
    again = chain.apply()
    assert again.returncode == 0, again.stdout + again.stderr
    for n in ("a", "b", "c"):
        w = chain.weights(n, digest)
        assert w["state"] == "present" and w["integrity"]["state"] == "verified", (n, w)
    w = chain.weights("b", digest)
    if w.get("fetch"):  # fetched again: only from the last whole piece it had before the kill
        assert w["fetch"]["bytes_fetched"] <= size - len(kept_b) // PIECE * PIECE, w


def test_a_model_imported_with_piece_hashes_before_prefixes_is_still_fetched_and_forwarded(chain: Chain) -> None:
    size = 64 << 20
    digest, data = chain.old_model("m4", size)
    chain.write("m4", digest)
    applied = chain.apply()
    assert applied.returncode == 0, applied.stdout + applied.stderr
    for n in ("a", "b", "c"):
        w = chain.weights(n, digest)
        assert w["state"] == "present" and w["integrity"]["state"] == "verified", (n, w)
        assert w["fetch"]["bytes_fetched"] == size, (n, w)
        assert "pieces" in chain.agents[n].get(f"/v1/manifests/{digest}").json()["files"][0]
    assert chain.weights("a", digest)["fetch"]["bytes_forwarded"] > 0
