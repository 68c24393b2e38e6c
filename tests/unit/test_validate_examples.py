"""`fleet validate` on the example fleet and on every deliberately broken file under examples/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reconciler import cli, config
from tests.conftest import ROOT, run_cli

BROKEN = sorted((ROOT / "examples" / "broken").glob("*.yaml"))
EXPECT = re.compile(rb"^# expect: (\w+) (\d+):(\d+)")


def expectation(path: Path) -> tuple[str, int, int]:
    m = EXPECT.match(path.read_bytes())
    assert m, f"{path.name} must start with '# expect: CODE LINE:COL'"
    return m.group(1).decode(), int(m.group(2)), int(m.group(3))


def test_there_is_a_broken_file_per_class_of_mistake() -> None:
    codes = {expectation(p)[0] for p in BROKEN}
    assert {"schema_violation", "yaml_syntax", "duplicate_key", "unknown_node", "unknown_model",
            "address_conflict", "port_conflict", "slice_overlap", "slice_gap", "duplicate_replica",
            "duplicate_member", "config_empty", "config_not_text"} <= codes


def test_example_fleet_is_valid_as_a_user_runs_it() -> None:
    proc = run_cli("validate", str(ROOT / "fleet.yaml.example"))
    assert proc.returncode == 0, proc.stderr
    assert "is valid: 4 nodes, 3 models" in proc.stdout
    assert proc.stderr == ""


def test_example_builds_the_desired_state() -> None:
    loaded = config.load(ROOT / "fleet.yaml.example")
    assert loaded.ok and loaded.desired is not None
    d = loaded.desired
    assert d.control_plane.node == "cp" and d.control_plane.listen == "0.0.0.0:8080"
    assert list(d.nodes) == ["cp", "gpu-a", "gpu-b", "gpu-c"]
    assert d.nodes["gpu-b"].agent_port == 7070  # the default
    assert d.nodes["gpu-c"].available == ("19:00-07:00",)  # stays a string: YAML 1.2 scalars
    slices = [(r.node, str(r.layers)) for r in d.replicas if r.model == "big-70b"]
    assert slices == [("gpu-b", "0-39"), ("gpu-c", "40-79")]
    assert d.clusters["chat"].members == ("gpu-a", "gpu-b")
    assert d.clusters["chat"].settings.tensor_parallel == "auto"
    assert d.clusters["local-q4"].settings.threads == 8
    assert loaded.digest and loaded.digest.startswith("sha256:")


@pytest.mark.parametrize("path", BROKEN, ids=[p.stem for p in BROKEN])
def test_broken_file_exits_3_with_code_and_place(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line, column = expectation(path)
    assert cli.run(["validate", "--json", str(path)]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] is False and out["error_count"] >= 1
    first = out["diagnostics"][0]
    assert first["code"] == code
    assert (first["range"]["start"]["line"], first["range"]["start"]["column"]) == (line, column)
    assert first["summary"] and first["severity"] == "error"

    # The human form names file:line:col, shows the offending line, and goes to stderr.
    assert cli.run(["validate", "-f", str(path)]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{path}:{line}:{column}" in captured.err
    assert f"error[{code}]" in captured.err
    if code not in ("config_not_text", "config_empty"):
        source_line = path.read_text().splitlines()[line - 1].replace("\t", " ")
        assert source_line.strip() in captured.err


def test_exit_code_3_from_the_real_command() -> None:
    proc = run_cli("validate", str(ROOT / "examples" / "broken" / "unknown-node.yaml"))
    assert proc.returncode == 3
    assert "unknown_node" in proc.stderr and "gpu-z" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_json_output_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["validate", "--json", str(ROOT / "fleet.yaml.example")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"format_version": "1.0", "valid": True, "error_count": 0, "warning_count": 0,
                   "diagnostics": []}


@pytest.mark.parametrize("name", ["local-demo.yaml", "multi-node.yaml"])
def test_example_fleets_are_valid(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["validate", str(ROOT / "examples" / name)]) == 0, capsys.readouterr().err
