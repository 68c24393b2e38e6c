"""The README's by-hand walkthrough on machines of their own: each machine (cp, gpu-a, gpu-b, a client)
a network namespace with its own address, all behind one switch (a bridge in a namespace of its own),
and the README's ```sh blocks run as written in them (tests/readme.py reads them), so that a README
edit that breaks a command fails here. What the test gives each machine is what a machine has of its
own: a home directory (the blocks write under ~), its name and address (NODE, ADDRESS), fleet on PATH
(this checkout's, as `pip install` would put it there) and `scp` between them (the namespaces share a
filesystem, so it is a copy into the other machine's home). What it fills in is what a person copies
from one command's output into the fleet file: the identities enroll printed and the digest import
printed (the fleet file's `<...>`). Nothing listens outside the namespaces.

Needs root and `ip` (iproute2); skipped otherwise, saying why, except where FLEET_REQUIRE_NETNS=1
(`.ci/run`), where that is a failure."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.conftest import ROOT
from tests.readme import Block, walkthrough

pytestmark = pytest.mark.e2e

README = ROOT / "README.md"
# The machines as the walkthrough names them: name → address; each answers scp as NAME.lab.
MACHINES = {"cp": "10.0.0.1", "gpu-a": "10.0.0.2", "gpu-b": "10.0.0.3", "client": "10.0.0.4"}
PREFIX = "fwt"  # every namespace this test makes: fwt<pid of the test>x<random>-<machine>
STEP_TIMEOUT = 900  # a block's commands (an apply starts two PyTorch workers on a busy 2-core machine)


def sh(*args: str, check: bool = True, timeout: float = 60) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=timeout).stdout


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "it needs root (ip netns, veth, a bridge)"
    if shutil.which("ip") is None:
        return "it needs iproute2's `ip`"
    for tool in ("openssl", "ss"):
        if shutil.which(tool) is None:
            return f"it needs `{tool}`"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Namespaces of an earlier run of this test that was killed before its teardown (its pid gone)."""
    for entry in sh("ip", "netns", "list", check=False).splitlines():
        name = entry.split(" ")[0]
        m = re.match(rf"{PREFIX}(\d+)x", name)
        if m and not psutil.pid_exists(int(m[1])):
            kill_inside(name)
            sh("ip", "netns", "del", name, check=False)


def kill_inside(ns: str) -> None:
    """SIGKILL what is left in one of this test's namespaces (only what the test started runs there)."""
    for pid in sh("ip", "netns", "pids", ns, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Network:
    """One namespace per machine, each behind a veth pair into the switch: a bridge in a namespace
    of its own, with no firewall (as bench/fanout.py builds it, without its uplink to the root
    namespace: nothing here is reachable from outside)."""

    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.switch = f"{self.tag}-sw"
        self.ns: dict[str, str] = {}

    def up(self) -> None:
        sw = ("ip", "netns", "exec", self.switch)
        sh("ip", "netns", "add", self.switch)
        for table in ("iptables", "ip6tables", "arptables"):  # absent without br_netfilter: nothing to turn off
            sh(*sw, "sysctl", "-q", "-w", f"net.bridge.bridge-nf-call-{table}=0", check=False)
        sh(*sw, "ip", "link", "add", "br0", "type", "bridge")
        sh(*sw, "ip", "link", "set", "br0", "up")
        for i, (name, address) in enumerate(MACHINES.items()):
            ns = self.ns[name] = f"{self.tag}-{name}"
            sh("ip", "netns", "add", ns)
            # Made in place: the pair never has a name in the root namespace.
            sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}",
               "netns", self.switch)
            sh(*sw, "ip", "link", "set", f"port{i}", "master", "br0")
            sh(*sw, "ip", "link", "set", f"port{i}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        for ns in [*self.ns.values(), self.switch]:
            kill_inside(ns)
            sh("ip", "netns", "del", ns, check=False)

    def listeners(self, machine: str) -> list[tuple[str, set[int]]]:
        return listeners(self.ns[machine])


def listeners(ns: str | None) -> list[tuple[str, set[int]]]:
    """(local address:port, owning pids) of every TCP listener in a namespace (None: the root
    namespace, where the test runs)."""
    cmd = ("ss", "-ltnpH") if ns is None else ("ip", "netns", "exec", ns, "ss", "-ltnpH")
    out = []
    for line in sh(*cmd).splitlines():
        fields = line.split()
        if len(fields) >= 4:
            out.append((fields[3], {int(p) for p in re.findall(r"pid=(\d+)", line)}))
    return out


def descendants(pid: int) -> set[int]:
    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


SCP = '''#!{python}
"""scp between the walkthrough's machines: `scp FILE... HOST:[DIR]` copies into HOST's home (the
machines share a filesystem). Only that form: anything else fails, saying so."""
import shutil, sys
from pathlib import Path
homes = {homes!r}
*sources, target = [a for a in sys.argv[1:] if a not in ("-q", "-p")]
host, sep, rel = target.partition(":")
host = host.rpartition("@")[2]
if not sep or host not in homes or rel.startswith("/") or not sources:
    sys.exit(f"scp (walkthrough): only `scp FILE... HOST:[DIR]` to one of {{sorted(homes)}}, not {{sys.argv[1:]}}")
into = Path(homes[host]) / rel
for s in sources:
    shutil.copy(s, into / Path(s).name if into.is_dir() else into)
'''


class Machines:
    """The walkthrough's machines: their namespaces, homes, environments, and the services started
    on them (a block ending in a long-running command), stopped at the end."""

    def __init__(self, net: Network, base: Path) -> None:
        self.net, self.base = net, base
        self.homes = {m: base / m for m in MACHINES}
        shims = base / "bin"
        shims.mkdir()
        (shims / "scp").write_text(SCP.format(python=sys.executable,
                                              homes={f"{m}.lab": str(h) for m, h in self.homes.items()}))
        (shims / "scp").chmod(0o755)
        path = f"{shims}:{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        # The test's own settings (FLEET_CACHE_DIR, ...) are not the machines': each has its home.
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "OPENAI_", "XDG_"))}
        self.env = {m: {**clean, "HOME": str(h), "PATH": path, "NODE": m, "ADDRESS": MACHINES[m]}
                    for m, h in self.homes.items()}
        for h in self.homes.values():
            h.mkdir()
        self.services: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def argv(self, machine: str, script: str) -> list[str]:
        return ["ip", "netns", "exec", self.net.ns[machine], "bash", "--noprofile", "--norc", "-e", "-o",
                "pipefail", "-c", script]

    def run(self, machine: str, script: str, where: str) -> str:
        proc = subprocess.run(self.argv(machine, script), cwd=self.homes[machine], env=self.env[machine],
                              capture_output=True, text=True, timeout=STEP_TIMEOUT, stdin=subprocess.DEVNULL)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{where} on {machine} exited {proc.returncode}:\n{out}\n{self.logs()}"
        return out

    def start(self, machine: str, script: str, where: str) -> tuple[str, str]:
        """A block that ends in a long-running command, started and left running; returns once that
        command listens (the address it listens on) and what the block printed until then."""
        log = self.base / f"{machine}-{len(self.services)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.argv(machine, script), cwd=self.homes[machine], env=self.env[machine],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.services.append((machine, proc, log))
        deadline = time.monotonic() + 120
        while True:
            mine = descendants(proc.pid)
            listening = [addr for addr, pids in self.net.listeners(machine) if pids & mine]
            if listening:
                return listening[0], log.read_text()
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"{where} on {machine} {'exited ' + str(proc.returncode) if proc.poll() is not None else 'never listened'}:" \
                f"\n{log.read_text()}"
            time.sleep(0.2)

    def get(self, machine: str, url: str) -> tuple[int, str]:
        """GET url from one machine (the test itself is in no namespace of theirs): status and body."""
        code = ("import sys, urllib.request, urllib.error\n"
                "try:\n    a = urllib.request.urlopen(sys.argv[1], timeout=10); print(a.status); print(a.read().decode())\n"
                "except urllib.error.HTTPError as e:\n    print(e.code); print(e.read().decode())\n")
        out = subprocess.run(["ip", "netns", "exec", self.net.ns[machine], sys.executable, "-c", code, url],
                             capture_output=True, text=True, timeout=60, env=self.env[machine])
        status, _, body = out.stdout.partition("\n")
        return (int(status) if status.isdigit() else 0), body + out.stderr

    def logs(self) -> str:
        return "\n".join(f"--- {log.name} (last 3,000 characters)\n{log.read_text()[-3000:]}"
                         for _, _, log in self.services if log.exists())

    def stop(self) -> None:
        for _, proc, _ in reversed(self.services):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the block's shell and its command: SIGTERM, as systemd stops them
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


@contextmanager
def machines(base: Path) -> Iterator[Machines]:
    why = netns_unavailable()
    if why is not None:
        (pytest.fail if os.environ.get("FLEET_REQUIRE_NETNS") == "1" else pytest.skip)(
            f"the walkthrough's machines are network namespaces, and {why}")
    remove_stale()
    net = Network()
    m: Machines | None = None
    try:
        net.up()
        m = Machines(net, base)
        yield m
    finally:
        if m is not None:
            m.stop()
        net.down()


def fill_in(script: str, printed: dict[str, str]) -> str:
    """The fleet file's `<identity NODE printed>` and `<digest import printed>`: what a person copies
    from those commands' output. One the walkthrough did not print is a failure, naming it."""
    def value(m: re.Match[str]) -> str:
        assert m[1] in printed, f"the walkthrough asks for <{m[1]} printed>, which no command of it printed"
        return printed[m[1]]
    return re.sub(r"<([\w -]+?) printed>", value, script)


def read_printed(output: str, printed: dict[str, str]) -> None:
    """What enroll and import print for a person to copy into the fleet file."""
    for name, ident in re.findall(r"enrolled node '([^']+)' with identity (\w+)", output):
        printed[f"identity {name}"] = ident
    for digest in re.findall(r"^digest: (sha256:[0-9a-f]{64})$", output, re.M):
        printed["digest import"] = digest


def run_walkthrough(readme: Path, base: Path) -> dict[str, str]:
    """Every block of the README's walkthrough, in order, on its machines; what each machine's last
    block printed (a service's: until it listened), and checks of what the walkthrough promises."""
    blocks: list[Block] = walkthrough(readme)
    printed: dict[str, str] = {}
    outputs: dict[str, str] = {}
    with machines(base) as m:
        before = {addr for addr, _ in listeners(None)}  # the root namespace's, where the test runs
        for block in blocks:
            for machine in block.machines:
                assert machine in MACHINES, f"README.md:{block.line}: {machine!r} is none of the walkthrough's machines"
                where = f"README.md:{block.line}"
                script = fill_in(block.script, printed)
                if block.service is None:
                    outputs[machine] = m.run(machine, script, where)
                else:
                    address, outputs[machine] = m.start(machine, script, where)
                    if block.service.startswith("fleet serve"):
                        wait_for_beat(m, machine, address)
                read_printed(outputs[machine], printed)

        # The promises: the client's question answered through the router (with its key; without
        # one, refused), the servers running on gpu-a and gpu-b as fleet nodes --wide shows them.
        assert re.search(r"CompletionUsage\(completion_tokens=[1-9]", outputs["client"]), outputs["client"]
        status, body = m.get("client", "http://10.0.0.1:8080/v1/models")
        assert status == 401 and "invalid_api_key" in body, (status, body)
        nodes = outputs["cp"]
        for node in ("gpu-a", "gpu-b"):
            row = next((line for line in nodes.splitlines() if line.startswith(node + " ")), "")
            assert "online" in row and "chat:running" in row, nodes
        assert re.search(r"^cp\s+online", nodes, re.M), nodes
        # Nothing listens outside the namespaces: no listener of the root namespace belongs to what
        # the walkthrough started (other work on this machine may open its own meanwhile).
        ours = descendants(os.getpid())
        assert all(m.net.listeners(machine) for machine in ("cp", "gpu-a", "gpu-b")), "ss sees no agent listening in its namespace"
        root = listeners(None)
        leaked = [(addr, pids) for addr, pids in root if pids & ours]
        assert not leaked, f"listening in the root namespace: {leaked} (new there: {[a for a, _ in root if a not in before]})"
    return outputs


def wait_for_beat(m: Machines, machine: str, address: str) -> None:
    """fleet serve routes from what its heartbeat saw: the client's question waits for its first beat
    (a person waits a second or two; /healthz says when)."""
    deadline = time.monotonic() + 120
    while True:
        status, body = m.get(machine, f"http://{address}/healthz")
        if status == 200 and json.loads(body.splitlines()[0]).get("beats", 0) >= 1:
            return
        assert time.monotonic() < deadline, f"fleet serve on {machine} saw no heartbeat: {status} {body}\n{m.logs()}"
        time.sleep(0.5)


def test_the_readme_walkthrough_on_machines_of_their_own(tmp_path: Path) -> None:
    run_walkthrough(README, tmp_path)
