"""The `details` of each plan action as TypedDicts: what the planner writes and the executor reads.

schemas/plan.schema.json leaves `details` an open object ("what the executor needs"); these are
its shapes, one per action. Typing only: nothing here runs."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class ReplicateDetails(TypedDict):
    """replicate: fetch `digest` from `peer` (a node name); a slice adds layers and its source."""

    model: str
    digest: str
    format: str  # "safetensors" or "gguf"
    peer: str
    bytes: int
    layers: NotRequired[str]  # LayerRange as written ("0-39", or "7" for one layer)
    source_digest: NotRequired[str]  # the full model a slice is cut from
    estimate: NotRequired[ReplicationEstimate]  # how long, at the rate the receiver measured from the peer


class ReplicationEstimate(TypedDict):
    """A fetch's estimate (reconciler/planning/notes.py): seconds None is "no measurement yet"."""

    node_bytes: int  # every byte this plan fetches onto the receiving node
    seconds: float | None
    bytes_per_s: int | None  # the receiver's recent fetches from this peer, bytes over seconds
    samples: int  # how many fetches that rate comes from


class Speculative(TypedDict):
    mode: str  # "draft" or "prompt_lookup"
    draft: NotRequired[str]  # the draft model's name
    draft_digest: NotRequired[str]
    tokens: NotRequired[int]


class Adapter(TypedDict):
    name: str  # the adapter's model name in fleet.yaml
    digest: str


class ServerSettings(TypedDict, total=False):
    """Settings resolved for one node (tensor_parallel "auto" is already a number): only those set,
    in this order; the planner always writes startup_timeout_s, last."""

    context_length: int
    threads: int
    batch_size: int
    parallel: int  # requests decoded together; unset: GPU_SEQUENCES on GPUs
    tensor_parallel: int
    speculative: Speculative
    adapter: Adapter  # a LoRA adapter merged into the model at load
    startup_timeout_s: float


class Rendezvous(TypedDict):
    """Where a pipeline's stages meet (torch.distributed tcp:// init): the first stage's node."""

    address: str
    port: int


class Stage(TypedDict):
    node: str
    address: str  # the node's address; the stage listens there on the cluster's port
    layers: str  # LayerRange as written ("0-14")


class PipelineDetails(TypedDict):
    """A pipeline stage's place in its group; the same on every stage but `rank`. The agent passes
    it to the stage worker and reports {group, rank, world_size} back in the server's entry."""

    group: str  # 16 hex: digest of the stages, their slices, the port, rendezvous and settings
    rank: int  # this stage's index in `stages`
    world_size: int
    rendezvous: Rendezvous
    stages: list[Stage]  # in layer order


class GpuShare(TypedDict):
    """One GPU given to a server, and the bytes reserved for it there. The planner assigns them
    (reconciler/planning/gpus.py); the agent launches the worker with exactly these GPUs visible
    (CUDA_VISIBLE_DEVICES by uuid), refuses a start that would over-commit one by what its other
    servers reserve there (`gpu_overcommitted`), and reports them back on the server
    (wire.state.ServerEntry.gpus)."""

    index: int  # the GPU's index on its node, as the agent's inventory reports it
    uuid: str  # NVML's UUID ("GPU-..."), what the worker's CUDA_VISIBLE_DEVICES names
    bytes: int  # reserved on this GPU for this server


# Sequences a server on GPUs keeps at once, the figure its KV cache is reserved for: the PyTorch
# engine's --max-batch default, and the --parallel the agent gives the batched llama.cpp worker when
# the plan gave it GPUs (on a CPU node that worker sizes itself to the memory free).
GPU_SEQUENCES = 16


class VramEstimate(TypedDict):
    """What a server needs in GPU memory, by part (the plan's JSON shows each): the weights as
    loaded (dtype or quantisation), the KV cache for its context length and concurrent sequences,
    and the engine's own overhead. `total_bytes` is their sum, split over the server's GPUs."""

    weights_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int
    total_bytes: int
    basis: str  # how the KV cache was sized, in words ("24 layers x 4 KV heads x 64 x 2 x f16 x 8,192 tokens x 1 sequence")


class StartDetails(TypedDict):
    """start: run cluster `cluster`'s server `server_id` on `host`:`port`. A pipeline stage's
    `digest` is its slice's, and `pipeline` places it in its group. On a node with GPUs, `gpus`
    names the GPUs it is given (and what is reserved on each) and `vram` how that was estimated;
    absent on a CPU-only node."""

    cluster: str
    server_id: str  # wire.ids.server_id(cluster, node)
    model: str
    digest: str
    port: int
    host: str
    settings: ServerSettings
    pipeline: NotRequired[PipelineDetails]
    gpus: NotRequired[list[GpuShare]]
    vram: NotRequired[VramEstimate]


class RunningServer(TypedDict):
    model: str  # digest
    port: int
    settings: dict[str, Any]  # as the agent reports them
    group: NotRequired[str]  # a pipeline stage's group


class ReplaceDetails(StartDetails):
    """replace: as start, plus what runs there now."""

    before: RunningServer


class StopDetails(TypedDict):
    server_id: str
    model: str  # digest


class DeleteDetails(TypedDict):
    digest: str
    last_copy: NotRequired[bool]  # true: no verified copy is left in the fleet (fleet.yaml's delete_last_copy)


Details = ReplicateDetails | StartDetails | ReplaceDetails | StopDetails | DeleteDetails
