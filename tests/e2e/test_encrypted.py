"""Encrypted weights end to end, on a real agent, real engines and the real `fleet plan`, `apply`,
`serve` and `nodes`: a GGUF and a safetensors model imported with --encrypt are planned, applied and
answered through the router with the openai client, and no byte of their plaintext tensors is then
found on disk (agent home, engine caches, temp directory); an agent with another key is refused by
the plan and fails a start naming the model and both key ids (`fleet nodes --wide`); a flipped
ciphertext byte fails the load naming the model, and verification finds it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.agents import SECRET, Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import Fleet
from tests.models import tiny_gguf, tiny_safetensors
from wire import manifest as mf

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {SECRET}"}
RUN = 64


def key_file(path: Path) -> Path:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def runs(data: bytes, offsets: list[int]) -> list[bytes]:
    """64-byte runs of `data` at these offsets that could not occur by chance (no zeros or ones runs)."""
    out = []
    for at in offsets:
        for shift in range(0, 4096, RUN):
            run = data[at + shift:at + shift + RUN]
            if len(run) == RUN and len(set(run)) >= 32:
                out.append(run)
                break
    assert len(out) == len(offsets), "the model has too few random-looking bytes to look for"
    return out


def plaintext_runs(st_dir: Path, gguf: Path) -> list[bytes]:
    weights = (st_dir / "model.safetensors").read_bytes()
    with open(st_dir / "model.safetensors", "rb") as fh:
        _, tensors = mf.read_safetensors_index(fh, len(weights))
    big = sorted(tensors, key=lambda t: t["begin"] - t["end"])[:4]
    q = gguf.read_bytes()
    return runs(weights, [(t["begin"] + t["end"]) // 2 - RUN for t in big]) + \
        runs(q, [len(q) * k // 10 for k in (6, 7, 8, 9)])


def scan(dirs: list[Path], needles: list[bytes]) -> list[str]:
    """Every regular file under `dirs` (links not followed) holding one of `needles`."""
    found = []
    for d in dirs:
        for root, _, files in os.walk(d):
            for name in files:
                path = Path(root, name)
                try:
                    if not stat.S_ISREG(path.lstat().st_mode):
                        continue
                    data = path.read_bytes()
                except OSError:
                    continue
                found += [f"{path}: run {i}" for i, n in enumerate(needles) if n in data]
    return found


def fd_targets(pid: int) -> list[str]:
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            out.append(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
    return out


def import_encrypted(agent: Agent, src: Path, name: str) -> dict[str, Any]:
    proc = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(agent.home), str(src), "--name", name,
                           "--encrypt", "--json"], capture_output=True, text=True, timeout=300,
                          env=agent_env(**agent.env), check=True)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


class Sealed:
    def __init__(self, fleet: Fleet, agent: Agent, dirs: list[Path], needles: list[bytes], digests: dict[str, str],
                 base: str, models: Path, key: Path) -> None:
        self.key = key  # the key the models were sealed under
        self.fleet, self.agent, self.dirs, self.needles = fleet, agent, dirs, needles
        self.digests, self.base, self.models = digests, base, models

    def restart(self, key: Path) -> None:
        self.agent.stop()
        self.agent.env["FLEET_WEIGHTS_KEY_FILE"] = str(key)
        self.agent.start()

    def start(self, cluster: str, port: int) -> httpx.Response:
        return httpx.post(f"{self.agent.url}/v1/servers", headers=AUTH, timeout=30, json={
            "id": f"{cluster}@cp", "model": self.digests[cluster], "port": port,
            "settings": {"context_length": 256, "threads": 1, "startup_timeout_s": 120}})


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sealed]:
    base = tmp_path_factory.mktemp("sealed")
    models = base / "models"
    st, q = tiny_safetensors(models), tiny_gguf(models)
    caches = {v: base / "caches" / v.lower() for v in ("HF_HOME", "XDG_CACHE_HOME", "TMPDIR", "TORCH_HOME",
                                                       "LLAMA_CACHE", "TRITON_CACHE_DIR")}
    for d in caches.values():
        d.mkdir(parents=True)
    key = key_file(base / "weights.key")
    env = {**{k: str(v) for k, v in caches.items()}, "FLEET_WEIGHTS_KEY_FILE": str(key)}
    address = "127.0.0.2"
    agent = Agent("cp", address, free_port(address), base / "cp", args=["--verify-every", "off"], env=env)
    agent.start()
    serve = None
    try:
        imported = {"st": import_encrypted(agent, st, "sealed-st"), "q": import_encrypted(agent, q, "sealed-q")}
        digests = {c: i["digest"] for c, i in imported.items()}
        assert all(i["encryption"]["cipher"] == "aes-256-gcm" for i in imported.values()), imported
        fleet = Fleet(base, {"cp": agent}, digests)
        listen = f"{address}:{free_port(address)}"
        ports = {c: free_port(address) for c in digests}
        settings = "settings: {context_length: 256, threads: 1, startup_timeout_s: 120}"
        fleet.file.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{listen}"}}
nodes:
  cp: {{address: {address}, agent_port: {agent.port}}}
models:
  sealed-st: {{format: safetensors, digest: "{digests['st']}", source: cp, encrypted: true}}
  sealed-q: {{format: gguf, digest: "{digests['q']}", source: cp, encrypted: true}}
replicas: {{}}
clusters:
  st: {{model: sealed-st, members: [cp], port: {ports['st']}, {settings}}}
  q: {{model: sealed-q, members: [cp], port: {ports['q']}, {settings}}}
""")
        log = open(base / "serve.log", "w")
        serve = subprocess.Popen([fleet_bin(), "serve", "-f", str(fleet.file), "--interval", "1"],
                                 env=agent_env(FLEET_STATE_DIR=str(fleet.state_dir)), stdout=log,
                                 stderr=subprocess.STDOUT, text=True)
        # /dev/shm too: the one tmpfs every process may write shared memory into.
        dirs = [agent.home, *caches.values(), fleet.state_dir, *[Path("/dev/shm")][:Path("/dev/shm").is_dir()]]
        yield Sealed(fleet, agent, dirs, plaintext_runs(st, q), digests, f"http://{listen}/v1", models, key)
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(30)
        agent.stop()


def test_planned_applied_served_and_never_on_disk(sealed: Sealed) -> None:
    f = sealed.fleet
    weights = {w["digest"]: w for w in sealed.agent.get("/v1/state").json()["weights"]}
    for digest in sealed.digests.values():
        assert weights[digest]["encryption"]["key_held"] is True, weights[digest]
    plan = f.run("plan", "--detailed-exitcode")
    assert plan.returncode == 2, plan.stdout + plan.stderr  # changes to make, no error
    assert "start server.st@cp" in plan.stdout and "start server.q@cp" in plan.stdout, plan.stdout
    applied = f.run("apply", "--auto-approve")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    client = openai.OpenAI(base_url=sealed.base, api_key="unused", max_retries=0, timeout=120)
    deadline = time.monotonic() + 60
    for cluster in ("st", "q"):
        while True:  # until the heartbeat has seen the new servers
            try:
                done = client.completions.create(model=cluster, prompt="The fleet", max_tokens=6, temperature=0)
                break
            except (openai.NotFoundError, openai.APIStatusError, openai.APIConnectionError):
                assert time.monotonic() < deadline, (f.base / "serve.log").read_text()[-3000:]
                time.sleep(0.5)
        assert done.choices[0].finish_reason in ("stop", "length") and done.usage and done.usage.completion_tokens >= 1
        chat = list(client.chat.completions.create(model=cluster, messages=[{"role": "user", "content": "Hi!"}],
                                                   max_tokens=6, temperature=0, stream=True))
        assert chat[-1].choices[0].finish_reason in ("stop", "length")
    assert sealed.agent.proc is not None
    agent_pid = sealed.agent.proc.pid
    if os.geteuid() == 0:  # root reads any process (CAP_SYS_PTRACE): look at what the agent holds
        # The GGUF's memfd (llama.cpp opens it again), not PyTorch's (loaded, held there).
        held = fd_targets(agent_pid)
        assert any("memfd:fleet:tiny-llama.gguf" in h for h in held), held
        assert not any("memfd:fleet:model.safetensors" in h for h in held), held
        # Nor is the key in its environment, which /proc keeps whatever os.environ says.
        secret = sealed.key.read_bytes()
        environ = Path(f"/proc/{agent_pid}/environ").read_bytes()
        assert secret not in environ and secret.hex().encode() not in environ and b"FLEET_WEIGHTS_KEY=" not in environ
    else:  # the agent's user's other processes (this test, a worker) cannot: it is undumpable
        with pytest.raises(PermissionError):
            fd_targets(agent_pid)
        with pytest.raises(PermissionError):
            Path(f"/proc/{agent_pid}/environ").read_bytes()
    for server in sealed.agent.get("/v1/state").json()["servers"]:
        pid = server["pid"]
        # A worker has nothing of fleet's environment (the cluster secret, where the key is) but its
        # credential and the numbers of the memfds it was handed, nothing of the key on its command
        # line, and no core file to write plaintext to.
        fleet_vars = {v.split(b"=", 1)[0] for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                      if v.startswith(b"FLEET_")}
        assert fleet_vars == {b"FLEET_WORKER_CREDENTIAL", b"FLEET_SEALED_FDS"}, fleet_vars
        assert str(sealed.key).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        core = [line.split()[-3:-1] for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                if line.startswith("Max core file size")]
        assert core == [["0", "0"]], core
        # Its own model's memfd and no other: llama.cpp's kept, PyTorch's closed once loaded.
        memfds = [t for t in fd_targets(pid) if "memfd:fleet:" in t]
        want = ["tiny-llama.gguf"] if server["id"] == "q@cp" else []
        assert [t.split("memfd:fleet:")[1].split()[0] for t in memfds] == want, (server["id"], memfds)
    # The scanner finds the runs where they are (the originals), and nowhere the node keeps anything.
    found = scan([sealed.models], sealed.needles)
    assert {int(hit.rsplit(" ", 1)[1]) for hit in found} == set(range(len(sealed.needles))), found
    assert scan(sealed.dirs, sealed.needles) == []
    # Peers are never served an encrypted model's bytes, under any name the store knows them by, nor
    # its manifest.
    refused = sealed.agent.get(f"/v1/manifests/{sealed.digests['st']}")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "encrypted_not_served", refused.text
    held = json.loads((sealed.agent.home / "store" / "manifests" / f"{sealed.digests['st'][7:]}.json").read_text())
    for f_ in held["files"]:
        assert sealed.agent.get(f"/v1/blobs/{f_['sha256']}").status_code == 404
    for blob in (sealed.agent.home / "store" / "sealed").iterdir():
        assert sealed.agent.get(f"/v1/blobs/{blob.name}").status_code == 404


def test_another_agent_asked_to_fetch_it_refuses(sealed: Sealed, tmp_path: Path) -> None:
    address = "127.0.0.3"
    b = Agent("b", address, free_port(address), tmp_path / "b").start()
    try:
        digest = sealed.digests["st"]
        r = httpx.put(f"{b.url}/v1/weights/{digest}", headers=AUTH, timeout=30, json={"peer": sealed.agent.url})
        assert r.status_code == 202, r.text
        job = b.wait_for(f"/v1/weights/{digest}", ("present", "failed"), timeout=60, every=0.1)
        assert job["state"] == "failed" and job["code"] == "encrypted_remote_unsupported", job
        assert b.get("/v1/state").json()["weights"] == []
        assert not [p for p in (tmp_path / "b").rglob("*") if p.is_file() and "partial" in p.parts]
    finally:
        b.stop()


def test_another_key_is_refused_by_the_plan_and_fails_a_start_naming_the_model(sealed: Sealed,
                                                                             tmp_path: Path) -> None:
    sealed.restart(key_file(tmp_path / "other.key"))  # its servers die with it
    f = sealed.fleet
    plan = f.run("plan", "--json")
    codes = {d["code"] for d in json.loads(plan.stdout)["diagnostics"]}
    assert plan.returncode == 4 and "encrypted_key_missing" in codes, plan.stdout + plan.stderr
    # As an apply would, had the key changed between its plan and its start:
    r = sealed.start("st", free_port(sealed.agent.address))
    assert r.status_code == 202, r.text
    s = sealed.agent.wait_for("/v1/servers/st@cp", ("running", "failed"), timeout=60, every=0.1)
    assert s["state"] == "failed" and s["pid"] is None, s
    assert s["reason"].startswith("encrypted_key_missing: model sealed-st") and sealed.digests["st"] in s["reason"]
    deadline = time.monotonic() + 30
    while "encrypted_key_missing" not in (wide := f.run("nodes", "--wide").stdout):
        assert time.monotonic() < deadline, wide
        time.sleep(0.5)
    assert "st@cp (failed): encrypted_key_missing: model sealed-st" in " ".join(wide.split())


def test_a_flipped_ciphertext_byte_fails_the_load_naming_the_model(sealed: Sealed) -> None:
    sealed.restart(sealed.key)
    digest = sealed.digests["st"]
    stored = sealed.agent.home / "store" / "models" / digest[7:] / "model.safetensors"
    with open(stored, "r+b") as fh:
        fh.seek(os.fstat(fh.fileno()).st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x40]))
    r = sealed.start("st", free_port(sealed.agent.address))
    assert r.status_code == 202, r.text
    s = sealed.agent.wait_for("/v1/servers/st@cp", ("running", "failed"), timeout=60, every=0.1)
    assert s["state"] == "failed" and s["pid"] is None, s
    assert s["reason"].startswith(f"encrypted_weights_tampered: model sealed-st ({digest}) is not served: "
                                  "model.safetensors: chunk "), s["reason"]
    found = httpx.post(f"{sealed.agent.url}/v1/weights/{digest}/verify", headers=AUTH, timeout=60).json()["integrity"]
    assert found["state"] == "corrupt" and found["file"] == "model.safetensors", found
    assert "fails authentication" in found["reason"]
    assert scan(sealed.dirs, sealed.needles) == []
