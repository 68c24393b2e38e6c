"""`fleet validate` on the example fleet and on every deliberately broken file under examples/: in
process, and twice as the user runs it (a real `fleet` process, marked e2e)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reconciler.cli import main as cli
from reconciler.fleetfile import config
from reconciler.core.desired import PipelineSpec
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
            "duplicate_member", "config_empty", "config_not_text", "pipeline_layers_gap",
            "pipeline_layers_overlap", "pipeline_out_of_order", "pipeline_member_not_slice",
            "pipeline_gguf_unsupported", "pipeline_port_conflict", "yaml_integer_form", "invalid_address"} <= codes


@pytest.mark.e2e  # a real fleet process
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


@pytest.mark.e2e  # a real fleet process
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


@pytest.mark.parametrize("name", ["local-demo.yaml", "multi-node.yaml", "pipeline.yaml"])
def test_example_fleets_are_valid(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["validate", str(ROOT / "examples" / name)]) == 0, capsys.readouterr().err


def test_pipeline_example_builds_its_stages() -> None:
    loaded = config.load(ROOT / "examples" / "pipeline.yaml")
    assert loaded.ok and loaded.desired is not None
    big = loaded.desired.clusters["big"]
    assert big.members == ("gpu-a", "gpu-b") and big.pipeline is not None
    assert big.pipeline.rendezvous_port == 9103
    assert loaded.desired.clusters["big"].settings.threads == 1


def pipeline_fleet(cluster: str, replicas: str = '[{node: a, layers: "0-14"}, {node: b, layers: "15-29"}]',
                   fmt: str = "safetensors", layers: str = ", layers: 30") -> config.Loaded:
    return config.load_text(f"""version: 1
control_plane: {{node: cp}}
nodes: {{cp: {{address: 10.0.0.1}}, a: {{address: 10.0.0.2}}, b: {{address: 10.0.0.3}}, c: {{address: 10.0.0.4}}}}
models:
  m: {{format: {fmt}, digest: "sha256:{'1' * 64}", source: cp{layers}}}
replicas:
  m: {replicas}
clusters:
{cluster}
""", "fleet.yaml")


def codes(loaded: config.Loaded) -> list[str]:
    return [d.code for d in loaded.diagnostics]


def test_pipeline_true_meets_on_the_next_port_and_false_is_an_ordinary_cluster() -> None:
    loaded = pipeline_fleet("  big: {model: m, members: [a, b], port: 9003, pipeline: true}")
    assert loaded.ok and loaded.desired is not None
    assert loaded.desired.clusters["big"].pipeline == PipelineSpec(9004)
    ordinary = pipeline_fleet("  big: {model: m, members: [cp], port: 9003, pipeline: false}")
    assert ordinary.ok and ordinary.desired is not None and ordinary.desired.clusters["big"].pipeline is None


@pytest.mark.parametrize("cluster, replicas, expected", [
    # a stage that holds nothing of the model, and the source (which holds it whole) as a stage
    ("  big: {model: m, members: [a, c], port: 9003, pipeline: true}", None, "pipeline_member_not_slice"),
    ("  big: {model: m, members: [cp, b], port: 9003, pipeline: true}", None, "pipeline_member_not_slice"),
    # the last stage stops short of the model's last layer
    ("  big: {model: m, members: [a, b], port: 9003, pipeline: true}",
     '[{node: a, layers: "0-14"}, {node: b, layers: "15-28"}]', "pipeline_layers_gap"),
    # the first stage does not start at layer 0
    ("  big: {model: m, members: [a, b], port: 9003, pipeline: true}",
     '[{node: a, layers: "1-14"}, {node: b, layers: "15-29"}]', "pipeline_layers_gap"),
    ("  big: {model: m, members: [a, b], port: 65535, pipeline: true}", None, "pipeline_port_conflict"),
    ("  big: {model: m, members: [a, b], port: 9003, pipeline: {rendezvous_port: 9003}}", None,
     "pipeline_port_conflict"),
    ("  big: {model: m, members: [a, b], port: 9003, pipeline: true, settings: {speculative: {mode: prompt_lookup}}}",
     None, "pipeline_speculative_unsupported"),
    # a later cluster on the rendezvous port of the first stage's node
    ("  big: {model: m, members: [a, b], port: 9003, pipeline: true}\n  other: {model: m, members: [a], port: 9004}",
     '[{node: a, layers: "0-14"}, {node: b, layers: "15-29"}]', "port_conflict"),
])
def test_pipeline_refusals(cluster: str, replicas: str | None, expected: str) -> None:
    loaded = pipeline_fleet(cluster, *([replicas] if replicas else []))
    assert expected in codes(loaded), [d.summary for d in loaded.diagnostics]


def test_two_pipelines_of_one_model_each_cover_it_once() -> None:
    both = pipeline_fleet("  one: {model: m, members: [a, b], port: 9003, pipeline: true}\n"
                          "  two: {model: m, members: [c, cp], port: 9003, pipeline: true}",
                          '[{node: a, layers: "0-14"}, {node: b, layers: "15-29"}, {node: c, layers: "0-9"}, '
                          '{node: cp, layers: "10-29"}]')
    assert both.ok, [d.summary for d in both.diagnostics]


def test_pipeline_without_a_layer_count_checks_what_it_can() -> None:
    loaded = pipeline_fleet("  big: {model: m, members: [a, b], port: 9003, pipeline: true}",
                            '[{node: a, layers: "0-14"}, {node: b, layers: "16-29"}]', layers="")
    assert codes(loaded) == ["pipeline_layers_gap"]
    gguf = pipeline_fleet("  big: {model: m, members: [cp], port: 9003, pipeline: true}", "[cp]", fmt="gguf")
    assert codes(gguf) == ["pipeline_gguf_unsupported"]
