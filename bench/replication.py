"""bench/replication: copy a large weight file between two real agents on loopback and print its
throughput next to references measured in the same run: the same file sent with os.sendfile over a
plain socket, received with plain socket reads, hashed with hashlib.sha256 and written to disk — the
fewest steps that still verify and store; and the machine's own limits, hashlib.sha256 over the same
bytes and a plain write of them with fsync (dd conv=fsync). Targets: fleet >= 0.8 x the sendfile
reference and >= 0.8 x the lower of the two limits, digest verified (fleet also checks every piece).

    .venv/bin/python bench/replication.py [--gib 1.0] [--runs 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from tests.agents import SECRET, Agent, agent_env, free_port  # noqa: E402
from tests.conftest import fleet_bin  # noqa: E402
from tests.models import gguf_header  # noqa: E402

CHUNK = 1 << 20


def make_file(path: Path, size: int) -> str:
    h = hashlib.sha256()
    block = os.urandom(64 << 20)
    with open(path, "wb") as fh:
        header = gguf_header(size)  # a valid GGUF: fleet-agent import checks the header
        fh.write(header)
        h.update(header)
        left = size - len(header)
        while left:
            piece = block[: min(len(block), left)]
            fh.write(piece)
            h.update(piece)
            left -= len(piece)
    return h.hexdigest()


def reference(src: Path, dest: Path, expected: str) -> float:
    """sendfile → socket → recv_into → sha256 → write → fsync. Returns seconds."""
    size = src.stat().st_size
    server = socket.socket()
    server.bind(("127.0.0.2", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def send() -> None:
        conn, _ = server.accept()
        with conn, open(src, "rb") as fh:
            sent = 0
            while sent < size:
                sent += os.sendfile(conn.fileno(), fh.fileno(), sent, size - sent)

    t = threading.Thread(target=send)
    t.start()
    start = time.perf_counter()
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.2", port)) as s, open(dest, "wb") as out:
        got = 0
        while got < size:
            n = s.recv_into(buf)
            if not n:
                raise RuntimeError("reference: connection closed early")
            h.update(view[:n])
            out.write(view[:n])
            got += n
        out.flush()
        os.fsync(out.fileno())
    elapsed = time.perf_counter() - start
    t.join()
    server.close()
    assert h.hexdigest() == expected, "reference: digest mismatch"
    return elapsed


def hash_rate(src: Path) -> float:
    """Bytes per second of hashlib.sha256 over the file (read from the page cache)."""
    h = hashlib.sha256()
    start = time.perf_counter()
    with open(src, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return src.stat().st_size / (time.perf_counter() - start)


def write_rate(src: Path, dest: Path) -> float:
    """Bytes per second of a plain write of the file's bytes to `dest`, fsynced (dd conv=fsync)."""
    size = src.stat().st_size
    with open(src, "rb") as fh:  # read first into memory pages that stay hot: only the write is timed
        data = [fh.read(64 << 20) for _ in range(0, size, 64 << 20)]
    start = time.perf_counter()
    with open(dest, "wb") as out:
        for block in data:
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    took = time.perf_counter() - start
    dest.unlink()
    return size / took


def fleet(src_agent: Agent, dst: Agent, model: Path) -> tuple[float, str]:
    proc = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(src_agent.home), str(model),
                           "--link", "--json"], capture_output=True, text=True, env=agent_env(), check=True)
    digest = json.loads(proc.stdout)["digest"]
    auth = {"Authorization": f"Bearer {SECRET}"}
    start = time.perf_counter()
    r = httpx.put(f"{dst.url}/v1/weights/{digest}", json={"peer": src_agent.url}, headers=auth, timeout=30)
    r.raise_for_status()
    while True:
        body = httpx.get(f"{dst.url}/v1/weights/{digest}", headers=auth, timeout=30).json()
        if body["state"] == "present":
            print(f"        (fleet job: {body['fetch']['rate_bytes_per_s'] / 1e6:.0f} MB/s from its start to its end)")
            break
        if body["state"] == "failed":
            raise RuntimeError(body["error"])
        time.sleep(0.05)  # each poll costs both processes CPU: poll gently
    elapsed = time.perf_counter() - start
    httpx.delete(f"{dst.url}/v1/weights/{digest}", headers=auth, timeout=30).raise_for_status()
    return elapsed, digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    size = int(args.gib * (1 << 30))
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        base = Path(tmp)
        model = base / "big.gguf"
        expected = make_file(model, size)
        port = free_port("127.0.0.2", "127.0.0.3")
        src_agent = Agent("src", "127.0.0.2", port, base / "src").start()
        dst = Agent("dst", "127.0.0.3", port, base / "dst").start()
        try:
            print(f"file: {size / (1 << 30):.2f} GiB, sha256 {expected[:16]}…; both ends on this machine's "
                  f"{os.cpu_count()} cores")
            rows = []
            limits = []
            for run in range(args.runs):
                ref = reference(model, base / "ref.out", expected)
                (base / "ref.out").unlink()
                sha, write = hash_rate(model), write_rate(model, dst.home / "write.out")
                took, digest = fleet(src_agent, dst, model)
                rows.append((size / ref, size / took))
                limits.append(min(sha, write))
                print(f"run {run + 1}: reference {size / ref / 1e6:7.0f} MB/s   fleet {size / took / 1e6:7.0f} MB/s"
                      f"   ratio {ref / took:.2f};   sha256 {sha / 1e6:5.0f} MB/s, write+fsync {write / 1e6:5.0f} MB/s,"
                      f" fleet / lower {size / took / min(sha, write):.2f}")
            ref_best = max(r for r, _ in rows)
            fleet_best = max(f for _, f in rows)
            ratios = sorted(f / r for r, f in rows)
            print(f"best: reference {ref_best / 1e6:.0f} MB/s, fleet {fleet_best / 1e6:.0f} MB/s, "
                  f"ratio of bests {fleet_best / ref_best:.2f}; median of per-run ratios "
                  f"{statistics.median(ratios):.2f} (target >= 0.80)")
            to_limit = sorted(f / lim for (_, f), lim in zip(rows, limits))
            print(f"fleet against the machine's lower limit (sha256 or write+fsync): median "
                  f"{statistics.median(to_limit):.2f}, best {to_limit[-1]:.2f} (target >= 0.80)")
        finally:
            src_agent.stop()
            dst.stop()


if __name__ == "__main__":
    main()
