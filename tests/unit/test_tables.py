"""`fleet nodes`, `fleet alerts` and `fleet unlock` over a state directory written as `fleet serve`
and `fleet apply` write it: each node's columns read from the state it last reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from reconciler.cli import main as cli
from reconciler.state.store import StateStore
from tests.unit.test_client import GOOD

DIGEST = "sha256:" + "ab" * 32


def state() -> dict[str, Any]:
    s: dict[str, Any] = json.loads(json.dumps(GOOD))
    s["inventory"]["gpus"] = [{"name": "H100", "uuid": "GPU-1", "memory_total_bytes": 80 << 30,
                               "memory_free_bytes": 60 << 30}]
    s["weights"] = [{"digest": DIGEST, "name": "tiny", "format": "safetensors", "bytes": 10,
                     "slice": {"of": "sha256:" + "cd" * 32, "layers": "0-3"}, "path": "/srv/a/models/x"},
                    {"digest": "sha256:" + "ef" * 32, "format": "gguf", "bytes": 5, "path": "/srv/a/models/y"}]
    s["availability"]["windows"] = ["19:00-07:00"]
    s["variant"]["accelerator"] = "cuda"
    return s


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    with StateStore(tmp_path) as store:
        with store.serve.transaction():
            store.serve.put_node("gpu-a", "online", "T1", state=state(), error=None)
            store.serve.put_node("gpu-b", "offline", "T2", state=None, error="node_unreachable: connection refused")
            store.serve.put_server_row({"id": "chat@gpu-b", "cluster": "chat", "node": "gpu-b", "model": "tiny",
                                        "port": 9001, "state": "node_offline", "reason": "node gpu-b is offline"}, "T2")
            store.serve.raise_alert("gpu-b", "node_offline", "node_unreachable: connection refused", "T2")
    return tmp_path


def fleet(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_nodes_reads_each_column_from_the_reported_state(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = fleet(capsys, "nodes", "--wide", "--state-dir", str(state_dir), "-f", str(state_dir / "none"))
    assert code == 0
    a = next(line for line in out.splitlines() if line.startswith("gpu-a"))
    assert "online" in a and "60.0/80.0" in a and "tiny[0-3]" in a and "efefefefefef" in a
    assert "b" * 32 in a and "0.1.0" in a and "cuda" in a and "19:00-07:00" in a
    b = next(line for line in out.splitlines() if line.startswith("gpu-b"))
    assert "offline" in b and "chat:node_offline" in b and "always" in b
    assert "ALERT node_offline gpu-b since T2: node_unreachable: connection refused" in out
    assert "gpu-b: node_unreachable: connection refused" in out  # failures, in full


def test_nodes_json_is_what_the_store_keeps(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = fleet(capsys, "nodes", "--json", "--state-dir", str(state_dir))
    data = json.loads(out)
    assert code == 0 and data["nodes"][0]["state"] == state() and data["servers"][0]["id"] == "chat@gpu-b"


def test_alerts_open_and_cleared(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "node_offline gpu-b raised T2 (OPEN)" in fleet(capsys, "alerts", "--state-dir", str(state_dir))[1]
    with StateStore(state_dir) as store:
        store.serve.clear_alert("gpu-b", "node_offline", "T3")
    assert fleet(capsys, "alerts", "--state-dir", str(state_dir))[1].strip() == "no alerts"
    assert "(cleared T3)" in fleet(capsys, "alerts", "--all", "--state-dir", str(state_dir))[1]


def test_unlock_releases_only_the_named_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with StateStore(tmp_path) as store:
        lock, _ = store.applies.acquire("fleet apply")
    code, _, err = fleet(capsys, "unlock", "not-it", "--state-dir", str(tmp_path))
    assert code == 5 and f"lock id {lock.id}" in err and f"fleet unlock {lock.id}" in err
    code, _, err = fleet(capsys, "unlock", lock.id, "--state-dir", str(tmp_path))
    assert code == 0 and "released the lock" in err
    assert "no lock is held" in fleet(capsys, "unlock", lock.id, "--state-dir", str(tmp_path))[2]
