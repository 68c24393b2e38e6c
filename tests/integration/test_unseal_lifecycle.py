"""Encrypted models through their servers' lives, on real files, threads and processes: a failure while
decrypting or linking fails that server with a code (memory that cannot be written is not called
tampering), never the agent; a server stopped while its model is decrypted and started again under
the same id keeps its own links; a stop or a shutdown abandons a decryption at its next chunk; too
little memory is refused before any is used; a worker inherits its own model's memfds and nothing of
the agent's FLEET_* environment, and dumps no core; a process holding the key, and a serving agent
holding none, are closed to the other processes of their user."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import pytest
import trio

from agent.backends.launch import ProcessLauncher
from agent.weights.sealed import make_key
from agent.simulation.simulate import SimulatedLauncher, SimulatedProcess
from agent.weights.store import Store
from agent.weights.unseal import INSUFFICIENT_MEMORY, UNSEAL_FAILED, Unsealer
from agent.serving.supervisor import Workers
from tests.agents import agent_env, enroll, free_port, wait_healthy
from tests.conftest import fleet_bin
from tests.models import tiny_gguf, tiny_safetensors

KEY = make_key(bytes(range(32)))
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Srv:
    id: str
    state: str = "starting"
    reason: str | None = None


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, str, bytes]:
    model = tiny_gguf(tmp_path_factory.mktemp("models"))
    store = Store(tmp_path_factory.mktemp("home"), KEY)
    digest, _ = store.import_model(model, "tiny", encrypt=True)
    return store, digest, model.read_bytes()


async def never(fds: Sequence[int]) -> None:
    raise AssertionError("nothing is supervised when the model is not opened")


def test_a_links_failure_fails_the_server_coded_not_the_agent(tmp_path: Path, held: tuple[Store, str, bytes]) -> None:
    store, digest, _ = held
    (tmp_path / "servers").write_text("")  # the links' parent is a file: ENOTDIR where the links go
    unsealer = Unsealer(store, tmp_path / "servers")
    entry = store.entry(digest)
    server = Srv("s@cp")
    trio.run(unsealer.run, server, unsealer.prepare("s@cp", entry), entry, never)
    assert server.state == "failed", server
    assert server.reason == f"{UNSEAL_FAILED}: model tiny ({digest}): Not a directory", server.reason


def test_too_little_memory_is_refused_naming_what_is_needed(tmp_path: Path, held: tuple[Store, str, bytes]) -> None:
    store, digest, plain = held
    unsealer = Unsealer(store, tmp_path, available=lambda: 1000)
    entry = store.entry(digest)
    server = Srv("s@cp")
    trio.run(unsealer.run, server, unsealer.prepare("s@cp", entry), entry, never)
    assert server.state == "failed"
    assert server.reason == (f"{INSUFFICIENT_MEMORY}: model tiny ({digest}) is decrypted into memory: it needs "
                             f"{len(plain)} bytes, and 1000 are available (MemAvailable); not started"), server.reason
    assert list(tmp_path.iterdir()) == []


NO_ROOM = """import resource, signal, sys
from pathlib import Path
from agent.weights.sealed import make_key
from agent.weights.store import Store
from agent.weights.unseal import Refusal, Unsealer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a memfd is a file: its writes fail as on a full disk
store = Store(Path(sys.argv[1]), make_key(bytes(range(32))))
unsealer = Unsealer(store, Path(sys.argv[2]))
entry = store.entry(sys.argv[3])
try:
    unsealer.open(unsealer.prepare("s@cp", entry), entry)
except Refusal as exc:
    print(exc)
"""


def test_memory_that_cannot_be_written_is_not_called_tampering(tmp_path: Path, held: tuple[Store, str, bytes]) -> None:
    store, digest, _ = held
    done = subprocess.run([sys.executable, "-c", NO_ROOM, str(store.root.parent), str(tmp_path), digest], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == f"{UNSEAL_FAILED}: model tiny ({digest}): tiny-llama.gguf: File too large", done
    assert list(tmp_path.iterdir()) == []


class Stop(Exception):
    pass


def test_stopping_at_any_chunk_leaves_no_descriptor_and_no_links(tmp_path: Path, held: tuple[Store, str, bytes],
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    store, _, _ = held
    digest, manifest = store.import_model(tiny_safetensors(tmp_path_factory.mktemp("st")), "st", encrypt=True)
    entry = store.entry(digest)
    unsealer = Unsealer(store, tmp_path)
    asked: list[int] = []
    whole = unsealer.prepare("s@cp", entry)
    unsealer.open(whole, entry, lambda: asked.append(1))
    unsealer.close(whole)
    chunks = sum(max(1, -(-f["size"] // (1 << 20))) for f in manifest["files"])
    assert len(asked) >= chunks + len(manifest["files"])  # asked before every file and every chunk
    before = sorted(os.listdir("/proc/self/fd"))
    for stop_at in range(len(asked)):
        calls = iter(range(len(asked)))

        def keep_going() -> None:
            if next(calls) == stop_at:
                raise Stop

        opened = unsealer.prepare("s@cp", entry)
        with pytest.raises(Stop):
            unsealer.open(opened, entry, keep_going)
        assert opened.fds == [] and not opened.links.exists()
    assert sorted(os.listdir("/proc/self/fd")) == before and list(tmp_path.iterdir()) == []


def test_an_agent_shutting_down_cancels_a_decryption_at_its_next_chunk(tmp_path: Path,
                                                                       held: tuple[Store, str, bytes]) -> None:
    store, digest, _ = held
    in_thread, cancelled = threading.Event(), threading.Event()

    def available() -> int:  # called in the decrypting thread, before the first chunk
        in_thread.set()
        assert cancelled.wait(30)
        return 1 << 40

    unsealer = Unsealer(store, tmp_path, available=available)
    entry = store.entry(digest)
    server = Srv("s@cp")

    async def main() -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(unsealer.run, server, unsealer.prepare("s@cp", entry), entry, never)
                await trio.to_thread.run_sync(in_thread.wait)
                scope.cancel()
                cancelled.set()
        assert scope.cancelled_caught

    trio.run(main)
    assert server.state == "starting" and list(tmp_path.iterdir()) == []  # nothing decrypted, nothing left


class Recorder(SimulatedLauncher):
    """Starts nothing; keeps what each launch was given, and what its links held at that moment."""

    def __init__(self) -> None:
        self.launched: list[tuple[Path, tuple[int, ...], bytes]] = []

    async def launch(self, argv: Sequence[str], log: Path, env: Mapping[str, str],
                     keep_fds: Sequence[int] = ()) -> SimulatedProcess:
        link = Path(next(a for a in argv if ".sealed/" in a))
        self.launched.append((link, tuple(keep_fds), link.read_bytes()))
        return SimulatedProcess()


def test_stopped_while_decrypting_and_started_again_under_its_id(tmp_path: Path,
                                                                 held: tuple[Store, str, bytes]) -> None:
    store, digest, plain = held
    launcher = Recorder()
    tasks: list[tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]] = []
    workers = Workers(tmp_path, store, lambda fn, *a: tasks.append((fn, a)), launcher, "127.0.0.1")
    body = {"id": "q@cp", "model": digest, "port": free_port("127.0.0.1"), "settings": {"context_length": 256}}

    async def main() -> None:
        first = workers.start(body)
        await workers.stop("q@cp")  # before its decryption has begun: it is gone at once
        second = workers.start(body)  # so the same id may start again
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tasks[1][0], *tasks[1][1])
            while second.state == "starting":
                await trio.sleep(0.01)
            assert second.state == "running", second.reason
            await tasks[0][0](*tasks[0][1])  # the first start's decryption, late: abandoned, touching nothing
            assert first.state == "stopped" and first.reason is None
            [(link, fds, seen)] = launcher.launched
            assert seen == plain and len(fds) == 1 and os.readlink(link) == f"/proc/self/fd/{fds[0]}"
            assert link.read_bytes() == plain  # still there for llama.cpp, which opens it again
            await workers.stop("q@cp")
        assert list((tmp_path / "servers").glob("*.sealed")) == []

    trio.run(main)


PROBE = """import json, os, resource, sys
out = {"env": sorted(k for k in os.environ if k.startswith("FLEET_")), "core": resource.getrlimit(resource.RLIMIT_CORE),
       "sealed_fds": os.environ.get("FLEET_SEALED_FDS")}
for fd in map(int, sys.argv[1:]):
    try:
        out[str(fd)] = open(f"/proc/self/fd/{fd}", "rb").read().decode()
    except OSError as exc:
        out[str(fd)] = exc.strerror
print(json.dumps(out))
"""


def test_a_worker_gets_its_own_memfds_and_no_fleet_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_CLUSTER_SECRET", "s" * 32)
    monkeypatch.setenv("FLEET_WEIGHTS_KEY_FILE", "/etc/fleet/weights.key")
    mine, other = os.memfd_create("fleet:mine", os.MFD_CLOEXEC), os.memfd_create("fleet:other", os.MFD_CLOEXEC)
    os.write(mine, b"my model")
    os.write(other, b"another model")
    try:
        results = []
        for keep in ((mine,), ()):
            log = tmp_path / f"{len(keep)}.log"
            proc = ProcessLauncher().start([sys.executable, "-c", PROBE, str(mine), str(other)], log,
                                            {"FLEET_WORKER_CREDENTIAL": "c"}, keep)
            assert proc.proc.wait(30) == 0, log.read_text()
            results.append(json.loads(log.read_text()))
    finally:
        os.close(mine)
        os.close(other)
    given, plain = results
    # Nothing of the agent's own FLEET_* settings: its credential, and the numbers of the memfds it was given.
    assert given["env"] == ["FLEET_SEALED_FDS", "FLEET_WORKER_CREDENTIAL"] and plain["env"] == ["FLEET_WORKER_CREDENTIAL"], results
    assert given["sealed_fds"] == str(mine), given
    assert given[str(mine)] == "my model" and given[str(other)] == "No such file or directory", given
    assert given["core"] == [0, 0]  # it holds plaintext: no core file
    assert plain[str(mine)] == "No such file or directory"
    assert plain["core"] == list(resource.getrlimit(resource.RLIMIT_CORE))


HOLDER = """import os, sys
from agent.weights.sealed import guard_process
fd = os.memfd_create("fleet:model", 0)
os.write(fd, b"plaintext")
if sys.argv[1] == "guarded":
    assert guard_process()
print(os.getpid(), fd, flush=True)
sys.stdin.read()
"""
READER = """import json, sys
out = {}
for name in ("environ", f"fd/{sys.argv[2]}"):
    try:
        out[name] = open(f"/proc/{sys.argv[1]}/{name}", "rb").read().decode(errors="replace")
    except OSError as exc:
        out[name] = exc.strerror
print(json.dumps(out))
"""


# As root, the processes run without capabilities (what a worker of an unprivileged agent has):
# root's CAP_SYS_PTRACE would open any process, guarded or not, and is out of this guard's reach.
BARE = [shutil.which("setpriv") or "setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []


def read_proc(pid: str, fd: str) -> dict[str, str]:
    read = subprocess.run([*BARE, sys.executable, "-c", READER, pid, fd], capture_output=True, text=True,
                          timeout=30, check=True)
    return json.loads(read.stdout)  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
@pytest.mark.parametrize("how", ["plain", "guarded"])
def test_a_process_holding_the_key_is_closed_to_its_users_other_processes(how: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLEET_PROBE": "in-the-environment"}
    holder = subprocess.Popen([*BARE, sys.executable, "-c", HOLDER, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env, cwd=REPO, text=True)
    try:
        assert holder.stdout is not None
        pid, fd = holder.stdout.readline().split()
        got = read_proc(pid, fd)
    finally:
        holder.kill()
        holder.wait(10)
    if how == "plain":  # what a worker could do before: the test can tell
        assert "FLEET_PROBE=in-the-environment" in got["environ"] and got[f"fd/{fd}"] == "plaintext", got
    else:
        assert got == {"environ": "Permission denied", f"fd/{fd}": "Permission denied"}, got


@pytest.mark.e2e  # a real fleet-agent process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
def test_a_serving_agent_without_a_key_keeps_its_cluster_secret_from_its_users_processes(tmp_path: Path) -> None:
    home, address = tmp_path / "a", "127.0.0.1"
    enroll(home, "a")
    port = free_port(address)
    log = open(tmp_path / "a.log", "w")
    agent = subprocess.Popen([*BARE, fleet_bin("fleet-agent"), "serve", "--home", str(home), "--listen",
                              f"{address}:{port}", "--verify-every", "off"], env=agent_env(), stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://{address}:{port}", timeout=30)
        got = read_proc(str(agent.pid), "0")
    finally:
        agent.terminate()
        agent.wait(15)
    assert got == {"environ": "Permission denied", "fd/0": "Permission denied"}, got


WORKER = """import os, sys, time
from agent.weights.sealed import guard_worker
print(os.getpid(), guard_worker(), flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
@pytest.mark.parametrize("handed", [True, False])
def test_a_worker_handed_a_models_memfds_is_closed_to_the_other_workers(tmp_path: Path, handed: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    fd = os.memfd_create("fleet:model.gguf", os.MFD_CLOEXEC)
    os.write(fd, b"plaintext")
    log = tmp_path / "worker.log"
    try:
        proc = ProcessLauncher().start([*BARE, sys.executable, "-c", WORKER], log, {}, (fd,) if handed else ())
    finally:
        os.close(fd)
    try:
        deadline = time.monotonic() + 30
        while not log.read_text().endswith("\n"):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        pid, guarded = log.read_text().split()
        got = read_proc(pid, str(fd))
    finally:
        proc.kill()
        proc.proc.wait(10)
    if handed:  # exec made it dumpable again; the worker guards itself before it loads anything
        assert guarded == "True" and got == {"environ": "Permission denied", f"fd/{fd}": "Permission denied"}, got
    else:
        assert guarded == "False" and "PYTHONPATH=" in got["environ"], got
