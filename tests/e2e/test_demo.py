"""The README's first command: `fleet demo` does fleet's whole job with a real model, both engines
answer a real question, writes nothing outside its directory, and with --keep leaves a fleet a user
can talk to and stop as it says, after which nothing of it is left. Run once: it is the suite's
longest test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from reconciler.cli.demo import QUESTION
from tests.conftest import fleet_bin

pytestmark = pytest.mark.e2e
FIRST = "127.0.0.30"  # its own addresses, so it can run beside the other tests


def processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def demo(demo_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # The first run converts the model (a minute or two on a busy 2-core machine) before serving it.
    return subprocess.run([fleet_bin(), "demo", "--dir", str(demo_dir), "--first-address", FIRST, *extra],
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)


def answers(out: str) -> dict[str, str]:
    return dict(re.findall(r"^answer from (\w+): (.*)$", out, re.MULTILINE))


def test_demo_runs_the_whole_job_and_keeps_a_fleet_its_printed_kill_stops(tmp_path: Path) -> None:
    # One run (the demo is the suite's longest module): with --keep, so that what it printed can be
    # tried after it exits; the printed kill then stops everything, which is what the run without
    # --keep does itself as it ends (Demo.stop_all: the same signal to the same processes).
    demo_dir = tmp_path / "demo"
    home_cache = Path.home() / ".cache"
    before = set(home_cache.iterdir()) if home_cache.exists() else set()
    proc = demo(demo_dir, "--keep")
    out = proc.stdout
    try:
        assert proc.returncode == 0, out + proc.stderr
        for expected in ("replicate replica.smollm2@gpu-a", "start server.chat@gpu-b", "start server.local@cp",
                         "Plan: 2 to replicate, 3 to start, 0 to replace, 0 to stop, 0 to delete.",
                         "Apply complete: 5 actions.", "No changes.", f"chunks streamed through http://{FIRST}:",
                         "converted in", "NODE", "gpu-a", "chat:running", "local:running"):
            assert expected in out, expected
        assert "stopped every process" not in out
        # A real model, greedy: both engines know the answer (llama.cpp on the GGUF, PyTorch on its twin).
        assert set(answers(out)) == {"local", "chat"}, out
        for cluster, answer in answers(out).items():
            assert "Paris" in answer, (cluster, answer)
        for streamed in re.findall(r"\[(\d+) chunks streamed through .*; (\d+) prompt \+ (\d+) completion tokens", out):
            assert int(streamed[0]) > 0 and int(streamed[1]) > 0 and int(streamed[2]) >= int(streamed[0])
        assert len(re.findall(r"chunks streamed through .* prompt \+", out)) == 2, "a usage chunk from each engine"
        after = set(home_cache.iterdir()) if home_cache.exists() else set()
        assert after == before  # engines' caches went under the demo directory
        assert (demo_dir / "fleet.yaml").exists() and (demo_dir / "state").is_dir()
        assert (demo_dir / "cache" / "models").is_dir()  # the twin, kept for a later run to reuse
        base = re.search(r"OpenAI base URL:\s+(http://\S+/v1)", out)
        assert base is not None, out
        # What it printed works: the openai client at the base URL, and the curl line's request.
        client = openai.OpenAI(base_url=base[1], api_key="x", max_retries=0, timeout=300)
        # The demo's own question: SmolLM2 Q4_1's greedy answer to the bare "What is the capital of
        # France?" is a list of French words, on llama-cpp-python's own single-sequence path too.
        reply = client.chat.completions.create(model="local", temperature=0, max_tokens=32,
                                               messages=[{"role": "user", "content": QUESTION}])
        assert "Paris" in (reply.choices[0].message.content or "")
        curl = re.search(r"curl (http://\S+) -H 'content-type: application/json' \\\n\s+-d '(.*)'", out)
        assert curl is not None, out
        r = httpx.post(curl[1], content=curl[2], headers={"content-type": "application/json"}, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        nodes = subprocess.run(["bash", "-c", f"cd {demo_dir} && source env.sh && {fleet_bin()} nodes -f fleet.yaml"],
                               capture_output=True, text=True, timeout=60)
        assert nodes.returncode == 0 and "chat:running" in nodes.stdout, nodes.stdout + nodes.stderr
    finally:
        stop = re.search(r"stop it:\s+kill ([\d ]+?)\s{2,}", out)
        pids = (demo_dir / "demo.pids").read_text().split() if (demo_dir / "demo.pids").exists() else []
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass
    assert stop is not None and sorted(stop[1].split()) == sorted(pids) and len(pids) == 4, out
    deadline = time.monotonic() + 60
    while processes_mentioning(str(demo_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(demo_dir)) == []  # the printed kill stops the agents' workers too
