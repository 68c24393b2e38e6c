"""The cache of validated fleet files (reconciler/cache/desired.py): the same text is not composed and
checked again, and what comes back is what reading it whole gives, warnings included; any other
text, name, place or CA file is read whole; a file that did not validate, or a cache that is not
fleet's, this user's or whole, is never trusted."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from reconciler.cli import main as cli
from reconciler.fleetfile import config
from reconciler.cache import desired as desiredcache
from reconciler.cache.desired import IGNORED, NOT_KEPT, DesiredCache
from reconciler.core.diagnostics import warning
from reconciler.cache.observed import OFF_ENV

FLEET = """version: 1
control_plane: {node: cp}
nodes:
  cp: {address: 10.0.0.1}
  a: {address: 10.0.0.2, agent_port: 7171, labels: {rack: r1}, available: ["20:00-06:00"]}
  b: {address: 10.0.0.3}
models:
  m: {format: safetensors, digest: "sha256:1111111111111111111111111111111111111111111111111111111111111111", source: cp, layers: 4}
  g: {format: gguf, digest: "sha256:2222222222222222222222222222222222222222222222222222222222222222", source: cp}
replicas:
  m: [{node: a, layers: 0-1}, {node: b, layers: 2-3}]
  g: [a]
clusters:
  chat: {model: g, members: [a], port: 9000, settings: {context_length: 4096, speculative: {mode: prompt_lookup, tokens: 4}}}
  piped: {model: m, members: [a, b], port: 9001, pipeline: true}
  placed: {model: m, members: {count: 1, labels: {rack: r1}}, port: 9002}
"""
CERT = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    return path


def cache_of(tmp_path: Path, warnings: list[str]) -> DesiredCache:
    return DesiredCache(tmp_path / "cache" / "desired" / "k.bin", warnings.append)


def test_the_same_text_comes_back_as_reading_it_whole_gives(tmp_path: Path, fleet: Path) -> None:
    warnings: list[str] = []
    cache = cache_of(tmp_path, warnings)
    first, second = cache.load(fleet), cache.load(fleet)
    whole = config.load(fleet)
    assert not first.cached and second.cached and warnings == []
    assert whole.desired is not None and whole.desired.replicas[0].layers is not None  # the slices are in it
    assert (second.desired, second.digest, second.diagnostics, second.text, second.filename) == (
        whole.desired, whole.digest, whole.diagnostics, whole.text, whole.filename)
    assert (cache.path.stat().st_mode & 0o777, cache.path.parent.stat().st_mode & 0o777) == (0o600, 0o700)


def test_warnings_are_kept_and_given_back(tmp_path: Path, fleet: Path) -> None:
    cache = cache_of(tmp_path, [])
    whole = config.load(fleet)
    noted = warning("some_warning", "a summary", "a detail", "nodes.a", whole.document.range(("nodes", "a"))
                    if whole.document is not None else None)
    cache.keep(replace(whole, diagnostics=(noted,)))
    again = cache.load(fleet)
    assert again.cached and again.diagnostics == (noted,) and again.diagnostics[0].range is not None


def test_a_changed_byte_is_read_whole_and_kept_in_its_place(tmp_path: Path, fleet: Path) -> None:
    cache = cache_of(tmp_path, [])
    cache.load(fleet)
    fleet.write_text(FLEET.replace("port: 9000", "port: 9010"))
    changed = cache.load(fleet)
    assert not changed.cached and changed.desired is not None and changed.desired.clusters["chat"].port == 9010
    again = cache.load(fleet)
    assert again.cached and again.desired == changed.desired


def test_an_invalid_file_is_never_kept(tmp_path: Path, fleet: Path) -> None:
    fleet.write_text(FLEET.replace("members: [a], port: 9000", "members: [nobody], port: 9000"))
    cache = cache_of(tmp_path, [])
    for _ in range(2):
        loaded = cache.load(fleet)
        assert not loaded.ok and not loaded.cached and any(d.is_error for d in loaded.diagnostics)
    assert not cache.path.exists()


def test_another_name_for_the_same_file_is_read_whole(tmp_path: Path, fleet: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cache = cache_of(tmp_path, [])
    cache.load(fleet)
    monkeypatch.chdir(tmp_path)
    relative = cache.load("fleet.yaml")  # its diagnostics would name the file as given
    assert not relative.cached and relative.filename == "fleet.yaml"


def test_a_ca_file_that_went_bad_is_checked_again(tmp_path: Path, fleet: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(CERT)
    fleet.write_text(FLEET.replace("control_plane: {node: cp}", "control_plane: {node: cp, agent_ca_file: ca.pem}"))
    cache = cache_of(tmp_path, [])
    assert cache.load(fleet).ok and cache.load(fleet).cached
    (tmp_path / "ca.pem").write_bytes(b"not a certificate\n")
    bad = cache.load(fleet)
    assert not bad.cached and [d.code for d in bad.diagnostics] == ["ca_file_unreadable"]


def test_a_ca_file_under_another_home_is_the_one_named_now(tmp_path: Path, fleet: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for home in ("h1", "h2"):
        (tmp_path / home).mkdir()
        (tmp_path / home / "ca.pem").write_bytes(CERT)
    fleet.write_text(FLEET.replace("control_plane: {node: cp}", "control_plane: {node: cp, agent_ca_file: ~/ca.pem}"))
    cache = cache_of(tmp_path, [])
    monkeypatch.setenv("HOME", str(tmp_path / "h1"))
    assert cache.load(fleet).ok and cache.load(fleet).cached
    monkeypatch.setenv("HOME", str(tmp_path / "h2"))
    moved = cache.load(fleet)
    assert not moved.cached and moved.desired is not None and moved.desired == config.load(fleet).desired
    assert moved.desired.nodes["a"].ca_file == str(tmp_path / "h2" / "ca.pem")
    assert cache.load(fleet).cached  # kept again, under this home


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_or_foreign_file_is_ignored_with_a_warning(tmp_path: Path, fleet: Path, damage: str) -> None:
    warnings: list[str] = []
    cache = cache_of(tmp_path, warnings)
    cache.load(fleet)
    data = cache.path.read_bytes()
    cache.path.write_bytes({"flip": data[:-10] + bytes([data[-10] ^ 1]) + data[-9:], "truncate": data[:len(data) // 2],
                            "foreign": b"something else\n" + data}[damage])
    loaded = cache.load(fleet)
    assert loaded.ok and not loaded.cached and loaded.desired == config.load(fleet).desired
    assert len(warnings) == 1 and warnings[0].startswith(f"[{IGNORED}]")
    assert cache.load(fleet).cached  # rewritten by that load


def test_a_link_in_the_files_place_is_not_followed(tmp_path: Path, fleet: Path) -> None:
    warnings: list[str] = []
    cache = cache_of(tmp_path, warnings)
    cache.load(fleet)
    target = tmp_path / "elsewhere.bin"
    cache.path.rename(target)
    cache.path.symlink_to(target)
    assert not cache.load(fleet).cached and warnings[0].startswith(f"[{IGNORED}]")


def test_a_directory_others_may_write_in_is_neither_read_nor_written(tmp_path: Path, fleet: Path) -> None:
    warnings: list[str] = []
    cache = cache_of(tmp_path, warnings)
    cache.load(fleet)
    os.chmod(cache.path.parent, 0o777)
    assert not cache.load(fleet).cached
    assert len(warnings) == 2 and warnings[0].startswith(f"[{IGNORED}]") and warnings[1].startswith(f"[{NOT_KEPT}]")


@pytest.mark.parametrize("value", ["off", "0", "false", "no", " OFF "])
def test_switched_off_with_the_observed_states_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      value: str) -> None:
    monkeypatch.setenv(OFF_ENV, value)
    assert DesiredCache.for_file(tmp_path / "fleet.yaml", print) is None


def test_fleet_plan_reads_a_kept_file_and_plans_the_same(tmp_path: Path, fleet: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "cache"))
    snapshot = tmp_path / "observed.json"
    snapshot.write_text(json.dumps({"format": "1.0", "nodes": {}, "manifests": {}}))
    plans, kept = [], []
    for _ in range(2):
        cli.run(["plan", "--json", "-f", str(fleet), "--observed", str(snapshot)])
        plans.append(json.loads(capsys.readouterr().out))
        [path] = (tmp_path / "cache" / "desired").glob("*.bin")
        kept.append((path.stat().st_ino, path.stat().st_mtime_ns))
    assert plans[0] == plans[1]
    assert kept[0] == kept[1]  # read, not rewritten: a run that did not use it writes it anew (another inode)
    assert plans[0]["config_digest"] == config.load(fleet).digest


# Loads a good file (with a CA file), one the schema refuses and one the checks refuse, in a fresh
# interpreter; prints the fleet modules that ran, then those the tag digests.
LOADING = """
import json, pathlib, sys
from reconciler.fleetfile import config
d = pathlib.Path(sys.argv[1])
for text in sys.argv[2:]:
    (d / "fleet.yaml").write_text(text)
    config.load(d / "fleet.yaml")
ran = sorted(m for m in sys.modules if m.partition(".")[0] in ("reconciler", "wire"))
from reconciler.cache import desired as desiredcache, observed as obscache
print(json.dumps([ran, list(obscache.fleet_sources(*desiredcache.CODE))]))
"""


def test_the_tag_covers_every_fleet_module_loading_a_file_runs(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(CERT)
    texts = [FLEET.replace("control_plane: {node: cp}", "control_plane: {node: cp, agent_ca_file: ca.pem}"),
             FLEET.replace("port: 9000", "port: nine"), FLEET.replace("layers: 2-3", "layers: 3-2"), "{"]
    proc = subprocess.run([sys.executable, "-c", LOADING, str(tmp_path), *texts], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=True)
    ran, digested = json.loads(proc.stdout)
    assert {"wire.layers", "wire.ids"} <= set(ran)  # what a list written by hand missed
    assert set(ran) <= set(digested), set(ran) - set(digested)


def tag_of(tree: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", "from reconciler.cache import desired; print(desired.TAG.decode())"],
                          capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          timeout=60, check=True)
    return proc.stdout


@pytest.mark.parametrize("module", ["wire/layers.py", "wire/ids.py", "reconciler/fleetfile/checks.py"])
def test_a_changed_module_that_loading_runs_changes_the_tag(tmp_path: Path, module: str) -> None:
    for part in ("reconciler", "wire", "schemas"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    before = tag_of(tmp_path)
    with (tmp_path / module).open("a") as f:
        f.write("# changed\n")
    assert tag_of(tmp_path) != before


def test_the_libraries_versions_are_read_as_importlib_metadata_reads_them() -> None:
    assert desiredcache._versions("PyYAML:yaml", "jsonschema:jsonschema", "fastjsonschema:fastjsonschema") == (
        " ".join(f"{d} {importlib.metadata.version(d)}" for d in ("PyYAML", "jsonschema", "fastjsonschema")))
    assert desiredcache._versions("no-such-thing:no_such_thing") == "no-such-thing none"


def test_a_library_without_metadata_is_named_by_its_file_not_a_crash() -> None:
    # A vendored or frozen copy has no .dist-info: every command imports this tag, so it must not raise.
    import json

    origin = os.stat(json.__file__)
    assert desiredcache._versions("no-metadata-here:json") == (
        f"no-metadata-here file {origin.st_size} {origin.st_mtime_ns}")
