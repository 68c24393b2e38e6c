"""GPUs end to end (#35), on real fleet-agent processes whose GPUs are simulated (--simulate-gpus: a
file re-read on every request, whose free memory falls as the agent's own servers reserve it, as
NVML's would) and real workers on the tiny random Llama.

The CPU builds of the engines ignore CUDA_VISIBLE_DEVICES, so a llama.cpp worker given GPUs runs
here; the PyTorch worker given GPUs refuses to load without CUDA (`--device cuda`: a wrong build
fails rather than running slow), so its launch is read from /proc while it imports torch, and a
placed cluster that must be served runs on CPU-only nodes. llama.cpp servers run only on the
control plane's node, so that node ("cp") is the one with GPUs.

The shared fleet (one apply, read by several tests, changed by none):
  cp: GPU 0 of 1000 MiB; GPU 1 of 3072 MiB of which 512 MiB is held by a process that is not
      fleet's. Clusters in the file's order (the order the plan assigns GPUs in): `split`
      (tensor_parallel: 2), then `one`, `two`, `three` (each about 0.5 GiB).
  a, b: CPU only; `placed` (members: {count: 2}) lands on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.agents import SECRET, Agent, free_port
from tests.conftest import fleet_bin
from tests.fleets import Fleet, import_model, start_serve
from tests.models import tiny_gguf, tiny_safetensors

pytestmark = pytest.mark.e2e

MIB = 1 << 20
ADDRESSES = {"cp": "127.0.0.2", "a": "127.0.0.3", "b": "127.0.0.4"}
GPUS: list[dict[str, Any]] = [{"name": "NVIDIA Simulated 1000MiB", "uuid": "GPU-00000000-0000-4000-8000-00000000a000",
         "memory_total_bytes": 1000 * MIB},
        {"name": "NVIDIA Simulated 3GiB", "uuid": "GPU-00000000-0000-4000-8000-00000000a001",
         "memory_total_bytes": 3072 * MIB, "memory_free_bytes": 2560 * MIB}]
GGUF_ON_CP = ("split", "one", "two", "three")
SETTINGS = "context_length: 256, threads: 1, startup_timeout_s: 300"


@dataclass
class World:
    fleet: Fleet
    listen: str
    ports: dict[str, int]
    apply: subprocess.CompletedProcess[str]

    def state(self, node: str) -> dict[str, Any]:
        return self.fleet.agents[node].get("/v1/state").json()  # type: ignore[no-any-return]

    def server(self, sid: str) -> dict[str, Any]:
        node = sid.rpartition("@")[2]
        return self.fleet.agents[node].get(f"/v1/servers/{sid}").json()  # type: ignore[no-any-return]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def after(argv: list[str], flag: str, n: int = 1) -> list[str]:
    assert flag in argv, (flag, argv)
    i = argv.index(flag)
    return argv[i + 1:i + 1 + n]


def clusters(ports: dict[str, int], extra: str = "") -> str:
    lines = [f"  split: {{model: tiny-q, members: [cp], port: {ports['split']}, "
             f"settings: {{tensor_parallel: 2, {SETTINGS}}}}}"]
    lines += [f"  {c}: {{model: tiny-q, members: [cp], port: {ports[c]}, settings: {{{SETTINGS}}}}}"
              for c in GGUF_ON_CP[1:]]
    lines.append(f"  placed: {{model: tiny, members: {{count: 2, nodes: [a, b]}}, port: {ports['placed']}, "
                 f"settings: {{{SETTINGS}}}}}")
    return "\n".join(lines) + extra


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("gpus")
    gpus = base / "gpus.json"
    gpus.write_text(json.dumps(GPUS))
    port = free_port(*ADDRESSES.values())
    agents = {n: Agent(n, addr, port, base / n, args=["--simulate-gpus", str(gpus)] if n == "cp" else [])
              for n, addr in ADDRESSES.items()}
    serve = None
    try:
        for a in agents.values():
            a.start()
        digests = {"tiny": import_model(agents["cp"], tiny_safetensors(base / "models")),
                   "tiny-q": import_model(agents["cp"], tiny_gguf(base / "models"))}
        f = Fleet(base, agents, digests)
        taken = {port}
        ports: dict[str, int] = {}
        for name in (*GGUF_ON_CP, "placed", "big", "listen"):
            while (p := free_port(*ADDRESSES.values())) in taken:
                pass
            taken.add(p)
            ports[name] = p
        listen = f"{ADDRESSES['cp']}:{ports['listen']}"
        f.write(clusters=clusters(ports), listen=listen)
        applied = f.run("apply", "--auto-approve", timeout=900)
        assert applied.returncode == 0, applied.stdout + applied.stderr + "".join(a.log() for a in agents.values())
        serve = start_serve(f, listen)
        yield World(f, listen, ports, applied)
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(30)
        for a in agents.values():
            a.stop()


def test_an_applied_fleet_plans_no_changes_while_its_gpus_report_its_servers_memory(world: World) -> None:
    inventory = {g["uuid"]: g for g in world.state("cp")["inventory"]["gpus"]}
    servers = {s["id"]: s for s in world.state("cp")["servers"]}
    assert set(servers) == {f"{c}@cp" for c in GGUF_ON_CP}
    assert all(s["state"] == "running" for s in servers.values()), servers
    for gpu in GPUS:  # the GPUs report the servers' own memory: less free than the file's figure by it
        held = sum(g["bytes"] for s in servers.values() for g in s.get("gpus", ()) if g["uuid"] == gpu["uuid"])
        assert held > 0
        file_free = int(gpu.get("memory_free_bytes", gpu["memory_total_bytes"]))
        assert inventory[gpu["uuid"]]["memory_free_bytes"] == max(0, file_free - held)
    plan = world.fleet.run("plan", "--detailed-exitcode")
    assert plan.returncode == 0, plan.stdout + plan.stderr  # 2: changes; 4: errors (insufficient_vram before)
    body = json.loads(world.fleet.run("plan", "--json").stdout)
    assert body["changes"] == [] and not [d for d in body["diagnostics"] if d["severity"] == "error"], body


def test_servers_on_one_node_add_up_and_a_third_that_does_not_fit_is_refused_naming_the_gpu(world: World) -> None:
    servers = world.state("cp")["servers"]
    on: dict[str, list[tuple[str, int]]] = {str(g["uuid"]): [] for g in GPUS}
    for s in servers:
        for g in s.get("gpus", ()):
            on[g["uuid"]].append((s["id"], g["bytes"]))
    gpu1 = GPUS[1]["uuid"]
    assert len(on[gpu1]) == 4, on  # split's second GPU, and one, two, three: all fit there together
    fleet1 = sum(b for _, b in on[gpu1])
    room1 = 2560 * MIB - fleet1
    # A server that would fit GPU 1 alone, but not beside the four already there (nor on GPU 0):
    # the planner adds them up. Its context makes its KV cache 64 MiB (16 sequences of 8,192 tokens).
    big = f"\n  big: {{model: tiny-q, members: [cp], port: {world.ports['big']}, settings: {{context_length: 8192, threads: 1}}}}"
    path = world.fleet.base / "fleet-big.yaml"
    path.write_text(world.fleet.file.read_text().replace(clusters(world.ports), clusters(world.ports, big)))
    assert "big:" in path.read_text()
    plan = subprocess.run([fleet_bin(), "plan", "--json", "-f", str(path)],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "FLEET_CLUSTER_SECRET": SECRET,
                               "FLEET_STATE_DIR": str(world.fleet.state_dir)})
    body = json.loads(plan.stdout)
    refused = [d for d in body["diagnostics"] if d["code"] == "insufficient_vram"]
    assert [d["address"] for d in refused] == ["server.big@cp"], body["diagnostics"]
    message = refused[0]["summary"]
    need = 2 * 32 * 2 * 4 * 8192 * 16 + 512 * MIB  # at least its KV cache and overhead, less than GPU 1's room alone
    assert room1 < need < 2560 * MIB, (room1, need)
    assert "cp GPU 1: 3.0 GiB" in message and "cp GPU 0:" in message, message  # names each GPU and what holds it
    for c in GGUF_ON_CP:
        assert c in message.split("cp GPU 1:")[1].split(";")[0], message  # fleet's servers holding GPU 1
    assert "others 0.5 GiB" in message, message  # the process that is not fleet's

    # The agent's own sum, for a start sent straight to it (no planner: its GPUs' free memory may
    # have changed since the plan): refused, naming the GPU and what holds it.
    r = httpx.post(world.fleet.agents["cp"].url + "/v1/servers", timeout=30,
                   headers={"Authorization": f"Bearer {SECRET}"},
                   json={"id": "big@cp", "model": world.fleet.digests["tiny-q"], "port": world.ports["big"],
                         "settings": {"context_length": 8192, "threads": 1},
                         "gpus": [{"index": 1, "uuid": gpu1, "bytes": room1 + MIB}]})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "gpu_overcommitted", error
    assert f"GPU 1 ({gpu1}" in error["message"] and all(f"{c}@cp" in error["message"] for c in GGUF_ON_CP), error
    assert "big@cp" not in {s["id"] for s in world.state("cp")["servers"]}
    # The node's GPU 1 reports the four servers' reservations added up, and nothing for the refused one.
    assert world.state("cp")["inventory"]["gpus"][1]["memory_free_bytes"] == room1


def test_two_servers_share_a_gpu_only_where_both_fit(world: World) -> None:
    servers = {s["id"]: s for s in world.state("cp")["servers"]}
    shares = {sid: {g["index"]: g["bytes"] for g in s["gpus"]} for sid, s in servers.items()}
    assert set(shares["split@cp"]) == {0, 1}
    # GPU 0 (1000 MiB) holds split's half; no other server fits beside it, so none was put there.
    assert [sid for sid, s in shares.items() if 0 in s] == ["split@cp"]
    smallest = min(s[1] for sid, s in shares.items() if sid != "split@cp")
    assert shares["split@cp"][0] + smallest > 1000 * MIB
    # GPU 1 holds all four, as they fit there together (with the 512 MiB that is not fleet's).
    assert sorted(sid for sid, s in shares.items() if 1 in s) == sorted(f"{c}@cp" for c in GGUF_ON_CP)
    assert sum(s[1] for s in shares.values()) <= 2560 * MIB
    for c in GGUF_ON_CP[1:]:
        assert set(shares[f"{c}@cp"]) == {1}


def test_each_worker_sees_exactly_its_gpus(world: World) -> None:
    uuids = {i: g["uuid"] for i, g in enumerate(GPUS)}
    for s in world.state("cp")["servers"]:
        env = environ(s["pid"])
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(uuids[g["index"]] for g in s["gpus"]), (s["id"], s["gpus"])
        assert {k for k in env if k.startswith("FLEET_")} == {"FLEET_WORKER_CREDENTIAL"}  # not the agent's own
    for node in ("a", "b"):  # CPU-only nodes: a server given no GPUs sees none, not GPU 0
        s = world.server(f"placed@{node}")
        assert s["state"] == "running" and "gpus" not in s, s
        assert environ(s["pid"])["CUDA_VISIBLE_DEVICES"] == ""


def test_a_tensor_parallel_llama_cpp_server_is_spread_over_exactly_its_two_gpus(world: World) -> None:
    s = world.server("split@cp")
    assert [g["index"] for g in s["gpus"]] == [0, 1]
    argv = cmdline(s["pid"])
    assert after(argv, "--main_gpu") == ["0"] and after(argv, "--n_gpu_layers") == ["-1"]
    split = [float(v) for v in after(argv, "--tensor_split", 3) if not v.startswith("--")]
    assert len(split) == 2 and all(v > 0 for v in split) and abs(sum(split) - 1) < 1e-3, argv
    assert environ(s["pid"])["CUDA_VISIBLE_DEVICES"] == f"{GPUS[0]['uuid']},{GPUS[1]['uuid']}"
    assert s["gpus"][0]["bytes"] == s["gpus"][1]["bytes"]  # the estimate split evenly over its GPUs


def test_a_placed_cluster_is_served_and_stays_where_it_was_placed(world: World) -> None:
    for node in ("a", "b"):
        assert world.server(f"placed@{node}")["state"] == "running"
    r = httpx.post(f"http://{world.listen}/v1/completions", timeout=300,
                   json={"model": "placed", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "placed" and r.json()["choices"][0]["text"] is not None
    overview = httpx.get(f"http://{world.listen}/healthz", timeout=10).json()
    assert overview.get("beats", 0) >= 1
    nodes = json.loads(world.fleet.run("nodes", "--json").stdout)
    assert {r["id"]: r["state"] for r in nodes["servers"] if r["cluster"] == "placed"} == {
        "placed@a": "running", "placed@b": "running"}, nodes["servers"]
    again = world.fleet.run("plan", "--detailed-exitcode")
    assert again.returncode == 0, again.stdout + again.stderr  # stable: nothing moves on a second plan


def test_a_tensor_parallel_torch_server_is_launched_over_exactly_its_two_gpus(tmp_path: Path) -> None:
    """Its own one-node fleet: the PyTorch worker given GPUs fails to load on a CPU build, so its
    command line and environment are read while it imports torch (seconds), then its failure."""
    gpus = tmp_path / "gpus.json"
    four = [{"name": "NVIDIA Simulated 4GiB", "uuid": f"GPU-00000000-0000-4000-8000-00000000b00{i}",
             "memory_total_bytes": 4096 * MIB} for i in range(3)]
    gpus.write_text(json.dumps(four))
    agent = Agent("cp", ADDRESSES["cp"], free_port(ADDRESSES["cp"]), tmp_path / "cp",
                  args=["--simulate-gpus", str(gpus)])
    apply = None
    try:
        agent.start()
        f = Fleet(tmp_path, {"cp": agent}, {"tiny": import_model(agent, tiny_safetensors(tmp_path / "models")),
                                            "tiny-q": "sha256:" + "0" * 64})
        f.file.write_text(f"""version: 1
control_plane: {{node: cp}}
nodes:
  cp: {{address: {agent.address}, agent_port: {agent.port}}}
models:
  tiny: {{format: safetensors, digest: "{f.digests['tiny']}", source: cp}}
clusters:
  wide: {{model: tiny, members: [cp], port: {free_port(agent.address)}, settings: {{tensor_parallel: 2, threads: 1}}}}
""")
        apply = subprocess.Popen([fleet_bin(), "apply", "--auto-approve", "-f", str(f.file)], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, "FLEET_CLUSTER_SECRET": SECRET, "FLEET_STATE_DIR": str(f.state_dir)})
        deadline = time.monotonic() + 300
        seen: tuple[list[str], dict[str, str], dict[str, Any]] | None = None
        while seen is None:
            assert time.monotonic() < deadline, agent.log()
            r = agent.get("/v1/servers/wide@cp")
            s = r.json() if r.status_code == 200 else {}
            if s.get("pid"):
                try:
                    seen = cmdline(s["pid"]), environ(s["pid"]), s
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    raise AssertionError(f"the worker exited before it was read: {agent.get('/v1/servers/wide@cp').text}")
            time.sleep(0.02)
        argv, env, s = seen
        chosen = [g["index"] for g in s["gpus"]]
        assert len(chosen) == 2, s["gpus"]  # of the three: exactly two
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(four[i]["uuid"] for i in chosen)
        assert after(argv, "--device") == ["cuda"]
        assert after(argv, "--gpu-memory") == [",".join(str(g["bytes"]) for g in s["gpus"])]
        out, _ = apply.communicate(timeout=300)
        assert apply.returncode != 0  # and the CPU build says why it cannot load
        failed = agent.wait_for("/v1/servers/wide@cp", ("failed",), timeout=300)
        assert "CUDA" in failed["reason"], failed
    finally:
        if apply is not None and apply.poll() is None:
            apply.kill()
            apply.wait()
        agent.stop()


def test_a_saved_plan_whose_gpu_filled_up_since_is_stale_and_a_new_plan_names_the_gpu(tmp_path: Path) -> None:
    """Free memory is not in a saved plan's fingerprint (it always moves), but apply plans again and
    compares: a start whose GPUs no longer fit is stale_plan, nothing applied, and the next plan
    says what holds the GPU. (The agent's own refusal, for a start that reaches it anyway, is
    test_servers_on_one_node_add_up_and_...)"""
    gpus = tmp_path / "gpus.json"
    gpu: dict[str, Any] = {"name": "NVIDIA Simulated 1GiB", "uuid": "GPU-00000000-0000-4000-8000-00000000c000",
           "memory_total_bytes": 1024 * MIB}
    gpus.write_text(json.dumps([gpu]))
    agent = Agent("cp", ADDRESSES["cp"], free_port(ADDRESSES["cp"]), tmp_path / "cp",
                  args=["--simulate-gpus", str(gpus)])
    try:
        agent.start()
        f = Fleet(tmp_path, {"cp": agent}, {"tiny": "sha256:" + "0" * 64,
                                            "tiny-q": import_model(agent, tiny_gguf(tmp_path / "models"))})
        f.file.write_text(f"""version: 1
control_plane: {{node: cp}}
nodes:
  cp: {{address: {agent.address}, agent_port: {agent.port}}}
models:
  tiny-q: {{format: gguf, digest: "{f.digests['tiny-q']}", source: cp}}
clusters:
  late: {{model: tiny-q, members: [cp], port: {free_port(agent.address)}, settings: {{{SETTINGS}}}}}
""")
        saved = tmp_path / "plan.json"
        plan = f.run("plan", "-o", str(saved))
        assert plan.returncode == 0 and saved.exists(), plan.stdout + plan.stderr
        assert "GPU 0" in plan.stdout, plan.stdout
        gpus.write_text(json.dumps([{**gpu, "memory_free_bytes": 300 * MIB}]))  # another process took 724 MiB
        applied = f.run("apply", str(saved))
        out = applied.stdout + applied.stderr
        assert applied.returncode != 0, out
        assert "stale_plan" in out and "server.late@cp: details.gpus differs" in out and gpu["uuid"] in out, out
        assert "nothing was applied" in out, out
        assert agent.get("/v1/servers/late@cp").status_code == 404  # nothing started, nothing reserved
        assert agent.get("/v1/state").json()["inventory"]["gpus"][0]["memory_free_bytes"] == 300 * MIB
        again = f.run("plan", "--json")
        refused = [d for d in json.loads(again.stdout)["diagnostics"] if d["code"] == "insufficient_vram"]
        assert len(refused) == 1 and "cp GPU 0: 1.0 GiB, fleet 0.0 GiB, others 0.7 GiB" in refused[0]["summary"], refused
    finally:
        agent.stop()
