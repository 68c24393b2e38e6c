"""Shared fixtures: the repository root, and running the `fleet` CLI in-process or as a process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def fleet_bin(name: str = "fleet") -> str:
    """The console script installed beside this interpreter (what a user runs)."""
    path = BIN / name
    assert path.exists(), f"{path} is missing: install the project (pip install -e '.[dev]')"
    return str(path)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
            cwd: Path | None = None, input: str | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([fleet_bin(), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd, input=input)


E2E_MODULE = "\npytestmark = pytest.mark.e2e\n"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m "not e2e"` does not import a module whose tests are all end-to-end (its `pytestmark`):
    their imports (openai, torch) were most of the quick suite's collection time."""
    if (config.option.markexpr or "").strip() != "not e2e" or collection_path.suffix != ".py":
        return None
    try:
        return E2E_MODULE in collection_path.read_text(encoding="utf-8") or None
    except OSError:
        return None


# The modules that take longest (wall time, measured with -n 4 on 2 cores: test_packaging ~190 s,
# test_pipeline ~140, test_demo ~115 with its model converted and ~200 without, the rest 55-115),
# first: pytest-xdist hands modules out in collection order, and one of them started last was the
# whole run's tail (test_demo alone for its last ~4 minutes).
SLOWEST = ("tests/e2e/test_demo.py", "tests/e2e/test_packaging.py", "tests/e2e/test_pipeline.py",
           "tests/e2e/test_plan_apply.py", "tests/e2e/test_gpus.py", "tests/integration/test_weights.py",
           "tests/e2e/test_adapter_pipeline.py", "tests/e2e/test_corrupt_served.py", "tests/e2e/test_adapter.py",
           "tests/e2e/test_serve.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Directory, level and mark agree: tests/unit is in process (never e2e), tests/e2e starts whole
    fleets (all e2e), tests/integration one real process at a time, marked e2e where that process is
    an agent, worker, engine or `fleet`. A test filed against its mark is a collection error. And
    the SLOWEST modules run first (a stable sort: within a module, the order is the file's)."""
    rank = {path: k for k, path in enumerate(SLOWEST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(ROOT).as_posix(), len(SLOWEST)))
    wrong = []
    for item in items:
        parts = item.path.relative_to(ROOT).parts
        e2e = item.get_closest_marker("e2e") is not None
        if parts[:2] == ("tests", "unit") and e2e or parts[:2] == ("tests", "e2e") and not e2e:
            wrong.append(item.nodeid)
    if wrong:
        raise pytest.UsageError("tests/unit holds no e2e test and tests/e2e only e2e ones (tests/conftest.py); "
                                "move or mark: " + ", ".join(wrong))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two workers a core this process may run on, at most four. The end-to-end tests
    spend much of their time waiting on the processes they start (a worker's start, an apply's
    steps): with a worker a core, a fifth of the 2-core machine sat idle (the suite 12 min 8 s with
    2 workers, 10 min 37 s with 3, 8 min 45 s with 4 and the fork server; README)."""
    return max(1, min(4, 2 * len(os.sched_getaffinity(0))))


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture(autouse=True, scope="session")
def observation_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """plan, apply and observe keep agents' states in FLEET_CACHE_DIR (reconciler/cache/observed.py):
    the tests' go to a directory of the session's, not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLEET_CACHE_DIR", str(tmp_path_factory.mktemp("fleet-cache")))
        yield


@pytest.fixture(scope="session")
def smollm2_f32(request: pytest.FixtureRequest) -> Path:
    """SmolLM2-135M-Instruct as float32 safetensors (exact comparisons), converted from the GGUF on
    first use and kept under .pytest_cache between runs (a conversion takes a minute)."""
    from tests.models import smollm2_safetensors

    return smollm2_safetensors(Path(request.config.cache.mkdir("fleet-models")))


@pytest.fixture(scope="session")
def forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The fork server of this test process (agent/backends/forkserver.py), for the workers tests
    start themselves (tests/forked.py), as an agent's is for its own; started on the first fork."""
    from agent.backends.launch import fork_server
    from agent.serving.registry import BACKENDS

    server = fork_server(BACKENDS.values(), tmp_path_factory.mktemp("forkserver") / "forkserver.log")
    assert server is not None, "no engine names what its fork server preloads"
    yield server
    server.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator[object]:
    """A real PostgreSQL for the session (tests/postgres.py); skipped, saying why, where there is none."""
    from tests import postgres as pg

    why = pg.why_not()
    if why is not None:
        if os.environ.get("FLEET_REQUIRE_POSTGRES"):  # CI has one: a skip there would hide the backend
            pytest.fail(f"FLEET_REQUIRE_POSTGRES is set and there is no PostgreSQL: {why}")
        pytest.skip(f"no PostgreSQL here: {why}")
    yield from pg.start()
