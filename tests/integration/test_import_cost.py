"""What a command pays for before it does anything: a warm `fleet plan` (its fleet file validated
before, reconciler/cache/desired.py) under --json loads no YAML parser, no JSON Schema validator, no
rich and no httpx. A module that imports one of them at its top again (0.1-0.2 s of CPU on every
plan, `python -X importtime`) fails here; a file that changed is parsed and checked as before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.cli.exitcodes import Exit
from tests.conftest import fleet_bin

FLEET = """version: 1
control_plane: {node: cp}
nodes:
  cp: {address: 10.0.0.1}
  a: {address: 10.0.0.2}
models:
  g: {format: gguf, digest: "sha256:2222222222222222222222222222222222222222222222222222222222222222", source: cp}
replicas:
  g: [a]
"""
HEAVY = {"yaml", "jsonschema", "fastjsonschema", "rich", "httpx"}
PARSE = {"yaml", "fastjsonschema"}  # what reading a fleet file whole needs (jsonschema: only for its errors)

# In a fresh interpreter: the warm plan, then the same plan once the file changed; the top-level
# packages loaded after each.
PLANS = """
import json, sys
from pathlib import Path
from reconciler.cli import main as cli

fleet, snapshot, out = sys.argv[1:]

def plan():
    code = cli.run(["plan", "--json", "-f", fleet, "--observed", snapshot])
    return code, sorted({m.split(".")[0] for m in sys.modules})

warm = plan()
Path(fleet).write_text(Path(fleet).read_text() + "# changed\\n")
Path(out).write_text(json.dumps([warm, plan()]))
"""


@pytest.mark.e2e  # real fleet processes
def test_a_warm_plan_loads_no_parser_no_validator_and_no_rich(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "cache"))
    fleet, snapshot, out = tmp_path / "fleet.yaml", tmp_path / "observed.json", tmp_path / "modules.json"
    fleet.write_text(FLEET)
    snapshot.write_text(json.dumps({"format": "1.0", "nodes": {}, "manifests": {}}))
    # Refused (no node was observed), but the file validated: it is kept. By `fleet` itself, not in
    # this process, whose modules may be older than the tree's (another tag: nothing kept for the next).
    plan = ["plan", "--json", "-f", str(fleet), "--observed", str(snapshot)]
    first = subprocess.run([fleet_bin(), *plan], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert first.returncode == Exit.PLAN_REFUSED and json.loads(first.stdout)["changes"] == [], first.stderr
    proc = subprocess.run([sys.executable, "-c", PLANS, str(fleet), str(snapshot), str(out)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (warm_code, warm), (cold_code, cold) = json.loads(out.read_text())
    assert warm_code == cold_code == Exit.PLAN_REFUSED, proc.stdout + proc.stderr
    assert HEAVY & set(warm) == set(), f"a warm plan imported these; import them where they are used ({proc.stderr})"
    assert PARSE <= set(cold), "the changed file was not parsed and checked (is the probe still probing?)"
