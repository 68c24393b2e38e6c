"""A LoRA adapter (issue 29) on a real fleet: made here with peft on SmolLM2-135M-Instruct's float32
safetensors (a fixed random init of its B matrices, so that it changes the answer), saved in PEFT's
format, imported on cp (`fleet-agent import`, pinned by its own digest), replicated by `fleet apply`
to `a`, the member that merges it (listed under no `replicas`), beside the base, merged at load by the PyTorch worker and asked through `fleet serve`.
Two clusters on `a` share the one base copy, one with the adapter and one without. The adapted
greedy answer equals peft's own merge in this process, and differs from the base's. A wrong base is
a plan error naming both digests; a corrupt adapter byte is found at verification, its server
failed, and `fleet apply` fetches it again."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from wire.command_line import Exit

from tests.addresses import loopback
from tests.agents import SECRET, Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import Fleet, import_model, start_serve
from tests.models import make_adapter, peft_reference, tiny_safetensors

pytestmark = pytest.mark.e2e
QUESTION = "What is the capital of France? Answer in one sentence."
TOKENS = 12
ADDRESSES = dict(zip(("cp", "a"), loopback(2)))


class World:
    def __init__(self, fleet: Fleet, listen: str, digests: dict[str, str], refs: dict[str, str], plan: str) -> None:
        self.fleet, self.listen, self.digests, self.refs, self.first_plan = fleet, listen, digests, refs, plan

    def ask(self, cluster: str) -> str:
        client = openai.OpenAI(base_url=f"http://{self.listen}/v1", api_key="unused", max_retries=0, timeout=300)
        done = client.chat.completions.create(model=cluster, messages=[{"role": "user", "content": QUESTION}],
                                              temperature=0, max_tokens=TOKENS)
        return done.choices[0].message.content or ""

    def server(self, cluster: str) -> dict[str, Any]:
        servers = self.fleet.agents["a"].get("/v1/state").json()["servers"]
        return next(s for s in servers if s["id"] == f"{cluster}@a")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, smollm2_f32: Path) -> Iterator[World]:
    base = tmp_path_factory.mktemp("adapter")
    make_adapter(smollm2_f32, base / "lora")
    refs = {"tuned": peft_reference(smollm2_f32, base / "lora", QUESTION, TOKENS),
            "plain": peft_reference(smollm2_f32, None, QUESTION, TOKENS)}
    port = free_port(*ADDRESSES.values())
    agents = {n: Agent(n, addr, port, base / n) for n, addr in ADDRESSES.items()}
    proc = None
    try:
        for a in agents.values():
            a.start()
        digests = {"smollm2": import_model(agents["cp"], smollm2_f32), "lora": import_model(agents["cp"], base / "lora"),
                   "tiny": import_model(agents["cp"], tiny_safetensors(base))}
        f = Fleet(base, agents, digests)
        listen = f"{ADDRESSES['cp']}:{free_port(ADDRESSES['cp'])}"
        ports = {"tuned": free_port(ADDRESSES["a"]), "plain": free_port(ADDRESSES["a"])}
        while ports["plain"] == ports["tuned"]:
            ports["plain"] = free_port(ADDRESSES["a"])
        settings = "{context_length: 256, threads: 1, startup_timeout_s: 300}"
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in agents.items())
        f.file.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{listen}"}}
nodes:
{nodes}
models:
  smollm2: {{format: safetensors, digest: "{digests['smollm2']}", source: cp}}
  lora: {{format: peft, digest: "{digests['lora']}", source: cp}}
  tiny: {{format: safetensors, digest: "{digests['tiny']}", source: cp}}
replicas:
  smollm2: [a]
clusters:
  tuned: {{model: smollm2, adapter: lora, members: [a], port: {ports['tuned']}, settings: {settings}}}
  plain: {{model: smollm2, members: [a], port: {ports['plain']}, settings: {settings}}}
""")
        planned = f.run("plan")
        assert planned.returncode == 0, planned.stdout + planned.stderr
        applied = f.run("apply", "--auto-approve", timeout=900)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        proc = start_serve(f, listen)  # up, and one heartbeat seen
        yield World(f, listen, digests, refs, planned.stdout)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        for a in agents.values():
            a.stop()


def test_the_merged_adapter_answers_as_peft_merges_it_and_unlike_the_base(world: World) -> None:
    assert world.refs["tuned"] != world.refs["plain"], world.refs  # the adapter changes the answer
    assert world.ask("tuned") == world.refs["tuned"]
    assert world.ask("plain") == world.refs["plain"]


def test_the_adapter_is_pinned_replicated_and_shown_where_it_runs(world: World) -> None:
    a = world.fleet.agents["a"]
    held = [w["digest"] for w in a.get("/v1/state").json()["weights"]]
    assert sorted(held) == sorted([world.digests["smollm2"], world.digests["lora"]])  # the base once, for both
    manifest = json.loads(a.get(f"/v1/manifests/{world.digests['lora']}").content)
    assert manifest["format"] == "peft" and manifest["adapter"]["rank"] == 4, manifest
    assert manifest["adapter"]["target_modules"] == ["q_proj", "v_proj"]
    assert manifest["adapter"]["base_model"], manifest  # as adapter_config.json names it
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f["path"] for f in manifest["files"]}
    tuned, plain = world.server("tuned"), world.server("plain")
    assert tuned["settings"]["adapter"] == {"name": "lora", "digest": world.digests["lora"]}, tuned
    assert "adapter" not in plain["settings"], plain
    assert f"adapter lora ({world.digests['lora']}) merged at load" in world.first_plan, world.first_plan
    assert "replica.lora@a" in world.first_plan
    nodes = world.fleet.run("nodes", "--wide")
    assert nodes.returncode == 0, nodes.stdout + nodes.stderr
    assert "tuned:running +adapter lora" in nodes.stdout and "plain:running," in nodes.stdout + ",", nodes.stdout


def test_a_wrong_base_is_a_plan_error_naming_both_digests(world: World) -> None:
    other = world.fleet.base / "wrong-base.yaml"
    text = world.fleet.file.read_text()
    other.write_text(text.replace("  tuned: {model: smollm2, adapter: lora,", "  tuned: {model: tiny, adapter: lora,")
                     .replace("replicas:\n", "replicas:\n  tiny: [a]\n"))
    planned = subprocess.run([fleet_bin(), "plan", "-f", str(other), "--json"], capture_output=True, text=True,
                             timeout=300, env=agent_env(FLEET_STATE_DIR=str(world.fleet.state_dir)),
                             stdin=subprocess.DEVNULL)
    assert planned.returncode == Exit.PLAN_REFUSED, planned.stdout + planned.stderr
    diags = [d for d in json.loads(planned.stdout)["diagnostics"] if d["code"] == "adapter_base_mismatch"]
    assert len(diags) == 1, planned.stdout
    assert world.digests["lora"] in diags[0]["summary"] and world.digests["tiny"] in diags[0]["summary"], diags
    assert diags[0]["address"] == "clusters.tuned.adapter"


def test_a_corrupt_adapter_byte_is_found_at_verification_and_fetched_again(world: World) -> None:
    a = world.fleet.agents["a"]
    digest = world.digests["lora"]
    entry = next(w for w in a.get("/v1/state").json()["weights"] if w["digest"] == digest)
    stored = Path(entry["path"]) / "adapter_model.safetensors"
    size = stored.stat().st_size
    with open(stored, "r+b") as fh:  # the last byte of the last tensor, in place
        fh.seek(size - 1)
        byte = fh.read(1)
        fh.seek(size - 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    found = httpx.post(f"{a.url}/v1/weights/{digest}/verify", headers={"Authorization": f"Bearer {SECRET}"},
                       timeout=300).json()
    assert found["integrity"]["state"] == "corrupt", found
    assert found["integrity"]["file"] == "adapter_model.safetensors", found
    failed = world.server("tuned")
    assert failed["state"] == "failed" and "found corrupt" in failed["reason"], failed
    assert world.server("plain")["state"] == "running"  # the base's other server loads no adapter

    plan = world.fleet.run("plan", "--detailed-exitcode")
    assert plan.returncode == 2, plan.stdout + plan.stderr
    assert "replica.lora@a" in plan.stdout and "server.tuned@a" in plan.stdout, plan.stdout
    applied = world.fleet.run("apply", "--auto-approve", timeout=600)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert world.server("tuned")["state"] == "running"
    deadline = time.monotonic() + 60
    while True:  # until the heartbeat has seen the server started again
        try:
            answer = world.ask("tuned")
            break
        except openai.APIStatusError as exc:
            assert exc.status_code in (502, 503) and time.monotonic() < deadline, exc
            time.sleep(0.2)
    assert answer == world.refs["tuned"]
