"""bench/encrypted: the load time of an encrypted model against the same model in plaintext, on one
real agent: the time from POST /v1/servers to `running`, for SmolLM2-135M-Instruct as GGUF
(llama.cpp, 98 MB Q4_1) and as float32 safetensors (PyTorch, 540 MB), each imported twice (plain,
and with --encrypt), started alternately. Also printed: decrypting the model into memfds alone
(agent/weights/unseal.py: AES-256-GCM, tags and plaintext sha256 checked) against reading and hashing the
plain files, in this process. Target: no more than the decryption's own time added to a start.

    .venv/bin/python bench/encrypted.py [--runs 2] [--tiny]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from agent.weights.sealed import parse_key  # noqa: E402
from agent.weights.store import Store  # noqa: E402
from agent.weights.unseal import Unsealer  # noqa: E402
from tests.agents import SECRET, Agent, agent_env, free_port  # noqa: E402
from tests.conftest import fleet_bin  # noqa: E402
from tests.models import smollm2_gguf, smollm2_safetensors, tiny_gguf, tiny_safetensors  # noqa: E402

AUTH = {"Authorization": f"Bearer {SECRET}"}
ROOT = Path(__file__).resolve().parent.parent


def imported(agent: Agent, src: Path, encrypt: bool) -> str:
    proc = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(agent.home), str(src), "--json",
                           "--name", src.name + ("-sealed" if encrypt else ""), *(["--encrypt"] if encrypt else [])],
                          capture_output=True, text=True, timeout=600, env=agent_env(**agent.env), check=True)
    return str(json.loads(proc.stdout)["digest"])


def start_to_running(agent: Agent, sid: str, digest: str) -> float:
    port = free_port(agent.address)
    t0 = time.monotonic()
    r = httpx.post(f"{agent.url}/v1/servers", headers=AUTH, timeout=30, json={
        "id": sid, "model": digest, "port": port, "settings": {"context_length": 512, "threads": 2,
                                                                "startup_timeout_s": 300}})
    r.raise_for_status()
    s = agent.wait_for(f"/v1/servers/{sid}", ("running", "failed"), timeout=300, every=0.02)
    took = time.monotonic() - t0
    assert s["state"] == "running", s["reason"]
    httpx.delete(f"{agent.url}/v1/servers/{sid}", headers=AUTH, timeout=60).raise_for_status()
    return took


def plain_read(store: Store, digest: str) -> None:
    for f in store.load_manifest(digest)["files"]:
        h = hashlib.sha256()
        with open(store.model_dir(digest) / f["path"], "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="the tiny test models instead of SmolLM2 (a smoke run)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-bench-sealed-") as tmp:
        base = Path(tmp)
        key = base / "weights.key"
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        if args.tiny:
            models = {"gguf": tiny_gguf(base / "m"), "safetensors": tiny_safetensors(base / "m")}
        else:
            models = {"gguf": smollm2_gguf(),
                      "safetensors": smollm2_safetensors(ROOT / ".pytest_cache" / "d" / "fleet-models")}
        agent = Agent("bench", "127.0.0.2", free_port("127.0.0.2"), base / "agent", args=["--verify-every", "off"],
                      env={"FLEET_WEIGHTS_KEY_FILE": str(key)}).start()
        try:
            digests = {(fmt, enc): imported(agent, src, enc) for fmt, src in models.items() for enc in (False, True)}
            store = Store(agent.home, parse_key(key.read_bytes(), "key"))
            (base / "links").mkdir(exist_ok=True)
            unsealer = Unsealer(store, base / "links")
            print(f"{'model':<12} {'what':<28} {'plain s':>8} {'sealed s':>9} {'ratio':>6}")
            for fmt in models:
                size = sum(f["size"] for f in store.load_manifest(digests[fmt, False])["files"])
                starts: dict[bool, list[float]] = {False: [], True: []}
                reads: dict[bool, list[float]] = {False: [], True: []}
                for i in range(args.runs):
                    for enc in (False, True):
                        starts[enc].append(start_to_running(agent, f"b{i}-{fmt}-{int(enc)}", digests[fmt, enc]))
                        t0 = time.monotonic()
                        if enc:
                            entry = store.entry(digests[fmt, True])
                            opened = unsealer.prepare("x", entry)
                            unsealer.open(opened, entry)
                            unsealer.close(opened)
                        else:
                            plain_read(store, digests[fmt, False])
                        reads[enc].append(time.monotonic() - t0)
                name = f"{fmt} {size / 1e6:.0f}MB"
                for what, got in (("start to running", starts), ("read+hash / decrypt to memfd", reads)):
                    p, s = statistics.median(got[False]), statistics.median(got[True])
                    print(f"{name:<12} {what:<28} {p:8.2f} {s:9.2f} {s / p:6.2f}")
        finally:
            agent.stop()


if __name__ == "__main__":
    main()
