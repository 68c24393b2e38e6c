"""Real fleet-agent processes on their own loopback addresses, for tests and the demo's checks."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from reconciler.agents.netutil import free_port
from tests.conftest import fleet_bin

__all__ = ["SECRET", "Agent", "agent_env", "enroll", "free_port"]

SECRET = "test-cluster-secret-0123456789"


def wait_healthy(url: str, timeout: float = 60) -> None:
    """Wait until GET url/healthz answers 2xx (an agent, or the last of a simulated fleet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url + "/healthz", timeout=1).raise_for_status()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer /healthz within {timeout:g}s") from None
            time.sleep(0.1)


def agent_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "FLEET_CLUSTER_SECRET": SECRET}
    env.update(extra)
    return env


def enroll(home: Path, name: str, exe: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe or fleet_bin("fleet-agent"), "enroll", "--home", str(home), "--name", name],
                          capture_output=True, text=True, env=agent_env(), timeout=30, check=True)


@dataclass
class Agent:
    name: str
    address: str
    port: int
    home: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[str] | None = None
    tls_cert: Path | None = None  # serve HTTPS with this certificate (its key beside it as key.pem)
    bindir: Path | None = None  # run the fleet-agent installed here (another venv) instead of this one's

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_cert else 'http'}://{self.address}:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=str(self.tls_cert)) if self.tls_cert else True

    def start(self, timeout: float = 30) -> Agent:
        exe = str(self.bindir / "fleet-agent") if self.bindir else fleet_bin("fleet-agent")
        if not (self.home / "identity.json").exists():
            if self.bindir is None:
                # What `fleet-agent enroll` does, in this process: a process for it cost ~0.4 CPU-s of
                # start-up, ~150 times a suite (the command's own tests: tests/integration/test_agent.py).
                from agent import __version__
                from agent.machine import identity

                identity.enroll(self.home, self.name, __version__)
            else:
                enroll(self.home, self.name, exe)
        log = open(self.home.parent / f"{self.name}.log", "a")
        self.proc = subprocess.Popen(
            [exe, "serve", "--home", str(self.home), "--listen", f"{self.address}:{self.port}",
             *self.args, *(["--tls-cert", str(self.tls_cert), "--tls-key", str(self.tls_cert.with_name("key.pem"))]
                            if self.tls_cert else [])], env=agent_env(**self.env), stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent {self.name} exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1, verify=self.verify).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"agent {self.name} did not answer within {timeout}s: {self.log()}")

    def log(self) -> str:
        path = self.home.parent / f"{self.name}.log"
        return path.read_text() if path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout)

    def wait_for(self, path: str, states: tuple[str, ...], timeout: float = 120, every: float = 0.05) -> dict:
        """Poll a progress route until its `state` is one of `states`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = self.get(path).json()
            if body.get("state") in states:
                return body  # type: ignore[no-any-return]
            time.sleep(every)
        raise AssertionError(f"{self.name}{path} not {'/'.join(states)} within {timeout}s")

    def get(self, path: str, secret: str | None = SECRET) -> httpx.Response:
        headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
        return httpx.get(self.url + path, headers=headers, timeout=10, verify=self.verify)
