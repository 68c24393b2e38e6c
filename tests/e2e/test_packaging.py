"""The project as a user installs it: the wheel and sdist built with the standard front-end, checked
as the registry would (twine), then installed into fresh virtual environments, one per extra that
matters, each doing what its extra promises. pip's cache keeps this fast after the first run (the
llama-cpp-python wheel built by scripts/install-dev is reused; torch comes from its pinned file)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.agents import Agent, agent_env, free_port
from tests.conftest import ROOT
from tests.models import tiny_gguf, tiny_safetensors

pytestmark = pytest.mark.e2e

DIST = "inference-fleet"
ENGINES = ("torch", "transformers", "llama_cpp", "gguf", "safetensors", "accelerate", "pynvml")


def sh(*args: str | Path, timeout: float = 900, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    sh(sys.executable, "-m", "build", "--wheel", "--sdist", "--outdir", out, ROOT)
    return out


def wheel_of(dist: Path) -> Path:
    (wheel,) = dist.glob("inference_fleet-*.whl")
    return wheel


def venv(base: Path, name: str, *requirements: str) -> Path:
    """A fresh virtual environment with `requirements` installed; returns its bin directory. pip
    installs without byte-compiling (--no-compile): Python compiles what is imported when it is,
    and compiling every file of torch and transformers was half of this module's time here (a
    torch install: 168 s, 76 s without)."""
    where = base / name
    sh(sys.executable, "-m", "venv", where)
    pip = where / "bin" / "pip"
    sh(pip, "install", "--quiet", "--upgrade", "pip")
    sh(pip, "install", "--quiet", "--no-compile", *requirements)
    return where / "bin"


def test_the_wheel_and_sdist_pass_the_registry_check_and_carry_their_data(dist: Path) -> None:
    sh(sys.executable, "-m", "twine", "check", "--strict", *dist.iterdir())
    names = zipfile.ZipFile(wheel_of(dist)).namelist()
    for package in ("wire", "host", "reconciler", "agent"):
        assert f"{package}/py.typed" in names, package
    assert "reconciler/_schemas/fleet.schema.json" in names and "reconciler/_schemas/agent-state.schema.json" in names
    meta = zipfile.ZipFile(wheel_of(dist)).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Name: {DIST}\n" in meta
    from wire import __version__
    assert f"Version: {__version__}\n" in meta  # one source: wire/__init__.py
    for extra in ("nvml", "torch", "gguf", "postgres", "all"):
        assert f"Provides-Extra: {extra}\n" in meta, extra


def test_the_core_install_validates_and_plans_and_imports_no_engine(dist: Path, tmp_path: Path) -> None:
    bindir = venv(tmp_path, "core", str(wheel_of(dist)))
    assert sh(bindir / "fleet", "--version").stdout.strip()
    valid = subprocess.run([bindir / "fleet", "validate", "-f", ROOT / "examples" / "multi-node.yaml"],
                           capture_output=True, text=True, timeout=120)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    # Every module the core install can load (no engine needed), in one interpreter: none pulls an engine in.
    code = ("import importlib, json, pkgutil, sys\n"
            "import reconciler, agent, wire, host\n"
            "skipped = []\n"
            "for pkg in (wire, host, reconciler):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "import agent.cli, agent.app\n"
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(ENGINES)!r}))))\n")
    loaded = json.loads(sh(bindir / "python", "-c", code, cwd=tmp_path).stdout)
    assert loaded == [], loaded
    missing = subprocess.run([bindir / "python", "-c", "import torch"], capture_output=True, timeout=60)
    assert missing.returncode != 0  # the core install really holds no engine


def serve_one(bindir: Path, tmp_path: Path, model: Path, fmt: str) -> dict[str, object]:
    """An agent from `bindir`'s install, `model` imported and served on it by `fleet apply` from the
    same install; returns the running server's entry once its worker answered a completion."""
    address = "127.0.0.2"
    agent = Agent("cp", address, free_port(address), tmp_path / "cp", bindir=bindir)
    agent.start(timeout=60)
    try:
        digest = json.loads(sh(bindir / "fleet-agent", "import", "--home", agent.home, model, "--json",
                               env=agent_env()).stdout)["digest"]
        port = free_port(address)
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(f"""version: 1
control_plane: {{node: cp}}
nodes:
  cp: {{address: {address}, agent_port: {agent.port}}}
models:
  m: {{format: {fmt}, digest: "{digest}", source: cp}}
replicas:
  m: [cp]
clusters:
  local: {{model: m, members: [cp], port: {port}, settings: {{context_length: 256, threads: 1, startup_timeout_s: 300}}}}
""")
        applied = subprocess.run([bindir / "fleet", "apply", "-f", fleet, "--auto-approve"], capture_output=True,
                                 text=True, timeout=600, env=agent_env(FLEET_STATE_DIR=str(tmp_path / "state")))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        server: dict[str, object] = next(s for s in agent.get("/v1/state").json()["servers"] if s["id"] == "local@cp")
        assert server["state"] == "running", server
        r = httpx.post(f"http://{address}:{port}/v1/completions", timeout=300,
                       headers={"Authorization": f"Bearer {server['credential']}"},
                       json={"model": "local", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
        return server
    finally:
        agent.stop()


def test_the_gguf_extra_alone_serves_a_gguf_model(dist: Path, tmp_path: Path) -> None:
    bindir = venv(tmp_path, "gguf", f"{wheel_of(dist)}[gguf]")
    assert serve_one(bindir, tmp_path, tiny_gguf(tmp_path / "models"), "gguf")["backend"] == "llama_cpp"


def test_the_torch_extra_alone_serves_a_safetensors_model(dist: Path, tmp_path: Path) -> None:
    # torch pinned first, as the README says: a bare `torch` requirement could pull a multi-GB CUDA build.
    bindir = venv(tmp_path, "torch", "torch==2.13.0")
    sh(bindir / "pip", "install", "--quiet", "--no-compile", f"{wheel_of(dist)}[torch]")
    assert serve_one(bindir, tmp_path, tiny_safetensors(tmp_path / "models"), "safetensors")["backend"] == "torch"
