"""The states `fleet plan` (and apply, observe) last observed, kept between runs per fleet file and
per user, so that an agent whose state has not changed answers 304 and nothing is parsed, checked
or typed again. Never trusted alone: every agent is still asked on every run, a held state is used
only once its agent confirms its generation, brought up to now with the moving values the 304
carries (wire/live.py); any other answer replaces it.

The file is the user's own (0600 in a 0700 directory), written whole under a new name and renamed,
with a checksum; one that is not ours, not only the user's, or does not check is ignored with a
warning and rewritten. A directory that is not the user's alone is neither read nor written: anyone
who can write there can put a link or a FIFO in the file's place (its name is predictable). The
states held were checked against the agent-state schema when they were written, and are not again
(each is kept with its node's fields, observed.node_fields, rebuilt by position with no parsing):
the file names the fleet version, the schema and the code that derived the fields (observed.py)
it was written under, and is ignored under any other. It holds no workers' credentials (ObservedNode.state never does)."""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import re
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

import platformdirs

from reconciler import __version__
from reconciler.core.desired import Desired, NodeSpec
from reconciler.core.observed import Fields, Observed, ObservedNode, node_fields, node_from_fields
from reconciler.schemas import schema_path

DIR_ENV = "FLEET_CACHE_DIR"  # the cache directory (default: the user's cache directory for fleet)
OFF_ENV = "FLEET_OBSERVE_CACHE"  # off (or 0, false, no): no cache is read or written
OFF = frozenset({"off", "0", "false", "no"})
MAGIC = b"fleet observed-states cache 1\n"
IGNORED = "observed_cache_ignored"  # the stable codes of the cache's warnings
NOT_KEPT = "observed_cache_not_kept"
MAX_BYTES = 256 << 20  # a fleet's states past this are not kept (the next run asks for all of them whole)

Warn = Callable[[str], None]  # takes "[code] message"
# (where the agent was asked: "ADDRESS:PORT tls|plain", its state, the node's fields (observed.node_fields)
# or True: its agent is asked plainly)
Entry = tuple[str, dict[str, Any], Fields | bool]


def _where(spec: NodeSpec) -> str:
    return f"{spec.address}:{spec.agent_port} {'tls' if spec.tls else 'plain'}"


@dataclass(frozen=True, slots=True)
class ObservationCache:
    path: Path
    warn: Warn
    # Nodes whose agent confirms a generation with a bare 304 (from before fleet-live: the state is
    # asked for again whole), as load() found them: name -> (agent version, generation). They are
    # not held, so asked once, plainly; save() keeps them so while their agent's version stays.
    plain: dict[str, tuple[str, str]] = field(default_factory=dict, compare=False)

    @classmethod
    def for_file(cls, fleet_file: str | Path, warn: Warn) -> ObservationCache | None:
        """The cache of this fleet file (by its absolute path); None when FLEET_OBSERVE_CACHE=off."""
        path = cache_path("observed", fleet_file)
        return None if path is None else cls(path, warn)

    def load(self, desired: Desired) -> dict[str, ObservedNode]:
        """The nodes held for this fleet's nodes, each at the address it has now; {} when there is
        no cache, or one that cannot be used (with a warning). Those asked plainly go into `plain`."""
        self.plain.clear()
        entries = read_kept(self.path, MAGIC, TAG, self._ignored)
        if entries is None:
            return {}
        if not isinstance(entries, dict) or not all(_entry(k, v) for k, v in entries.items()):
            self._ignored("its entries are not states")
            return {}
        held = {}
        name = ""
        try:
            for name, spec in desired.nodes.items():
                entry = entries.get(name)
                if entry is not None and entry[0] == _where(spec):
                    if entry[2] is True:
                        self.plain[name] = (str(entry[1].get("agent_version", "")), entry[1]["generation"])
                    else:
                        held[name] = node_from_fields(name, entry[1], entry[2])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            # Only another fleet's states could fail here (the tag says whose they are): none is used.
            self._ignored(f"the state held for {name!r} does not parse: {type(exc).__name__} {exc}")
            self.plain.clear()
            return {}
        return held

    def _ignored(self, why: str) -> None:
        self.warn(f"[{IGNORED}] the cache of observed states {self.path} is ignored ({why}); every state is "
                  "asked for whole")

    def save(self, desired: Desired, observed: Observed, held: Mapping[str, ObservedNode] | None = None,
             bare: Collection[str] = ()) -> None:
        """Keep the states observed now (the nodes that answered), in place of what was kept;
        nothing is written when they are the generations `held` (what load() gave) and `plain`, all
        of them. `bare`: nodes whose agent answered a bare 304 (observe()'s), asked plainly from now on."""
        entries: dict[str, Entry] = {}
        for name, node in observed.nodes.items():
            state = node.state
            if node.ok and state is not None and isinstance(state.get("generation"), str) and name in desired.nodes:
                was = self.plain.get(name)
                if name in bare or (was is not None and was[0] == state.get("agent_version", "")):
                    entries[name] = (_where(desired.nodes[name]), state, True)
                else:
                    entries[name] = (_where(desired.nodes[name]), state, node_fields(node))
        if held is not None and {n for n, e in entries.items() if e[2] is not True} == held.keys() and all(
                entries[name][1].get("generation") == node.generation for name, node in held.items()) and {
                n for n, e in entries.items() if e[2] is True} == self.plain.keys() and all(
                entries[name][1].get("generation") == generation for name, (_, generation) in self.plain.items()):
            return  # the file already holds these states (their moving values aside, which a 304 brings)
        payload = marshal.dumps(entries)
        if len(payload) > MAX_BYTES:
            self.warn(f"[{NOT_KEPT}] the observed states are {len(payload) >> 20} MiB, more than the cache keeps "
                      f"({MAX_BYTES >> 20} MiB): the next run asks for every state whole")
            payload = marshal.dumps({})
        try:
            write_private(self.path, MAGIC, TAG, payload)
        except (OSError, ValueError) as exc:
            self.warn(f"[{NOT_KEPT}] cannot keep the observed states in {self.path} ({reason(exc)}); "
                      "the next run asks for every state whole")


# An import statement, at a module's top or in a function (`from . import yamltree`): what a module
# may run. Anchored on the line's start by its "\n" (re.M's ^ was 2.5 times as slow).
_IMPORT = re.compile(rb"\n[ \t]*(?:from[ \t]+([.\w]+)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)|import[ \t]+([^\n#]*))")
_OURS = ("reconciler", "wire")


def fleet_sources(*roots: str) -> dict[str, bytes]:
    """The source of each fleet module (reconciler.*, wire.*) these modules may run, by name: themselves,
    what they import at their top or in a function, and so on, with their packages; read from their
    text, nothing imported. A value kept between runs depends on all of them (a list written by hand
    missed some)."""
    found: dict[str, bytes] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        spec = _spec(name) if name not in found and name.partition(".")[0] in _OURS else None
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        found[name] = Path(spec.origin).read_bytes()
        package = name if spec.submodule_search_locations is not None else name.rpartition(".")[0]
        todo.extend(package.rsplit(".", i)[0] for i in range(package.count(".") + 1))
        for base, names, plain in _IMPORT.findall(b"\n" + found[name]):
            if plain:
                todo.extend(n.split()[0] for n in plain.decode().split(",") if n.split())
                continue
            module = importlib.util.resolve_name(base.decode(), package) if base.startswith(b".") else base.decode()
            todo.append(module)
            imported = _spec(module) if module.partition(".")[0] in _OURS else None
            if imported is not None and imported.submodule_search_locations is not None:  # names may be modules
                todo.extend(f"{module}.{n.split()[0]}" for n in names.decode().strip("()").split(",") if n.split())
    return dict(sorted(found.items()))


def code_digest(*roots: str) -> str:
    """A sha256 of fleet_sources(*roots): each module's name and source, by name."""
    h = hashlib.sha256()
    for name, source in fleet_sources(*roots).items():
        h.update(f"{name}:{len(source)}:".encode())
        h.update(source)
    return h.hexdigest()


def _spec(name: str) -> ModuleSpec | None:
    """Where a module is, without running it (its packages are run, as an import would)."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


# marshal's format is the interpreter's, and the states' shape is this fleet's and this schema's; what
# is kept beside each state (its node's fields: a fingerprint, HeldModel.corrupt, the servers) is what
# observed.py's code derives from it, and is rebuilt by position: a cache written under any other
# Python, schema or deriving code is not read, only rewritten.
_SCHEMA = hashlib.sha256(schema_path("agent-state.schema.json").read_bytes()).hexdigest()[:16]
TAG = (f"{sys.implementation.cache_tag} marshal {marshal.version} fleet {__version__} state {_SCHEMA} "
       f"nodes {code_digest('reconciler.core.observed')[:16]}\n").encode()


def cache_path(kind: str, fleet_file: str | Path) -> Path | None:
    """Where the cache of this kind for this fleet file (by its absolute path) lives; None when
    FLEET_OBSERVE_CACHE=off (it switches off every cache kept beside the states)."""
    if os.environ.get(OFF_ENV, "").strip().lower() in OFF:
        return None
    base = Path(os.environ.get(DIR_ENV) or platformdirs.user_cache_dir("fleet"))
    key = hashlib.sha256(str(Path(fleet_file).absolute()).encode()).hexdigest()[:24]
    return base / kind / f"{key}.bin"


def read_kept(path: Path, magic: bytes, tag: bytes, ignored: Callable[[str], None], max_bytes: int = MAX_BYTES) -> Any:
    """What write_private kept in `path`, unmarshalled; None when there is none, or one that cannot be
    used, which is said through `ignored(why)`."""
    try:
        return marshal.loads(read_private(path, magic, tag, max_bytes))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError, TypeError) as exc:
        ignored(reason(exc))
        return None


def reason(exc: Exception) -> str:
    """Why reading or writing a cache failed, for a warning: an OSError's own words ("Permission
    denied"), without its errno and path, which the warning gives its own way."""
    return str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)


def read_private(path: Path, magic: bytes, tag: bytes, max_bytes: int = MAX_BYTES) -> bytes:
    """The payload of a cache file this user wrote under `magic` and `tag` with write_private.
    Raises FileNotFoundError when there is none, ValueError (or OSError) saying why one cannot be used."""
    _private_directory(path.parent)
    # O_NOFOLLOW: not a link's target; O_NONBLOCK: a FIFO in its place does not hang the open.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError("it is not a file of this user's")
        if info.st_mode & 0o077:
            raise ValueError(f"others may read or write it (mode {stat.S_IMODE(info.st_mode):o})")
        if info.st_size > max_bytes + 4096:
            raise ValueError(f"it is larger than {max_bytes >> 20} MiB")
        data = f.read()
    head = len(magic) + len(tag)
    if data[:len(magic)] != magic:
        raise ValueError("it is not a cache of fleet's")
    if data[len(magic):head] != tag:
        raise ValueError("another Python, another fleet version or another cache format wrote it")
    payload = data[head + 65:]
    if hashlib.sha256(payload).hexdigest().encode() + b"\n" != data[head:head + 65]:
        raise ValueError("its checksum does not match: it is damaged")
    return payload


def write_private(path: Path, magic: bytes, tag: bytes, payload: bytes) -> None:
    """`payload` kept in `path` (0600, in a directory only this user may write in) under `magic`,
    `tag` and its checksum, written whole under a name of its own and renamed. Raises OSError or
    ValueError (a directory that is not private)."""
    data = magic + tag + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private_directory(path.parent)
    # A name of its own (mkstemp: 0600, O_EXCL): one a killed run left behind is not in the way.
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _sweep(path)


STALE_TEMP_S = 600.0  # a write takes well under a second: a temp file this old is a killed run's


def _sweep(path: Path) -> None:
    """Remove what killed runs left of their writes of `path` (its temp names, this user's plain
    files, older than STALE_TEMP_S); a run writing now has a fresh one, and nothing else is touched."""
    prefix, now = f".{path.name}.", time.time()
    try:
        with os.scandir(path.parent) as entries:
            for entry in entries:
                if not entry.name.startswith(prefix):
                    continue
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and now - info.st_mtime > STALE_TEMP_S:
                    os.unlink(entry.path)
    except OSError:
        pass  # a leftover stays for the next write to try again; the cache itself was written


def _private_directory(path: Path) -> None:
    """Raises ValueError unless the directory is this user's and nobody else may write in it."""
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ValueError(f"its directory {path} is not this user's")
    if info.st_mode & 0o022:
        raise ValueError(f"others may write in its directory {path} (mode {stat.S_IMODE(info.st_mode):o})")


def _entry(name: object, value: object) -> bool:
    return (isinstance(name, str) and isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], str)
            and isinstance(value[1], dict) and isinstance(value[1].get("generation"), str)
            and (value[2] is True or isinstance(value[2], tuple)))
