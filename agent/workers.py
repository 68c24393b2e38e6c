"""Server processes: start (returning at once), supervise to `running` or `failed` with the full
reason, stop (SIGTERM, then SIGKILL), and never restart on their own."""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import trio

from .store import Store

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
DEFAULT_STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
TAIL_LINES = 40

BACKENDS = {
    # backend: (format it serves, modules it needs, the extra that installs them, health path)
    "llama_cpp": ("gguf", ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context",
                           "pydantic_settings"), "gguf", "/v1/models"),
    "torch": ("safetensors", ("torch", "transformers"), "torch", "/health"),
}


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _die_with_parent() -> None:
    # Linux: the worker gets SIGKILL when the agent dies, even by SIGKILL: no orphans.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def port_free(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return None


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    # Progress bars redraw with \r; keep what a person would have seen last on each line.
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(kept[-lines:])


@dataclass
class Server:
    id: str
    digest: str
    backend: str
    host: str
    port: int
    settings: dict[str, Any]
    speculative: dict[str, Any] | None
    argv: list[str]
    log: Path
    state: str = "starting"
    pid: int | None = None
    reason: str | None = None
    exit: dict[str, Any] | None = None
    started: float = field(default_factory=time.time)
    proc: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "model": self.digest, "backend": self.backend,
                "host": self.host, "port": self.port, "pid": self.pid, "settings": self.settings,
                "speculative": self.speculative, "uptime_s": round(time.time() - self.started, 1),
                "reason": self.reason, "exit": self.exit}


def _describe_exit(code: int) -> tuple[str, dict[str, Any]]:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"was killed by signal {-code} ({name})", {"code": None, "signal": -code}
    return f"exited with code {code}", {"code": code, "signal": None}


async def _wait(proc: subprocess.Popen[bytes]) -> int:
    """Wait for a child without blocking the loop: on its pidfd where Linux has one, else by polling."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        while proc.poll() is None:
            await trio.sleep(0.1)
        return proc.returncode
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    return proc.wait()


class Workers:
    def __init__(self, home: Path, store: Store, spawn: Callable[..., None], default_host: str) -> None:
        self.store = store
        self.spawn = spawn
        self.default_host = default_host
        self.logs = home / "servers"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.servers: dict[str, Server] = {}

    def using(self, digest: str) -> str | None:
        for s in self.servers.values():
            if s.state in ("starting", "running", "stopping") and (
                    s.digest == digest or (s.speculative or {}).get("draft_digest") == digest):
                return s.id
        return None

    def _model_path(self, digest: str, what: str) -> tuple[str, dict[str, Any]]:
        if not self.store.is_present(digest):
            raise Refused(409, "model_not_held", f"{what} {digest} is not held on this node; replicate it first")
        entry = self.store.entry(digest)
        if entry["slice"]:
            raise Refused(409, "model_is_slice", f"{what} {digest} is held only as a slice (layers "
                                                 f"{entry['slice']['layers']}); serving a slice is not supported")
        return entry["path"], entry

    def start(self, body: dict[str, Any]) -> Server:
        sid = body.get("id")
        if not isinstance(sid, str) or not ID_RE.match(sid):
            raise Refused(400, "bad_request", "id must be 1-128 letters, digits, '.', '_', '@' or '-'")
        old = self.servers.get(sid)
        if old is not None and old.state in ("starting", "running", "stopping"):
            raise Refused(409, "server_exists", f"server {sid} is already {old.state}; stop it first")
        digest, port = body.get("model"), body.get("port")
        if not isinstance(digest, str):
            raise Refused(400, "bad_request", "model must be a model digest")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise Refused(400, "bad_request", "port must be an integer 1-65535")
        host = body.get("host") or self.default_host
        settings = body.get("settings") or {}
        if not isinstance(settings, dict):
            raise Refused(400, "bad_request", "settings must be an object")
        path, entry = self._model_path(digest, "model")
        backend = "llama_cpp" if entry["format"] == "gguf" else "torch"
        _, modules, extra, _ = BACKENDS[backend]
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise Refused(409, "backend_not_installed",
                          f"the {backend} backend needs {', '.join(missing)}, not installed on this node: "
                          f"pip install 'fleet[{extra}]'")
        problem = port_free(host, port)
        if problem:
            raise Refused(409, "port_unavailable", f"port {port} on {host} is {problem}; another server or "
                                                    "process holds it")
        argv, speculative = self._argv(backend, path, host, port, settings)
        log = self.logs / f"{sid}.log"
        log.write_bytes(b"")
        server = Server(sid, digest, backend, host, port, settings, speculative, argv, log)
        self.servers[sid] = server
        self.spawn(self._supervise, server)
        return server

    def _argv(self, backend: str, path: str, host: str, port: int,
              s: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
        spec = s.get("speculative")
        speculative = None
        if backend == "llama_cpp":
            argv = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--host", host, "--port", str(port)]
            if s.get("context_length"):
                argv += ["--n_ctx", str(s["context_length"])]
            if s.get("threads"):
                argv += ["--n_threads", str(s["threads"])]
            if s.get("batch_size"):
                argv += ["--n_batch", str(s["batch_size"])]
            if isinstance(s.get("tensor_parallel"), int) and s["tensor_parallel"] > 0:
                argv += ["--n_gpu_layers", "-1"]
            if spec:
                if spec.get("mode") == "prompt_lookup":
                    argv += ["--draft_model", "prompt-lookup-decoding"]
                    if spec.get("tokens"):
                        argv += ["--draft_model_num_pred_tokens", str(spec["tokens"])]
                    speculative = {**spec, "applied": True, "how": "llama.cpp prompt-lookup decoding"}
                else:
                    speculative = {**spec, "applied": False,
                                   "how": "llama-cpp-python's server drafts only by prompt lookup; a separate "
                                          "draft model is recorded but not used"}
            return argv, speculative
        argv = [sys.executable, "-m", "agent.backends.torch_worker", "--model", path, "--host", host,
                "--port", str(port)]
        if s.get("context_length"):
            argv += ["--context-length", str(s["context_length"])]
        if s.get("threads"):
            argv += ["--threads", str(s["threads"])]
        if spec:
            if spec.get("mode") == "prompt_lookup":
                argv += ["--prompt-lookup", str(spec.get("tokens") or 10)]
                speculative = {**spec, "applied": True, "how": "transformers prompt-lookup decoding"}
            else:
                draft_digest = spec.get("draft_digest")
                if not isinstance(draft_digest, str):
                    raise Refused(400, "bad_request", "speculative draft needs draft_digest: the draft model's digest")
                draft_path, _ = self._model_path(draft_digest, "draft model")
                argv += ["--draft", draft_path]
                speculative = {**spec, "applied": True, "how": "transformers assisted generation"}
        return argv, speculative

    async def _supervise(self, server: Server) -> None:
        timeout = float(server.settings.get("startup_timeout_s") or DEFAULT_STARTUP_TIMEOUT_S)
        health = BACKENDS[server.backend][3]
        with open(server.log, "ab") as log:
            try:
                # Spawned from the event loop's own thread, on purpose: PR_SET_PDEATHSIG fires when
                # the *thread* that forked the child exits, and trio's open_process forks from a
                # worker thread that idles out after a few seconds, killing healthy servers.
                proc = subprocess.Popen(server.argv, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
            except OSError as exc:
                server.state, server.reason = "failed", f"could not start {server.argv[0]}: {exc}"
                return
        server.proc, server.pid = proc, proc.pid
        async with trio.open_nursery() as nursery:
            async def watch_health() -> None:
                url = f"http://{server.host}:{server.port}{health}"
                deadline = trio.current_time() + timeout
                async with httpx.AsyncClient(timeout=2) as client:
                    while server.state == "starting":
                        try:
                            if (await client.get(url)).status_code == 200:
                                server.state = "running"
                                return
                        except httpx.TransportError:
                            pass
                        if trio.current_time() > deadline:
                            server.state = "failed"
                            server.reason = (f"did not answer its health check ({health}) within {timeout:g}s "
                                             f"(startup_timeout_s); killed")
                            proc.kill()
                            return
                        await trio.sleep(0.25)

            nursery.start_soon(watch_health)
            code = await _wait(proc)
            nursery.cancel_scope.cancel()
        how, server.exit = _describe_exit(code)
        if server.state == "stopping":
            server.state = "stopped"
            return
        stderr = tail(server.log)
        first = server.reason if server.state == "failed" and server.reason else f"the worker {how}"
        server.state = "failed"
        server.reason = f"{first}\n--- last lines of its output ({server.log}) ---\n{stderr}" if stderr else first

    async def stop(self, sid: str, grace: float = STOP_GRACE_S) -> Server:
        server = self.servers.get(sid)
        if server is None:
            raise Refused(404, "server_not_found", f"no server {sid} on this node")
        if server.proc is not None and server.proc.poll() is None:
            server.state = "stopping"
            server.proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace):
                while server.proc.poll() is None:
                    await trio.sleep(0.05)
            if server.proc.poll() is None:
                server.proc.kill()
                await _wait(server.proc)
            while server.state == "stopping":  # let the supervisor record the exit
                await trio.sleep(0.01)
        self.servers.pop(sid, None)
        server.state = "stopped"
        return server

    async def stop_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for sid in list(self.servers):
                nursery.start_soon(self.stop, sid)

