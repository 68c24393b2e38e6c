"""Reading and parsing fleet files: every bad input is a diagnostic with a place, never an exception."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.cli import main as cli
from reconciler.fleetfile import config
from reconciler.fleetfile.source import MAX_BYTES, parse
from wire import manifest as mf

MINIMAL = "version: 1\ncontrol_plane: {node: cp}\nnodes:\n  cp: {address: 127.0.0.1}\n"


def codes(loaded: config.Loaded) -> list[str]:
    return [d.code for d in loaded.diagnostics]


def test_yaml_1_2_scalars_stay_strings() -> None:
    doc, diags = parse("a: 19:00\nb: no\nc: 2026-11-30\nd: 10\ne: true\nno: 1\n", "t.yaml")
    assert diags == [] and doc is not None
    assert doc.data == {"a": "19:00", "b": "no", "c": "2026-11-30", "d": 10, "e": True, "no": 1}


def test_marks_point_at_keys_and_values() -> None:
    doc, _ = parse("nodes:\n  cp:\n    address: x\n", "t.yaml")
    assert doc is not None
    assert doc.marks[("nodes", "cp", "address")][0].line == 3
    assert doc.marks[("nodes", "cp", "address")][0].column == 14
    assert doc.key_marks[("nodes", "cp", "address")][0].column == 5


def test_duplicate_key_is_caught_with_both_places() -> None:
    loaded = config.load_text(MINIMAL + "  cp: {address: 127.0.0.2}\n", "t.yaml")
    (dup,) = [d for d in loaded.diagnostics if d.code == "duplicate_key"]
    assert dup.range is not None and dup.range.start.line == 5
    assert "line 4" in dup.detail
    assert not loaded.ok


def test_billion_laughs_is_refused() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i-1}"] * 10) + "]")
    loaded = config.load_text("\n".join(lines) + "\n", "t.yaml")
    assert codes(loaded) == ["yaml_too_complex"]


def test_recursive_alias_is_refused() -> None:
    loaded = config.load_text("a: &x [*x]\n", "t.yaml")
    assert codes(loaded) == ["yaml_too_complex"] or codes(loaded) == ["yaml_syntax"]


def test_python_tags_are_refused() -> None:
    loaded = config.load_text("version: !!python/object:os.system {}\n", "t.yaml")
    assert "yaml_syntax" in codes(loaded)


def test_multiple_documents_are_a_syntax_error() -> None:
    loaded = config.load_text(MINIMAL + "---\n" + MINIMAL, "t.yaml")
    assert codes(loaded) == ["yaml_syntax"]


@pytest.mark.parametrize("content, code", [
    (b"", "config_empty"),
    (b"# only a comment\n", "config_empty"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "config_not_text"),
    (b"version: 1\n\xff\xfe", "config_not_text"),
])
def test_unusable_files(tmp_path: Path, content: bytes, code: str, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_bytes(content)
    assert cli.run(["validate", "-f", str(f)]) == 3
    err = capsys.readouterr().err
    assert f"error[{code}]" in err and str(f) in err


def test_missing_file_directory_and_huge_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["validate", "-f", str(tmp_path / "nope.yaml")]) == 3
    assert "no such file" in capsys.readouterr().err
    assert cli.run(["validate", "-f", str(tmp_path)]) == 3
    assert "is a directory" in capsys.readouterr().err
    big = tmp_path / "big.yaml"
    with big.open("wb") as fh:  # sparse: 50 MB on paper, nothing on disk
        fh.truncate(50 * 1024 * 1024)
    assert big.stat().st_size > MAX_BYTES
    assert cli.run(["validate", "-f", str(big)]) == 3
    assert "50.0 MiB" in capsys.readouterr().err


def test_default_file_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "mine.yaml"
    f.write_text(MINIMAL)
    monkeypatch.setenv("FLEET_CONFIG", str(f))
    assert cli.run(["validate"]) == 0
    assert "mine.yaml is valid" in capsys.readouterr().out


def test_warnings_do_not_fail_and_slices_cover_the_model() -> None:
    text = MINIMAL.replace("nodes:", "models:\n  m: {format: safetensors, digest: 'sha256:" + "a" * 64
                           + "', source: cp, layers: 4}\nnodes:") + \
        "  a: {address: 10.0.0.2}\n  b: {address: 10.0.0.3}\nreplicas:\n  m:\n" \
        "    - {node: a, layers: '0-1'}\n    - {node: b, layers: '2-3'}\n"
    loaded = config.load_text(text, "t.yaml")
    assert loaded.ok, loaded.diagnostics
    short = text.replace("'2-3'", "'2'")
    assert codes(config.load_text(short, "t.yaml")) == ["slice_gap"]


# ---- YAML merge keys (`<<`): the implicit resolver for them was dropped with the others ----

MERGED = """version: 1
control_plane: {node: cp}
nodes:
  cp: &node {address: 127.0.0.1, agent_port: 7071, labels: {zone: a}}
  gpu-a: {<<: *node, address: 127.0.0.2}
  gpu-b:
    <<: [{agent_port: 7072}, *node]
    address: 127.0.0.3
"""


def test_merge_keys_fill_a_mapping_and_its_own_keys_win() -> None:
    loaded = config.load_text(MERGED, "t.yaml")
    assert loaded.ok, [d.summary for d in loaded.diagnostics]
    assert loaded.desired is not None
    a, b = loaded.desired.nodes["gpu-a"], loaded.desired.nodes["gpu-b"]
    assert (a.address, a.agent_port) == ("127.0.0.2", 7071)  # its own address over the merged one
    assert (b.address, b.agent_port) == ("127.0.0.3", 7072)  # the earlier of two merged mappings wins
    assert loaded.document is not None
    assert loaded.document.data["nodes"]["gpu-a"]["labels"] == {"zone": "a"}
    # A merged value keeps the place it was written: errors in it point at the anchor.
    assert loaded.document.marks[("nodes", "gpu-a", "agent_port")][0].line == 4


def test_a_merged_mapping_with_its_own_merge_and_a_duplicate_of_a_merged_key() -> None:
    doc, diags = parse("a: &a {x: 1, y: 1}\nb: &b {<<: *a, y: 2}\nc: {<<: *b, z: 3}\n"
                       "d: {<<: *a, x: 4, x: 5}\n", "t.yaml")
    assert doc is not None
    assert doc.data["c"] == {"x": 1, "y": 2, "z": 3}
    # Overriding a merged key is not a duplicate; writing a key twice still is.
    assert [d.code for d in diags] == ["duplicate_key"] and doc.data["d"] == {"x": 4, "y": 1}


@pytest.mark.parametrize("text", ["a: {<<: 1}\n", "a: {<<: [x]}\n", "a: {<<: [[]]}\n"])
def test_a_merge_of_something_else_than_mappings_is_a_syntax_error(text: str) -> None:
    doc, diags = parse(text, "t.yaml")
    assert [d.code for d in diags] == ["yaml_syntax"] and "merge key" in diags[0].summary


def test_a_quoted_merge_key_and_a_merge_as_a_value_are_plain_strings() -> None:
    doc, diags = parse('a: {"<<": 1}\nb: <<\n', "t.yaml")
    assert diags == [] and doc is not None and doc.data == {"a": {"<<": 1}, "b": "<<"}


def test_merges_are_sized_like_aliases() -> None:
    lines = ["a0: &a0 {" + ", ".join(f"k{j}: [x, x, x, x, x, x, x, x, x, x]" for j in range(10)) + "}"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} {{<<: *a{i-1}, " + ", ".join(f"m{j}: *a{i-1}" for j in range(10)) + "}")
    assert codes(config.load_text("\n".join(lines) + "\n", "t.yaml")) == ["yaml_too_complex"]


# ---- a pattern guards the whole string: `$` under re.match also matched before a final newline ----

def test_a_digest_with_a_final_newline_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    digest = "sha256:" + "a" * 64
    f = tmp_path / "fleet.yaml"
    f.write_text(MINIMAL + f'models:\n  m: {{format: gguf, digest: "{digest}\\n", source: cp}}\n')
    assert cli.run(["validate", "-f", str(f)]) == 3
    err = capsys.readouterr().err
    assert "models.m.digest" in err and "is not valid here" in err
    f.write_text(MINIMAL + f'models:\n  m: {{format: gguf, digest: "{digest}", source: cp}}\n')
    assert cli.run(["validate", "-f", str(f)]) == 0
    with pytest.raises(mf.ManifestError):
        mf.check_digest(digest + "\n")
    assert not mf.HEX_RE.match("a" * 64 + "\n")
