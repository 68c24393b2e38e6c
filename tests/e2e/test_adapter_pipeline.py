"""A LoRA adapter on a pipeline (issue 29), on a real fleet: SmolLM2-135M-Instruct (float32
safetensors) and the test's adapter (tests/models.make_adapter: rank 4 on q/v of every layer)
imported on cp; a two-stage pipeline (a 0-14, b 15-29) with `adapter:` planned and applied, so
that each stage fetches the slice of the adapter for its layers beside its slice of the model and
merges it at load. Asked through `fleet serve`, its greedy tokens equal the whole model's with peft's
own merge, computed in this process (and differ from the base's); each stage holds only its
layers' adapter tensors, as the bytes in its store show."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import openai
import pytest
from safetensors import safe_open

from wire.layers import LayerRange
from wire.manifest import layer_of

from tests.addresses import loopback
from tests.agents import Agent, free_port
from tests.fleets import Fleet, import_model, start_serve
from tests.models import make_adapter, peft_reference

pytestmark = pytest.mark.e2e
QUESTION = "What is the capital of France? Answer in one sentence."
TOKENS = 12
ADDRESSES = dict(zip(("cp", "a", "b"), loopback(3)))
STAGES = {"a": "0-14", "b": "15-29"}


def test_a_two_stage_pipeline_merges_each_stage_s_part_of_the_adapter(tmp_path: Path, smollm2_f32: Path) -> None:
    make_adapter(smollm2_f32, tmp_path / "lora")
    refs = {"tuned": peft_reference(smollm2_f32, tmp_path / "lora", QUESTION, TOKENS),
            "plain": peft_reference(smollm2_f32, None, QUESTION, TOKENS)}
    assert refs["tuned"] != refs["plain"], refs  # the adapter changes the answer
    port = free_port(*ADDRESSES.values())
    agents = {n: Agent(n, addr, port, tmp_path / n) for n, addr in ADDRESSES.items()}
    proc = None
    try:
        for agent in agents.values():
            agent.start()
        digests = {"smollm2": import_model(agents["cp"], smollm2_f32),
                   "lora": import_model(agents["cp"], tmp_path / "lora")}
        f = Fleet(tmp_path, agents, digests)
        listen = f"{ADDRESSES['cp']}:{free_port(ADDRESSES['cp'])}"
        server, rendezvous = free_port(*ADDRESSES.values()), free_port(*ADDRESSES.values())
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in agents.items())
        slices = ", ".join(f'{{node: {n}, layers: "{layers}"}}' for n, layers in STAGES.items())
        f.file.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{listen}"}}
nodes:
{nodes}
models:
  smollm2: {{format: safetensors, digest: "{digests['smollm2']}", source: cp, layers: 30}}
  lora: {{format: peft, digest: "{digests['lora']}", source: cp}}
replicas:
  smollm2: [{slices}]
clusters:
  tuned: {{model: smollm2, adapter: lora, members: [a, b], port: {server}, pipeline: {{rendezvous_port: {rendezvous}}},
          settings: {{context_length: 256, threads: 1, startup_timeout_s: 300}}}}
""")
        planned = f.run("plan")
        assert planned.returncode == 0, planned.stdout + planned.stderr
        for node, layers in STAGES.items():  # each stage's part of the adapter, fetched before it starts
            assert f"replica.lora[{layers}]@{node}" in planned.stdout, planned.stdout
        applied = f.run("apply", "--auto-approve", timeout=900)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        proc = start_serve(f, listen)

        client = openai.OpenAI(base_url=f"http://{listen}/v1", api_key="unused", max_retries=0, timeout=300)
        done = client.chat.completions.create(model="tuned", messages=[{"role": "user", "content": QUESTION}],
                                              temperature=0, max_tokens=TOKENS)
        assert done.choices[0].message.content == refs["tuned"]

        full = json.loads(agents["cp"].get(f"/v1/manifests/{digests['lora']}").content)
        every = {t["name"] for f_ in full["files"] for t in f_.get("tensors", ())}
        config_sha = next(f_["sha256"] for f_ in full["files"] if f_["path"] == "adapter_config.json")
        seen: set[str] = set()
        for node, layers in STAGES.items():
            state = agents[node].get("/v1/state").json()
            stage = next(s for s in state["servers"] if s["id"] == f"tuned@{node}")
            assert stage["state"] == "running", stage
            part = stage["settings"]["adapter"]
            assert part["name"] == "lora" and part["digest"] != digests["lora"], part  # its slice, not the whole
            held = {w["digest"]: w for w in state["weights"]}
            assert digests["lora"] not in held, sorted(held)  # the whole adapter never came here
            entry = held[part["digest"]]
            assert entry["format"] == "peft" and entry["slice"] == {"of": digests["lora"], "layers": layers}, entry
            with safe_open(str(Path(entry["path"]) / "adapter_model.safetensors"), framework="pt") as fh:
                names = set(fh.keys())  # the bytes the stage holds
            span = LayerRange.parse(layers)
            assert names and all(layer_of(n) in span for n in names), sorted(names)
            assert names == {n for n in every if layer_of(n) in span}  # all of its layers' tensors, no other
            seen |= names
            manifest = json.loads(agents[node].get(f"/v1/manifests/{part['digest']}").content)
            assert {t["name"] for f_ in manifest["files"] for t in f_.get("tensors", ())} == names
            assert next(f_["sha256"] for f_ in manifest["files"] if f_["path"] == "adapter_config.json") == config_sha
            assert (Path(entry["path"]) / "adapter_config.json").is_file()
        assert seen == every  # the two stages hold the whole adapter between them
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        for agent in agents.values():
            agent.stop()
