"""The pipeline stage launch spec: a slice of a safetensors model served as one stage of a pipeline
by agent.backends.pipeline.stage; the agent picks it, by name, for a start that carries `pipeline`.
Also the check of those pipeline details, shared by the agent (before any process) and the stage."""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from typing import Any

from wire.layers import LayerRange, LayerRangeError
from wire.plan_details import PipelineDetails

from agent.backends.launch import BadSettings, Command, LaunchSpec, ModelPath
from agent.backends.torch import spec as torch_spec

NAME = "pipeline"
WORKER = "agent.backends.pipeline.stage"
# A stage imports what a torch worker does (it serves with the same code) and the pipeline's own.
PRELOAD = (*torch_spec.PRELOAD, "torch.distributed", "agent.backends.pipeline.engine", "agent.backends.pipeline.group",
           "agent.backends.pipeline.link", "agent.backends.pipeline.model", "agent.backends.pipeline.rows",
           "agent.backends.pipeline.web")

# The secret a group's stages share, in a stage's environment (never on its command line, in the
# plan or in fleet.yaml): each stage's agent derives it from the cluster secret and the group id.
PIPELINE_KEY_ENV = "FLEET_PIPELINE_KEY"


def group_key(cluster_secret: bytes, group: str) -> str:
    """The rendezvous secret of pipeline `group`: the same on every agent of the cluster, unknown to
    anyone without the cluster secret (the group id alone is printed by `fleet plan`)."""
    return hmac.new(cluster_secret, b"fleet pipeline rendezvous\0" + group.encode(), hashlib.sha256).hexdigest()


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise BadSettings(f"pipeline {where} must be a non-empty string")
    return value


def _int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadSettings(f"pipeline {where} must be an integer {low}-{high}")
    return value


def check_details(value: Any) -> PipelineDetails:
    """`value` as the plan's pipeline details ({group, rank, world_size, rendezvous, stages}), the
    stages' layers following each other from layer 0; BadSettings saying what is wrong otherwise."""
    if not isinstance(value, dict):
        raise BadSettings("pipeline must be an object: {group, rank, world_size, rendezvous, stages}")
    stages = value.get("stages")
    if not isinstance(stages, list) or len(stages) < 2:
        raise BadSettings("pipeline stages must list two stages or more, in layer order")
    world = _int(value.get("world_size"), "world_size", 2, 4096)
    if world != len(stages):
        raise BadSettings(f"pipeline world_size {world} does not match its {len(stages)} stages")
    rank = _int(value.get("rank"), "rank", 0, world - 1)
    rdv = value.get("rendezvous")
    if not isinstance(rdv, dict):
        raise BadSettings("pipeline rendezvous must be an object: {address, port}")
    checked: PipelineDetails = {
        "group": _text(value.get("group"), "group"), "rank": rank, "world_size": world,
        "rendezvous": {"address": _text(rdv.get("address"), "rendezvous.address"),
                       "port": _int(rdv.get("port"), "rendezvous.port", 1, 65535)},
        "stages": []}
    end = -1
    for i, s in enumerate(stages):
        if not isinstance(s, dict):
            raise BadSettings(f"pipeline stages[{i}] must be an object: {{node, address, layers}}")
        try:
            layers = LayerRange.parse(s.get("layers"))
        except LayerRangeError as exc:
            raise BadSettings(f"pipeline stages[{i}].layers: {exc}") from None
        if layers.first != end + 1:
            raise BadSettings(f"pipeline stages[{i}] starts at layer {layers.first}, not at {end + 1}: the "
                              "stages must cover the layers in order, each once")
        end = layers.last
        checked["stages"].append({"node": _text(s.get("node"), f"stages[{i}].node"),
                                  "address": _text(s.get("address"), f"stages[{i}].address"),
                                  "layers": str(layers)})
    if checked["stages"] and checked["rendezvous"]["address"] != checked["stages"][0]["address"]:
        raise BadSettings(f"pipeline rendezvous.address {checked['rendezvous']['address']} must be stage 0's address "
                          f"{checked['stages'][0]['address']}: the rendezvous store lives in the first stage")
    return checked


def command(path: str, host: str, port: int, s: dict[str, Any], _paths: ModelPath) -> Command:
    """`s` is the server's settings plus what the agent adds for a stage: `pipeline` (its details),
    `reason_file` (where the stage writes why it failed) and, with an adapter, `adapter_dir` (the
    slice of it for the stage's layers)."""
    details = check_details(s.get("pipeline"))
    if s.get("speculative"):
        raise BadSettings("a pipeline stage does not decode speculatively; remove speculative from the settings")
    argv = [sys.executable, "-m", WORKER, "--model", path, "--host", host,
            "--port", str(port), "--pipeline", json.dumps(details, separators=(",", ":"))]
    if s.get("served_name"):  # what /v1/models and every answer's `model` say: the cluster, not a path
        argv += ["--served-name", str(s["served_name"])]
    if s.get("context_length"):
        argv += ["--context-length", str(s["context_length"])]
    if s.get("threads"):
        argv += ["--threads", str(s["threads"])]
    if s.get("startup_timeout_s"):
        # Half the agent's patience: a stage that never joined is reported as such, by name,
        # before the agent gives up on the health check.
        argv += ["--join-timeout", f"{float(s['startup_timeout_s']) / 2:g}"]
    if s.get("reason_file"):
        argv += ["--reason-file", str(s["reason_file"])]
    if s.get("adapter"):  # the slice of a LoRA adapter for this stage's layers, merged at load
        if not s.get("adapter_dir"):
            raise BadSettings("a stage's adapter is given by the agent as adapter_dir: the slice of it it holds")
        argv += ["--adapter", str(s["adapter_dir"])]
    return Command(tuple(argv), None)


SPEC = LaunchSpec(name=NAME, format="safetensors", modules=("torch", "transformers"), extra="torch",
                  health="/health", command=command, worker=WORKER, preload=PRELOAD)
