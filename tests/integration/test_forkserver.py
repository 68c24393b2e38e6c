"""The fork server (agent/backends/forkserver.py): a worker forked there gets what Popen would give
it, its exit is told as Popen tells it, it dies with the server and the server with the agent, and a
server that cannot fork safely hands every worker back to Popen. Real processes throughout; the
workers are small modules written into the test's directory (its working directory, as the agent's
is the workers')."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from agent.backends.forkserver import ForkServer, ForkedProcess
from agent.backends.launch import ProcessLauncher, worker_environment

PROBE = """
import json, os, sys, time
st, null = os.fstat(0), os.stat(os.devnull)
print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "ppid": os.getppid(),
                  "name": __name__, "stdin_null": (st.st_dev, st.st_ino) == (null.st_dev, null.st_ino),
                  "loaded": "heavy_probe_dep" in sys.modules,
                  "title": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode()}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


def ended(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"  # its parent has yet to reap it
    except OSError:
        return True


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not ended(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "heavy_probe_dep.py").write_text("VALUE = 1\n")
    (tmp_path / "threads_at_import.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def server(workdir: Path, preload: tuple[str, ...] = ("heavy_probe_dep",)) -> ForkServer:
    return ForkServer(["probe"], preload, workdir / "forkserver.log", worker_environment(os.environ))


def argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "probe", *args]


def test_a_forked_worker_gets_what_popen_gives_it_and_its_exit_code(workdir: Path) -> None:
    forks = server(workdir)
    env = {"PATH": os.environ.get("PATH", ""), "FLEET_WORKER_CREDENTIAL": "c", "CUDA_VISIBLE_DEVICES": "",
           "ONLY_THIS": "1"}

    async def main() -> list[tuple[int, Path]]:
        out = []
        for code in (0, 3, 7):
            log = workdir / f"w{code}.log"
            proc = await forks.launch(argv("exit", str(code)), log, env)
            assert isinstance(proc, ForkedProcess), forks.why_not
            out.append((await proc.wait(), log))
        return out

    try:
        results = trio.run(main)
        assert forks.proc is not None
        server_pid = forks.proc.pid
    finally:
        forks.close()
    assert [code for code, _ in results] == [0, 3, 7]
    for code, log in results:
        first, second = log.read_text().splitlines()
        seen = json.loads(first)
        assert second == "to stderr"  # both streams appended to the log
        assert seen["argv"] == ["exit", str(code)] and seen["name"] == "__main__"
        assert seen["env"] == env  # exactly what was sent: nothing of the server's own, no FLEET_* but its own
        assert seen["cwd"] == str(workdir) and seen["stdin_null"] and seen["ppid"] == server_pid
        assert seen["loaded"]  # the preload came with the fork, not imported again
        assert seen["title"] == f"{sys.executable} -m probe exit {code}"  # what ps shows: its own command line


def test_a_signal_reaches_the_worker_and_its_exit_is_told_as_popen_tells_it(workdir: Path) -> None:
    forks = server(workdir)
    env = {"CUDA_VISIBLE_DEVICES": ""}

    async def main() -> tuple[int | None, int, int | None]:
        log = workdir / "w.log"
        proc = await forks.launch(argv("sleep", "0"), log, env)
        assert proc is not None, forks.why_not
        while not log.read_text():  # running its module
            await trio.sleep(0.02)
        before = proc.poll()
        proc.send_signal(signal.SIGTERM)
        code = await proc.wait()
        proc.kill()  # after the end: nothing, as with Popen
        return before, code, proc.poll()

    try:
        before, code, after = trio.run(main)
    finally:
        forks.close()
    assert before is None and code == -signal.SIGTERM and after == -signal.SIGTERM


def test_the_workers_die_with_the_server(workdir: Path) -> None:
    forks = server(workdir)

    async def main() -> tuple[int, int]:
        proc = await forks.launch(argv("sleep", "0"), workdir / "w.log", {"CUDA_VISIBLE_DEVICES": ""})
        assert proc is not None and forks.proc is not None, forks.why_not
        while not (workdir / "w.log").read_text():
            await trio.sleep(0.02)
        forks.proc.kill()
        return proc.pid, await proc.wait()

    try:
        pid, code = trio.run(main)
        dead = ended(pid)  # told only once it has ended: its port is free for the next start
    finally:
        forks.close()
    assert code == -signal.SIGKILL and dead


AGENT = """
import os, sys, trio
from pathlib import Path
from agent.backends.forkserver import ForkServer

async def main():
    forks = ForkServer(["probe"], (), Path("forkserver.log"), dict(os.environ))
    proc = await forks.launch([sys.executable, "-m", "probe", "sleep", "0"], Path("w.log"), {"CUDA_VISIBLE_DEVICES": ""})
    print(forks.proc.pid, proc.pid, flush=True)
    await trio.sleep(60)

trio.run(main)
"""


def test_the_server_and_its_workers_die_with_the_agent_even_by_sigkill(workdir: Path) -> None:
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert agent.stdout is not None
        server_pid, worker_pid = map(int, agent.stdout.readline().split())
        assert not gone(server_pid, 0.2) and not gone(worker_pid, 0.2)
        agent.kill()
        agent.wait()
        assert gone(server_pid) and gone(worker_pid)
    finally:
        agent.kill()
        agent.wait()


def test_a_server_with_a_thread_beside_it_forks_nothing_and_popen_starts_the_worker(workdir: Path) -> None:
    forks = server(workdir, ("threads_at_import",))
    launcher = ProcessLauncher(forks)
    log = workdir / "w.log"

    async def main() -> tuple[int, str]:
        proc = await launcher.launch(argv("exit", "5"), log, {"CUDA_VISIBLE_DEVICES": ""})
        return await proc.wait(), type(proc).__name__

    try:
        code, kind = trio.run(main)
    finally:
        forks.close()
    assert (code, kind) == (5, "PopenProcess")
    assert forks.why_not is not None and "thread" in forks.why_not, forks.why_not
    assert json.loads(log.read_text().splitlines()[0])["argv"] == ["exit", "5"]


@pytest.mark.parametrize("why, args, env, fds", [
    ("a GPU", argv("x"), {"CUDA_VISIBLE_DEVICES": "GPU-1"}, ()),
    ("every GPU (no CUDA_VISIBLE_DEVICES)", argv("x"), {}, ()),
    ("descriptors to inherit", argv("x"), {"CUDA_VISIBLE_DEVICES": ""}, (5,)),
    ("another module", [sys.executable, "-m", "other"], {"CUDA_VISIBLE_DEVICES": ""}, ()),
    ("another Python", ["/usr/bin/python3", "-m", "probe"], {"CUDA_VISIBLE_DEVICES": ""}, ()),
    ("not a module", [sys.executable, "probe.py"], {"CUDA_VISIBLE_DEVICES": ""}, ()),
])
def test_only_a_module_of_its_own_on_no_gpu_is_forked(why: str, args: list[str], env: dict[str, str],
                                                       fds: tuple[int, ...], workdir: Path) -> None:
    forks = server(workdir)
    assert forks.forks(argv("x"), {"CUDA_VISIBLE_DEVICES": ""}, ())
    assert not forks.forks(args, env, fds), why


def test_two_waiters_and_a_poll_all_see_the_exit(workdir: Path) -> None:
    """The supervisor waits on a worker while stop() polls it and waits too (a worker that outlives
    its grace): each gets the exit, and the next worker's wait is not disturbed."""
    forks = server(workdir)
    env = {"CUDA_VISIBLE_DEVICES": ""}

    async def main() -> tuple[list[int], int]:
        proc = await forks.launch(argv("sleep", "0"), workdir / "a.log", env)
        assert proc is not None, forks.why_not
        seen: list[int] = []

        async def waiter() -> None:
            seen.append(await proc.wait())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            nursery.start_soon(waiter)
            await trio.sleep(0.2)
            assert proc.poll() is None
            proc.kill()
            while proc.poll() is None:
                await trio.sleep(0.01)
        seen.append(proc.poll() or 0)
        after = await forks.launch(argv("exit", "4"), workdir / "b.log", env)
        assert after is not None
        return seen, await after.wait()

    try:
        seen, code = trio.run(main)
    finally:
        forks.close()
    assert seen == [-signal.SIGKILL] * 3 and code == 4


def test_a_cancelled_launch_leaves_no_worker_without_a_handle(workdir: Path) -> None:
    """Launches cancelled at every point of their way (the server's start, the request, the
    answer): every worker the server runs is one a launch returned, and the protocol stays in step."""
    forks = server(workdir)
    env = {"CUDA_VISIBLE_DEVICES": ""}

    async def main() -> tuple[set[int], set[int], int]:
        with trio.move_on_after(0.01):  # in the server's start: dropped, started again by the next
            await forks.launch(argv("sleep", "0"), workdir / "first.log", env)
        first = await forks.launch(argv("sleep", "0"), workdir / "first.log", env)
        assert first is not None, forks.why_not
        kept: list[ForkedProcess] = [first]
        for i in range(40):
            with trio.move_on_after(0.0005 * i):
                proc = await forks.launch(argv("sleep", "0"), workdir / f"c{i}.log", env)
                assert proc is not None, forks.why_not
                kept.append(proc)
        last = await forks.launch(argv("exit", "6"), workdir / "last.log", env)
        assert last is not None and forks.proc is not None
        code = await last.wait()
        running = {int(c) for c in open(f"/proc/{forks.proc.pid}/task/{forks.proc.pid}/children").read().split()}
        returned = {p.pid for p in kept}
        for p in kept:
            p.kill()
            await p.wait()
        return running, returned, code

    try:
        running, returned, code = trio.run(main)
    finally:
        forks.close()
    assert running == returned and returned, (running, returned)
    assert code == 6  # the last launch got its own answer, not an earlier one's
