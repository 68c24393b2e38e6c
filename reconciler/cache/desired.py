"""The desired state a fleet file validated to, kept between runs beside the observed states, so
that `fleet plan` (apply, observe, and `fleet serve` as it starts: commands._load) of an unchanged
file skips composing, the schema and the checks.

At 10,000 nodes reading the file is ~0.75 s of a warm plan's ~3.7 s of CPU (YAML composed with its
marks, the schema, the checks, the frozen values); reading it back from here is the file's bytes,
their sha256 and a marshal load (bench/plan_scale.py's "read the file" step shows both).

Only a file that validated cleanly (no errors) is kept, with its warnings, which are printed as if
it had been read. A kept entry is used only for the same text (sha256 of the file's bytes, its BOM
aside), under the same name (its diagnostics name the file), in the same directory (a relative
`agent_ca_file` is resolved beside the file) and, when there is a CA file, only while the value
written still names it (`~` is the home directory, $HOME, of each run) and it still holds a PEM
certificate (the checks read nothing else besides the file: no other environment variable). The file carries a tag
naming the Python, fleet's version, the fleet schema and the code that loads and checks a file
(so a checker changed in a working tree does not trust what an older one passed); it is kept with
obscache's protections (obscache.read_private / write_private: 0600 in a private 0700 directory,
no link or FIFO followed, a checksum), ignored with `desired_cache_ignored` when it cannot be used,
and FLEET_OBSERVE_CACHE=off switches it off with the observed states' cache."""

from __future__ import annotations

import functools
import gc
import hashlib
import importlib.metadata
import importlib.util
import marshal
import os
import re
import sys
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from wire.layers import LayerRange

from reconciler import __version__
from reconciler import schemas
from reconciler.fleetfile import config, checks as config_checks, source
from reconciler.fleetfile.config import Loaded
from reconciler.core.diagnostics import Diagnostic, Pos, Severity, SourceRange
from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec, PipelineSpec, Placement, ReplicaSpec, ServeTlsSpec, Settings, SpeculativeSpec
from reconciler.cache.observed import Warn, cache_path, code_digest, read_kept, reason, write_private

MAGIC = b"fleet desired-state cache 1\n"
IGNORED = "desired_cache_ignored"  # the stable codes of this cache's warnings
NOT_KEPT = "desired_cache_not_kept"
MAX_BYTES = 64 << 20
_TYPES: dict[str, type] = {t.__name__: t for t in (
    Desired, ControlPlaneSpec, ServeTlsSpec, NodeSpec, ModelSpec, ReplicaSpec, LayerRange, ClusterSpec, Settings,
    SpeculativeSpec, PipelineSpec, Placement, Diagnostic, SourceRange, Pos)}


CODE = ("reconciler.fleetfile.config", __name__)  # what loads and checks a file, and what keeps and rebuilds its values


def _code_digest() -> str:
    """What a kept validation depends on besides the file: the schema, the code that loads and
    checks a file (every fleet module it may run, obscache.fleet_sources, and this one, which
    rebuilds the values), the libraries that parse and validate it, and the shape of the values
    (their fields, in order: they are rebuilt by position). ~1 ms of CPU, on every run."""
    h = hashlib.sha256(schemas.schema_path("fleet.schema.json").read_bytes())
    h.update(code_digest(*CODE).encode())
    h.update(_versions("PyYAML:yaml", "jsonschema:jsonschema", "fastjsonschema:fastjsonschema").encode())
    for name, t in sorted(_TYPES.items()):
        h.update(f"{name}:{','.join(f.name for f in fields(t))};".encode())
    return h.hexdigest()[:16]


def _versions(*libraries: str) -> str:
    """Each library's installed version ("DISTRIBUTION:MODULE"), from the name of the .dist-info
    directory beside its module (the wheel format puts it there), not imported: importing PyYAML is
    what a kept validation saves, and importlib.metadata.version took 1.4-8 ms for these three."""
    found = []
    for library in libraries:
        dist, _, module = library.partition(":")
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            found.append(f"{dist} none")
            continue
        site = Path(spec.origin).parent.parent if spec.submodule_search_locations is not None else Path(spec.origin).parent
        wanted = re.compile(rf"{re.sub(r'[-_.]+', '[-_.]', dist)}-([^-]+)\.dist-info", re.I)
        versions = [m[1] for m in map(wanted.fullmatch, _listing(site)) if m is not None]
        found.append(f"{dist} {versions[0] if len(versions) == 1 else _version(dist, spec.origin)}")
    return " ".join(found)


def _version(dist: str, origin: str) -> str:
    """The installed metadata's version; for a copy without any (vendored, frozen, zipped), its
    module file's size and change time stand for it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        try:
            info = os.stat(origin)
        except OSError:
            return "unknown"
        return f"file {info.st_size} {info.st_mtime_ns}"


@functools.cache
def _listing(directory: Path) -> tuple[str, ...]:
    try:
        return tuple(os.listdir(directory))
    except OSError:
        return ()


TAG = f"{sys.implementation.cache_tag} marshal {marshal.version} fleet {__version__} checks {_code_digest()}\n".encode()


def _encode(value: Any) -> Any:
    """A marshal-able twin of a desired state's values: a dataclass as [its name, its fields...]."""
    if isinstance(value, Severity):
        return ["Severity", value.value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return tuple(_encode(v) for v in value)
    if isinstance(value, frozenset) and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v) for k, v in value.items()}
    if is_dataclass(value) and _TYPES.get(type(value).__name__) is type(value):
        return [type(value).__name__, *(_encode(getattr(value, f.name)) for f in fields(value))]
    raise TypeError(f"a {type(value).__name__} is not kept")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        if value[0] == "Severity":
            return Severity(value[1])
        return _TYPES[value[0]](*[_decode(v) for v in value[1:]])
    if isinstance(value, tuple):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    return value


def _encode_desired(d: Desired) -> Any:
    """Nodes and replicas (the many) as bare field tuples, rebuilt by position; the rest generic."""
    if any(type(n) is not NodeSpec for n in d.nodes.values()) or any(type(r) is not ReplicaSpec for r in d.replicas):
        raise TypeError("a node or replica of another type is not kept")
    nodes = {k: tuple(_encode(getattr(n, f.name)) for f in fields(NodeSpec)) for k, n in d.nodes.items()}
    replicas = tuple((r.model, r.node) if r.layers is None else (r.model, r.node, r.layers.first, r.layers.last)
                     for r in d.replicas)
    return (_encode(d.version), _encode(d.control_plane), nodes, _encode(d.models), replicas, _encode(d.clusters),
            _encode(d.delete_last_copy))


def _decode_desired(value: Any) -> Desired:
    version, control_plane, nodes, models, replicas, clusters, delete_last_copy = value
    return Desired(version, _decode(control_plane), {k: NodeSpec(*v) for k, v in nodes.items()}, _decode(models),
                   tuple(ReplicaSpec(*r) if len(r) == 2 else ReplicaSpec(r[0], r[1], LayerRange(r[2], r[3]))
                         for r in replicas), _decode(clusters), delete_last_copy)


def _key(text: str, filename: str) -> tuple[str, str, str]:
    return (hashlib.sha256(text.encode()).hexdigest(), filename, str(Path(filename).resolve().parent))


@dataclass(frozen=True, slots=True)
class DesiredCache:
    path: Path
    warn: Warn

    @classmethod
    def for_file(cls, fleet_file: str | Path, warn: Warn) -> DesiredCache | None:
        """The cache of this fleet file (by its absolute path); None when FLEET_OBSERVE_CACHE=off."""
        path = cache_path("desired", fleet_file)
        return None if path is None else cls(path, warn)

    def load(self, path: str | Path) -> Loaded:
        """config.load(path), from the cache when it holds this very text's validation (and then
        kept there when it validated cleanly)."""
        name = str(path)
        text, diags = source.read_file(path)
        if text is None:
            return Loaded(name, None, tuple(diags), None, None)
        kept = self._kept(text, name)
        if kept is not None:
            return kept
        loaded = config.load_text(text, name)
        self.keep(loaded)
        return loaded

    def _kept(self, text: str, name: str) -> Loaded | None:
        record = read_kept(self.path, MAGIC, TAG, self._ignored, MAX_BYTES)
        if record is None:
            return None
        collecting = gc.isenabled()
        gc.disable()  # tens of thousands of values in no cycle: the collector's passes over them were half the load
        try:
            key, desired, diags, digest, given = record
            if tuple(key) != _key(text, name):
                return None  # another text (or name, or place): read whole, then kept in its place
            loaded = Loaded(name, _decode_desired(desired), tuple(_decode(diags)), None, digest, text, cached=True)
            if not isinstance(loaded.desired, Desired) or not all(isinstance(d, Diagnostic) for d in loaded.diagnostics):
                raise TypeError("not a desired state")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            self._ignored(f"it does not parse: {type(exc).__name__} {exc}")
            return None
        finally:
            if collecting:
                gc.enable()
        ca = next((n.ca_file for n in loaded.desired.nodes.values()), None)
        if ca is not None and (not isinstance(given, str) or str(config_checks.ca_file_path(name, given)) != ca):
            return None  # it names another file now (`~` is $HOME's): read whole, then kept in its place
        if ca is not None and config_checks.ca_file_problem(Path(ca)) is not None:
            return None  # checked again, with its diagnostic, by reading the file whole
        return loaded

    def _ignored(self, why: str) -> None:
        self.warn(f"[{IGNORED}] the cache of the validated fleet file {self.path} is ignored ({why}); the file "
                  "is read whole")

    def keep(self, loaded: Loaded) -> None:
        """Keep what this file validated to, when it validated cleanly (else nothing)."""
        if not loaded.ok or loaded.text is None or loaded.desired is None:
            return
        # agent_ca_file as written, worked out again when the file is read back: what it names
        # depends on the environment ($HOME), which the key does not hold.
        given = None if loaded.document is None else loaded.document.data["control_plane"].get("agent_ca_file")
        if given is None and any(n.ca_file is not None for n in loaded.desired.nodes.values()):
            return
        try:
            payload = marshal.dumps((_key(loaded.text, loaded.filename), _encode_desired(loaded.desired),
                                     _encode(loaded.diagnostics), loaded.digest, given))
            if len(payload) <= MAX_BYTES:
                write_private(self.path, MAGIC, TAG, payload)
        except (OSError, ValueError, TypeError) as exc:
            self.warn(f"[{NOT_KEPT}] cannot keep the validated fleet file in {self.path} "
                      f"({reason(exc)}); the next run "
                      "reads it whole")
