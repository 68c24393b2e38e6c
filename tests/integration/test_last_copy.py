"""The fleet's last copy is never deleted without an opt-in, on real agents on loopback: weights
imported on a node and declared nowhere, held by no other node, survive a full `fleet apply`
(refused: last_copy_delete, exit 4) until fleet.yaml lists their digest under delete_last_copy;
then the same apply deletes them, and says so."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reconciler.cli.exitcodes import Exit
from tests.agents import Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import import_model
from tests.models import random_gguf

pytestmark = pytest.mark.e2e


def fake_gguf(path: Path) -> Path:
    path.write_bytes(random_gguf(4100))  # a valid GGUF of random bytes: enough to plan with
    return path


def test_an_undeclared_only_copy_is_kept_until_the_file_opts_in(tmp_path: Path) -> None:
    port = free_port("127.0.0.2", "127.0.0.3")
    agents = {n: Agent(n, addr, port, tmp_path / n) for n, addr in (("cp", "127.0.0.2"), ("a", "127.0.0.3"))}
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda a: a.start(), agents.values()))
        declared = import_model(agents["cp"], fake_gguf(tmp_path / "q.gguf"))
        stray = import_model(agents["a"], fake_gguf(tmp_path / "stray.gguf"))  # its only copy in the fleet
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in agents.items())
        fleet = tmp_path / "fleet.yaml"
        text = (f"version: 1\ncontrol_plane: {{node: cp}}\nnodes:\n{nodes}\n"
                f'models:\n  q: {{format: gguf, digest: "{declared}", source: cp}}\nreplicas:\n  q: [cp]\n')
        fleet.write_text(text)

        def apply() -> subprocess.CompletedProcess[str]:
            return subprocess.run([fleet_bin(), "apply", "--auto-approve", "--json", "-f", str(fleet)],
                                  capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                                  env=agent_env(FLEET_STATE_DIR=str(tmp_path / "state")))

        def held(node: str) -> list[str]:
            return [w["digest"] for w in agents[node].get("/v1/state").json()["weights"]]

        refused = apply()
        assert refused.returncode == Exit.PLAN_REFUSED, refused.stdout + refused.stderr
        document = json.loads(refused.stdout)
        [diag] = [d for d in document["plan"]["diagnostics"] if d["code"] == "last_copy_delete"]
        assert diag["severity"] == "error" and stray in diag["summary"] and "from a" in diag["summary"]
        assert "delete_last_copy" in diag["detail"]
        assert document["results"] == [] and stray in held("a")  # kept

        fleet.write_text(text + f'delete_last_copy: ["{stray}"]\n')
        applied = apply()
        assert applied.returncode == 0, applied.stdout + applied.stderr
        document = json.loads(applied.stdout)
        [change] = document["plan"]["changes"]
        assert change["action"] == "delete" and change["details"] == {"digest": stray, "last_copy": True}
        assert [d["severity"] for d in document["plan"]["diagnostics"] if d["code"] == "last_copy_delete"] == ["warning"]
        assert "warning[last_copy_delete]" in applied.stderr  # for people too
        assert [r["status"] for r in document["results"]] == ["done"]
        assert stray not in held("a") and declared in held("cp")
    finally:
        for a in agents.values():
            a.stop()
