"""How a worker process comes to be: the Launcher seam (is the engine installed, is the port free,
start a command, wait on it, signal it, does it answer), the production launcher over
subprocess.Popen, and the shape of an engine's launch spec (the specs live in agent/backends/)."""

from __future__ import annotations

import errno
import importlib.util
import os
import resource
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import trio

from net import client

from agent.backends.forkserver import ForkServer, die_with_parent
from agent.weights.sealed import MEMFDS_ENV

HEALTH_TIMEOUT_S = 2.0
HEALTH_ANSWER_LIMIT = 1 << 20  # a health answer is a few bytes; a larger one is no answer

# (digest, what it is for people: "model", "draft model") -> the path an engine loads. Raises the
# agent's refusal when the model is not held whole; a spec lets that propagate.
ModelPath = Callable[[str, str], str]


class BadSettings(ValueError):
    """Settings a launch spec cannot turn into a command line; the agent answers 400 bad_request."""


@dataclass(frozen=True, slots=True)
class Command:
    """What to run for one server, and how its speculative settings were applied (None: none asked)."""

    argv: tuple[str, ...]
    speculative: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One engine: the format it serves, the modules it needs (and the extra installing them), the
    path that answers 200 once it is ready, and how settings become its command line. A worker that
    is a Python module (`worker`, run with -m) with `preload` named is forked from the agent's fork
    server (agent/backends/forkserver.py), which imports those modules once for all of them."""

    name: str
    format: str
    modules: tuple[str, ...]
    extra: str
    health: str
    command: Callable[[str, str, int, dict[str, Any], ModelPath], Command]  # (path, host, port, settings, paths)
    worker: str = ""
    preload: tuple[str, ...] = ()


class Process(Protocol):
    """A started worker, as the supervisor sees it."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None:
        """The exit status once it has exited (negative: killed by that signal), else None."""

    async def wait(self) -> int:
        """Wait for the exit without blocking the event loop; the exit status."""

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """Everything the agent's workers ask of the host or do to its processes goes through here."""

    def missing(self, modules: Sequence[str]) -> list[str]:
        """The modules of `modules` this host cannot import (the engine is not installed)."""

    def port_problem(self, host: str, port: int) -> str | None:
        """Why a server could not listen on host:port ("in use", ...), or None when it could."""

    async def launch(self, argv: Sequence[str], log: Path, env: Mapping[str, str],
                     keep_fds: Sequence[int] = ()) -> Process:
        """Start argv with stdout and stderr appended to `log` and `env` added to the agent's own
        environment less its FLEET_* variables (worker_environment; `env` carries what must not be on
        a command line: the worker's credential); `keep_fds` are descriptors the worker inherits at
        the same numbers (an encrypted model's memfds, named in its environment: sealed.MEMFDS_ENV),
        and such a worker never dumps core; OSError if it cannot be started."""

    async def answers(self, url: str, credential: str) -> bool:
        """Whether a GET of url, sent with the worker's credential, answers 200 now (False when
        nothing listens yet)."""


def _die_with_parent_no_core() -> None:
    # A worker holding decrypted weights: a core file would write them to disk.
    die_with_parent()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def worker_environment(agent: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment less every FLEET_* variable (the cluster secret, where the weights key
    is, the agent's home): what an engine needs (PATH, caches, CUDA_*, HF_*, LD_LIBRARY_PATH...) is
    kept, as an allowlist could not know every engine's; the worker's own credential is added after."""
    return {k: v for k, v in agent.items() if not k.startswith("FLEET_")}


def gpu_environment(gpus: Sequence[Mapping[str, Any]], legacy_gpu_ask: bool = False) -> dict[str, str]:
    """What a worker's environment says of its GPUs: CUDA_VISIBLE_DEVICES naming exactly the GPUs it
    was given, by UUID in the order given (CUDA numbers them 0..N-1 in that order, so the engine's
    own device options count from 0); "" for a server given none, so that a CPU server on a GPU
    node never lands on GPU 0. `legacy_gpu_ask`: a start asking for GPUs (tensor_parallel) that names
    none, as a control plane older than the per-GPU ledger sends: the worker sees what the agent sees."""
    if gpus:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g["uuid"]) for g in gpus)}
    return {} if legacy_gpu_ask else {"CUDA_VISIBLE_DEVICES": ""}


def _environment(env: Mapping[str, str]) -> dict[str, str]:
    """A worker's whole environment, forked or not: the agent's less FLEET_*, then its own."""
    return {**worker_environment(os.environ), **env, "PYTHONUNBUFFERED": "1"}


def fork_server(specs: Iterable[LaunchSpec], log: Path) -> ForkServer | None:
    """The fork server for the workers of `specs` that name what to preload, or None when none does
    (every worker then starts as a new process)."""
    forked = [spec for spec in specs if spec.worker and spec.preload]
    if not forked:
        return None
    preload = dict.fromkeys(name for spec in forked for name in spec.preload)  # in order, once each
    return ForkServer([spec.worker for spec in forked], list(preload), log, worker_environment(os.environ))


class PopenProcess:
    """A child started by ProcessLauncher."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    async def wait(self) -> int:
        """On the child's pidfd where Linux has one, else by polling."""
        try:
            fd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            while self.proc.poll() is None:
                await trio.sleep(0.1)
            return self.proc.returncode
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
        return self.proc.wait()

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.proc.kill()


class ProcessLauncher:
    """The production launcher: real processes that die with the agent, health asked over HTTP.
    Given a fork server (agent/backends/forkserver.py), the workers it can fork are forked there,
    the rest (and all of them once it cannot) started as new processes."""

    def __init__(self, forks: ForkServer | None = None) -> None:
        self.forks = forks

    def missing(self, modules: Sequence[str]) -> list[str]:
        return [m for m in modules if importlib.util.find_spec(m) is None]

    def port_problem(self, host: str, port: int) -> str | None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the engines do: TIME_WAIT is no problem
            try:
                s.bind((host, port))
            except OSError as exc:
                return "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        return None

    async def launch(self, argv: Sequence[str], log: Path, env: Mapping[str, str],
                     keep_fds: Sequence[int] = ()) -> Process:
        if self.forks is not None and self.forks.forks(argv, env, keep_fds):
            forked = await self.forks.launch(argv, log, _environment(env))
            if forked is not None:
                return forked
        return self.start(argv, log, env, keep_fds)

    def start(self, argv: Sequence[str], log: Path, env: Mapping[str, str],
              keep_fds: Sequence[int] = ()) -> PopenProcess:
        """A new process, as `launch` starts one: exec'd, not forked from the fork server."""
        if keep_fds:
            env = {**env, MEMFDS_ENV: ",".join(map(str, keep_fds))}
        with open(log, "ab") as out:
            # Call this from the event loop's own thread, on purpose: PR_SET_PDEATHSIG fires when the
            # *thread* that forked the child exits, and trio's open_process forks from a worker
            # thread that idles out after a few seconds, killing healthy servers.
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent_no_core if keep_fds else die_with_parent,
                                    pass_fds=tuple(keep_fds),
                                    env=_environment(env))
        return PopenProcess(proc)

    async def answers(self, url: str, credential: str) -> bool:
        # A connection of its own each time (net/client.py's one-shot GET): nothing is held that is
        # tied to one event loop or one worker's lifetime.
        try:
            with trio.fail_after(HEALTH_TIMEOUT_S):
                answer = await client.get(url, headers=[("Authorization", f"Bearer {credential}")],
                                          limit=HEALTH_ANSWER_LIMIT)
        except (client.ClientError, trio.TooSlowError):
            return False
        return answer.status == 200
