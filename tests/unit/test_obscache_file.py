"""The cache file of observed states (reconciler/cache/observed.py) where it is not what fleet wrote: a
version or schema of another fleet's, states that do not parse, a link or a FIFO in its place, a
directory others may write in, a temporary file a killed run left. Each is ignored with a warning
that carries a stable code, or written past; none hangs or crashes a plan."""

from __future__ import annotations

import hashlib
import marshal
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from reconciler import __version__
from reconciler.cache import observed as obscache
from reconciler.core.desired import ControlPlaneSpec, Desired, NodeSpec
from reconciler.cache.observed import ObservationCache
from reconciler.core.observed import Observed, fingerprint, node_fields, node_from_state
from reconciler.schemas import schema_path

NODE = NodeSpec(name="n", address="127.0.0.1", agent_port=7070)
DESIRED = Desired(1, ControlPlaneSpec("n"), {"n": NODE}, {}, (), {})
SEEN = Observed({"n": node_from_state("n", {"generation": "g" * 32})})


def cache_in(directory: Path, warnings: list[str]) -> ObservationCache:
    directory.mkdir(mode=0o700, exist_ok=True)
    return ObservationCache(directory / "k.bin", warnings.append)


def written(path: Path, entries: dict[str, Any]) -> None:
    """A file as fleet writes it (this Python, this fleet, this schema) around these entries."""
    payload = marshal.dumps(entries)
    path.write_bytes(obscache.MAGIC + obscache.TAG + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    path.chmod(0o600)


def test_the_tag_names_the_fleet_version_and_the_state_schema() -> None:
    schema = hashlib.sha256(schema_path("agent-state.schema.json").read_bytes()).hexdigest()[:16]
    assert f"fleet {__version__} ".encode() in obscache.TAG and schema.encode() in obscache.TAG


def test_a_file_of_another_format_under_the_same_version_is_ignored_saying_so(tmp_path: Path) -> None:
    # A format-1 file (its tag named no nodes' fields) of this very fleet version: not "another version".
    warnings: list[str] = []
    cache = cache_in(tmp_path / "c", warnings)
    cache.save(DESIRED, SEEN)
    cache.path.write_bytes(cache.path.read_bytes().replace(obscache.TAG, obscache.TAG.rpartition(b" nodes ")[0] + b"\n"))
    assert cache.load(DESIRED) == {}
    assert len(warnings) == 1 and "another cache format" in warnings[0] and f"[{obscache.IGNORED}]" in warnings[0]


def test_both_caches_read_a_file_through_one_helper(tmp_path: Path) -> None:
    # read_kept: obscache's and desiredcache's read -> unmarshal -> ignored with a warning.
    warnings: list[str] = []
    path = tmp_path / "c" / "k.bin"
    assert obscache.read_kept(path.with_name("none.bin"), b"m\n", b"t\n", warnings.append) is None and not warnings
    obscache.write_private(path, b"m\n", b"t\n", marshal.dumps({"a": (1, "b")}))
    assert obscache.read_kept(path, b"m\n", b"t\n", warnings.append) == {"a": (1, "b")} and not warnings
    assert obscache.read_kept(path, b"m\n", b"other\n", warnings.append) is None
    path.chmod(0o644)
    assert obscache.read_kept(path, b"m\n", b"t\n", warnings.append) is None
    assert warnings == ["another Python, another fleet version or another cache format wrote it",
                        "others may read or write it (mode 644)"]
    assert obscache.reason(PermissionError(13, "Permission denied", str(path))) == "Permission denied"
    assert obscache.reason(ValueError("its directory is not this user's")) == "its directory is not this user's"


def test_a_write_sweeps_what_killed_runs_left_of_its_own_writes_only(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    directory.mkdir(mode=0o700)
    path = directory / "k.bin"
    old = time.time() - obscache.STALE_TEMP_S - 60
    stale, fresh, other = directory / ".k.bin.ab12", directory / ".k.bin.cd34", directory / ".j.bin.ef56"
    for leftover in (stale, fresh, other):
        leftover.write_bytes(b"half a write")
    os.utime(stale, (old, old))
    os.utime(other, (old, old))  # another fleet file's: not this write's to sweep
    outside = tmp_path / "outside"
    outside.write_bytes(b"not fleet's")
    link = directory / ".k.bin.gh78"
    link.symlink_to(outside)
    os.utime(link, (old, old), follow_symlinks=False)
    obscache.write_private(path, b"m\n", b"t\n", marshal.dumps({}))
    assert not stale.exists()
    assert fresh.exists() and other.exists() and link.is_symlink() and outside.read_bytes() == b"not fleet's"
    assert path.exists()


def tag_of(tree: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", "from reconciler.cache import observed; print(observed.TAG.decode())"],
                          capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          timeout=60, check=True)
    return proc.stdout


@pytest.mark.parametrize("change", [
    ("reconciler/core/observed.py", '"sha256:" + hashlib', '"sha256:" + "0" + hashlib'),  # another fingerprint
    ("reconciler/core/observed.py", 'integrity.get("state") == "corrupt"', 'integrity.get("state") == "bad"'),
    ("wire/live.py", "", "# changed\n"),
], ids=["fingerprint", "corrupt", "live"])
def test_the_code_that_derives_the_kept_fields_is_in_the_tag(tmp_path: Path, change: tuple[str, str, str]) -> None:
    # A fleet of the same version whose observed.py derives a node's fields otherwise must not read
    # them: its fingerprints and corruption would be this code's, not its own.
    for part in ("reconciler", "wire", "schemas"):
        shutil.copytree(Path(obscache.__file__).parents[2] / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    before = tag_of(tmp_path)
    module, old, new = change
    text = (tmp_path / module).read_text()
    assert old in text
    (tmp_path / module).write_text(text.replace(old, new) if old else text + new)
    assert tag_of(tmp_path) != before


FIELDS = node_fields(SEEN.nodes["n"])


@pytest.mark.parametrize("fields", [
    FIELDS[:3],  # too few
    FIELDS[:8] + ("not a mapping",) + FIELDS[9:],  # the weights
    FIELDS[:8] + ({"sha256:x": ("sha256:x",)},) + FIELDS[9:],  # a weights entry short of its fields
    FIELDS[:10] + ({"s": (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)},) + FIELDS[11:],  # a server with too many
], ids=["too-few", "weights-not-a-mapping", "weights-entry-short", "server-too-long"])
def test_nodes_that_do_not_rebuild_are_ignored_with_a_warning(tmp_path: Path, fields: tuple[Any, ...]) -> None:
    warnings: list[str] = []
    cache = cache_in(tmp_path / "observed", warnings)
    written(cache.path, {"n": ("127.0.0.1:7070 plain", {"generation": "g" * 32}, fields)})
    assert cache.load(DESIRED) == {}
    assert len(warnings) == 1 and warnings[0].startswith(f"[{obscache.IGNORED}]") and "'n'" in warnings[0]


def test_a_fifo_in_the_files_place_does_not_hang_the_load(tmp_path: Path) -> None:
    warnings: list[str] = []
    cache = cache_in(tmp_path / "observed", warnings)
    os.mkfifo(cache.path, 0o600)
    loaded: list[object] = []
    reader = threading.Thread(target=lambda: loaded.append(cache.load(DESIRED)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # let it go: a writer on the FIFO ends the open it hangs in
        os.close(os.open(cache.path, os.O_WRONLY | os.O_NONBLOCK))
    assert loaded == [{}] and "not a file of this user's" in warnings[0]


def test_a_link_in_the_files_place_is_not_followed(tmp_path: Path) -> None:
    warnings: list[str] = []
    cache = cache_in(tmp_path / "observed", warnings)
    elsewhere = tmp_path / "elsewhere.bin"
    written(elsewhere, {"n": ("127.0.0.1:7070 plain", {"generation": "g"}, FIELDS)})
    cache.path.symlink_to(elsewhere)
    assert cache.load(DESIRED) == {} and len(warnings) == 1 and warnings[0].startswith(f"[{obscache.IGNORED}]")


def test_a_directory_others_may_write_in_is_neither_read_nor_written(tmp_path: Path) -> None:
    warnings: list[str] = []
    cache = cache_in(tmp_path / "observed", warnings)
    cache.save(DESIRED, SEEN)
    assert cache.load(DESIRED) and not warnings
    cache.path.parent.chmod(0o777)  # as a shared FLEET_CACHE_DIR's observed/ made by someone else might be
    assert cache.load(DESIRED) == {} and "others may write in its directory" in warnings[0]
    before = cache.path.read_bytes()
    cache.save(DESIRED, Observed({"n": node_from_state("n", {"generation": "h" * 32})}))
    assert cache.path.read_bytes() == before
    assert warnings[1].startswith(f"[{obscache.NOT_KEPT}]") and "others may write in its directory" in warnings[1]


def test_a_temporary_file_a_killed_run_left_is_not_in_the_way(tmp_path: Path) -> None:
    warnings: list[str] = []
    cache = cache_in(tmp_path / "observed", warnings)
    (cache.path.parent / f".{cache.path.name}.{os.getpid()}").write_bytes(b"half")  # the same pid, later
    cache.save(DESIRED, SEEN)
    assert not warnings and cache.load(DESIRED)["n"].generation == "g" * 32


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", "no", " off "])
def test_the_cache_is_turned_off_by_any_usual_no(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(obscache.OFF_ENV, value)
    assert ObservationCache.for_file(tmp_path / "fleet.yaml", print) is None


def test_a_node_rebuilt_from_its_fields_is_the_node_its_state_makes(tmp_path: Path) -> None:
    state = {"generation": "a" * 32, "identity": {"id": "i"}, "observed_at": "2026-01-01T00:00:00+00:00",
             "agent_version": "1", "variant": {"accelerator": "cuda"},
             "inventory": {"disk": {"free_bytes": 5, "reserve_bytes": 1, "path": "/h"}, "simulated": True,
                           "gpus": [{"name": "G", "memory_free_bytes": 2, "memory_total_bytes": 3}]},
             "availability": {"inside": False, "windows": ["01:00-02:00"]},
             "weights": [{"digest": "sha256:w", "format": "gguf", "bytes": 7, "slice": {"of": "sha256:m", "layers": "0-1"},
                          "integrity": {"state": "corrupt", "file": "f", "reason": "r"},
                          "encryption": {"key_held": False, "key_id": "k"}}],
             "fetches": [{"digest": "sha256:f"}],
             "servers": [{"id": "s", "state": "running", "model": "sha256:w", "port": 9000, "settings": {"a": {"b": 1}},
                          "reason": "why", "pipeline": {"group": "g"}, "credential": "secret"}]}
    node = node_from_state("n", state)
    cache = cache_in(tmp_path / "observed", [])
    cache.save(DESIRED, Observed({"n": node}))
    assert "secret" not in cache.path.read_text(errors="replace")  # no workers' credentials kept
    held = cache.load(DESIRED)["n"]
    assert held == replace(node, servers={"s": replace(node.servers["s"], credential="")})
    assert held.fingerprint == node.fingerprint == fingerprint(state) and held.state == node.state
    assert (held.generation, held.known_fingerprint) == (node.generation, node.known_fingerprint)
