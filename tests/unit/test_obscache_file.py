"""The cache file of observed states (reconciler/obscache.py) where it is not what fleet wrote: a
version or schema of another fleet's, states that do not parse, a link or a FIFO in its place, a
directory others may write in, a temporary file a killed run left. Each is ignored with a warning
that carries a stable code, or written past; none hangs or crashes a plan."""

from __future__ import annotations

import hashlib
import marshal
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from reconciler import __version__, obscache
from reconciler.model import ControlPlaneSpec, Desired, NodeSpec
from reconciler.obscache import ObservationCache
from reconciler.observed import Observed, node_from_state
from reconciler.schema import schema_path

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


@pytest.mark.parametrize("state", [
    {"generation": "g", "weights": [{}]},  # a weights entry without its digest
    {"generation": "g", "inventory": []},
    {"generation": "g", "servers": [{"port": "x"}]},
], ids=["weights-without-digest", "inventory-a-list", "server-without-id"])
def test_states_that_do_not_parse_are_ignored_with_a_warning(tmp_path: Path, state: dict[str, Any]) -> None:
    warnings: list[str] = []
    cache = cache_in(tmp_path / "observed", warnings)
    written(cache.path, {"n": ("127.0.0.1:7070 plain", state)})
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
    written(elsewhere, {"n": ("127.0.0.1:7070 plain", {"generation": "g"})})
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
