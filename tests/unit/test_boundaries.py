"""The architecture's arrows, enforced: `wire`, `host` and `net` import neither side, `reconciler` and `agent`
import each other never (only `wire` and `host`), and the pure core (the planner, its data types, all of `wire`)
imports no I/O and has no async. Checked twice: by reading every file's imports, function-level ones
included, and by importing the packages in a fresh interpreter and looking at what got loaded."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("wire", "host", "net", "reconciler", "agent")
# host: what both sides ask of the local OS (too impure for wire), itself importing neither side.
# net: the one network layer (HTTP/1.1 codec, streams, server loop, client), below both sides, importing
# neither; it takes the floor a bulk body is held to from wire/floor.py (the pure part both sides share).
MAY_IMPORT = {"wire": {"wire"}, "host": {"host"}, "net": {"net", "wire"}, "reconciler": {"reconciler", "wire", "host", "net"},
              "agent": {"agent", "wire", "host", "net"}}
WIRE = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "wire").rglob("*.py"))
PURE = ["reconciler/planning/planner.py", "reconciler/planning/weights.py", "reconciler/planning/plan.py", "reconciler/core/observed.py",
        "reconciler/core/desired.py", "reconciler/core/diagnostics.py"] + WIRE
FORBIDDEN = {"os", "subprocess", "trio", "httpx", "socket", "ssl", "select", "selectors", "threading", "time",
             "sqlite3", "shutil", "asyncio", "pathlib", "starlette", "hypercorn", "httptools", "psutil"}
# Loaded as a side effect of the standard library (importlib.metadata pulls in socket via email),
# so the fresh-interpreter check looks for what only our own imports would bring.
FORBIDDEN_LOADED = {"trio", "httpx", "subprocess", "sqlite3", "asyncio", "ssl", "starlette", "hypercorn"}
# Engines and model tooling: a module importing one of these at its top runs in a worker process
# or a test helper, and the fresh-interpreter check (which must not need the extras) skips it.
ENGINES = {"torch", "transformers", "llama_cpp", "gguf", "safetensors", "numpy", "tokenizers", "fastapi",
           "uvicorn", "accelerate", "pynvml"}


def source_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.Module) -> set[str]:
    """Top-level names of every absolute import in the file: at module level, inside functions,
    under `if TYPE_CHECKING`, everywhere (relative imports stay inside their own package)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


ALL_FILES = [p for pkg in PACKAGES for p in source_files(pkg)]


@pytest.mark.parametrize("path", ALL_FILES, ids=[str(p.relative_to(ROOT)) for p in ALL_FILES])
def test_each_package_imports_only_the_packages_below_it(path: Path) -> None:
    package = path.relative_to(ROOT).parts[0]
    crossing = imported_modules(parse(path)) & (set(PACKAGES) - MAY_IMPORT[package])
    assert not crossing, f"{path.relative_to(ROOT)} ({package}) imports {sorted(crossing)}: " \
                         f"{package} may import only {sorted(MAY_IMPORT[package])}; shared contracts go in wire/"


@pytest.mark.parametrize("path", PURE)
def test_pure_modules_import_no_io(path: str) -> None:
    tree = parse(ROOT / path)
    for node in ast.walk(tree):
        assert not isinstance(node, (ast.AsyncFunctionDef, ast.Await)), f"{path} has async code"
    impure = imported_modules(tree) & FORBIDDEN
    assert not impure, f"{path} imports {sorted(impure)}"


def top_level_targets(path: Path) -> tuple[set[str], set[str]]:
    """(third-party top-level names, our own modules) that `path` imports when it is loaded."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    outside, ours = set(), set()
    for node in parse(path).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else []) + \
                   (node.module.split(".") if node.module else [])
            names = [".".join(base)] + [".".join(base + [a.name]) for a in node.names]
        else:
            continue
        for n in names:
            if n.split(".")[0] in PACKAGES:
                ours.add(n)
            else:
                outside.add(n.split(".")[0])
    return outside, ours


def importable(package: str) -> list[str]:
    """Every module of `package` that the core install can import: none that needs an engine,
    directly or through another of our modules."""
    graph = {module_name(p): top_level_targets(p) for pkg in PACKAGES for p in source_files(pkg)}
    needs_engine = {m for m, (outside, _) in graph.items() if outside & ENGINES}
    while grown := {m for m, (_, ours) in graph.items() if m not in needs_engine and ours & needs_engine}:
        needs_engine |= grown
    return [m for m in graph if m.split(".")[0] == package and m not in needs_engine]


def loaded_by(modules: list[str]) -> set[str]:
    """sys.modules after importing `modules` in a fresh interpreter (not measured by coverage.py, whose
    own data file would load sqlite3 there: pyproject.toml's [tool.coverage.run] patches subprocesses)."""
    code = ("import importlib, json, sys\n"
            "for m in json.loads(sys.argv[1]): importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(modules)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout))


def in_package(modules: set[str], package: str) -> set[str]:
    return {m for m in modules if m == package or m.startswith(package + ".")}


@pytest.mark.parametrize("package, other", [("reconciler", "agent"), ("agent", "reconciler")])
def test_importing_one_side_loads_nothing_of_the_other(package: str, other: str) -> None:
    modules = importable(package)
    assert len(modules) > 10  # the whole package, not an empty list that proves nothing
    loaded = loaded_by(modules)
    assert not in_package(loaded, other), f"importing {package} loaded {sorted(in_package(loaded, other))}"


def test_importing_wire_loads_neither_side_nor_any_io_library() -> None:
    loaded = loaded_by(importable("wire"))
    assert in_package(loaded, "wire") >= {module_name(ROOT / p) for p in WIRE}
    assert not in_package(loaded, "reconciler") | in_package(loaded, "agent")
    assert not loaded & FORBIDDEN_LOADED, sorted(loaded & FORBIDDEN_LOADED)


def test_importing_the_planner_pulls_in_no_io_library() -> None:
    loaded = loaded_by(["reconciler.planning.planner"])
    assert not loaded & FORBIDDEN_LOADED, sorted(loaded & FORBIDDEN_LOADED)
    assert not in_package(loaded, "agent")


# Inside each side, the sub-packages (and top-level modules) are layers: each may import only those
# named here (and itself). Read off the imports, function-level and TYPE_CHECKING ones included, so
# that no arrow runs from a lower layer back up and no two parts import each other.
LAYERS = {
    "reconciler": {
        "core": set(),  # the values: desired, observed, diagnostics
        "schemas": set(),  # fleet's JSON Schemas and the validator class
        "fleetfile": {"core", "schemas"},
        "agents": {"core", "schemas"},
        "state": set(),
        "cache": {"core", "schemas", "fleetfile"},
        "planning": {"core"},
        "applying": {"core", "schemas", "agents", "state", "planning"},
        "serve": {"core", "agents", "state", "planning"},
        "cli": {"core", "schemas", "fleetfile", "agents", "state", "cache", "planning", "applying", "serve"},
    },
    "agent": {
        "auth": set(),
        "machine": set(),
        "weights": set(),
        "transfer": {"weights"},
        "backends": {"auth", "weights"},  # launch specs and the workers they start
        "serving": {"auth", "weights", "backends"},
        "api": {"machine", "weights", "transfer", "serving"},
        "app": {"auth", "machine", "weights", "transfer", "serving", "backends", "api"},
        "simulation": {"machine", "weights", "transfer", "serving", "backends", "api", "app"},
        "arguments": set(),
        "cli": {"auth", "machine", "weights", "transfer", "serving", "backends", "api", "app", "simulation",
                "arguments"},
    },
}


def part_of(module: str) -> str:
    """The layer a module of ours belongs to: its sub-package or top-level module under its side."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def own_imports(path: Path) -> set[str]:
    """Every module of our own that `path` names in an import, as absolute dotted names."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else []) + \
                   (node.module.split(".") if node.module else [])
            joined = ".".join(base)
            if len(base) == 1:  # `from reconciler import x`: x is the part
                out |= {f"{joined}.{a.name}" for a in node.names}
            else:
                out.add(joined)
    return {m for m in out if m.split(".")[0] in PACKAGES}


LAYERED = [p for side in LAYERS for p in source_files(side) if p.relative_to(ROOT).parts[1] != "__init__.py"]


@pytest.mark.parametrize("path", LAYERED, ids=[str(p.relative_to(ROOT)) for p in LAYERED])
def test_each_part_imports_only_the_parts_below_it(path: Path) -> None:
    side = path.relative_to(ROOT).parts[0]
    mine = part_of(module_name(path))
    assert mine in LAYERS[side], f"{path.relative_to(ROOT)}: {mine!r} is not a part of {side} named in LAYERS"
    allowed = LAYERS[side][mine] | {mine, "__version__"}
    crossing = {m for m in own_imports(path) if m.split(".")[0] == side and part_of(m) not in allowed}
    assert not crossing, f"{path.relative_to(ROOT)} ({side}.{mine}) imports {sorted(crossing)}; " \
                         f"{mine} may import only {sorted(LAYERS[side][mine])}"


@pytest.mark.parametrize("side", list(LAYERS))
def test_each_side_holds_under_a_dozen_parts(side: str) -> None:
    parts = {p.name.removesuffix(".py") for p in (ROOT / side).iterdir()
             if p.name != "__init__.py" and p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir())}
    assert parts == set(LAYERS[side]), sorted(parts ^ set(LAYERS[side]))
    assert len(parts) < 12


# The one network layer (issue 30): the agent and the control plane serve on net/, and a stock ASGI
# server (hypercorn, uvicorn) is started only by a worker process, through its public entry points.
STOCK_SERVERS = {"hypercorn", "uvicorn"}
PUBLIC_SERVER_API = {"hypercorn.config", "hypercorn.trio", "uvicorn"}
WORKERS = {"agent/backends/torch/worker.py", "agent/backends/pipeline/web.py", "agent/backends/llama_cpp/batched.py",
           "agent/backends/llama_cpp/worker.py"}


def dotted_imports(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("path", ALL_FILES, ids=[str(p.relative_to(ROOT)) for p in ALL_FILES])
def test_only_workers_start_a_stock_server_and_only_by_its_public_api(path: Path) -> None:
    name = str(path.relative_to(ROOT))
    servers = {m for m in dotted_imports(parse(path)) if m.split(".")[0] in STOCK_SERVERS}
    if name not in WORKERS:
        assert not servers, f"{name} imports {sorted(servers)}: serve on net/ (net/server.py)"
    assert servers <= PUBLIC_SERVER_API, f"{name} imports {sorted(servers - PUBLIC_SERVER_API)}: a server's internals"
