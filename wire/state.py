"""GET /v1/state as TypedDicts: what a fleet-agent reports about its node.

Mirrors schemas/agent-state.schema.json (the control plane validates every answer against it) and
names the fields the agent sends beyond what the schema requires. Typing only: nothing here runs."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from wire.plan_details import GpuShare


class IdentityJson(TypedDict):
    id: str  # 32 lowercase hex digits
    name: str
    enrolled_at: str  # ISO 8601


class Cores(TypedDict):
    logical: int
    usable: int  # the cores this process may run on


class Memory(TypedDict):
    total_bytes: int
    available_bytes: int


class Disk(TypedDict):
    path: str  # the agent's home: the disk the figures are about
    total_bytes: int
    free_bytes: int
    reserve_bytes: NotRequired[int]  # kept free: a fetch that would eat into it is refused (disk_full)


class GpuJson(TypedDict):
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int


class Inventory(TypedDict):
    cores: Cores
    memory: Memory
    disk: Disk
    gpus: list[GpuJson]
    gpu_source: str  # "nvml", "simulated" or "none"
    gpu_note: str  # why there are no GPUs, or where simulated ones come from
    simulated: bool


class Availability(TypedDict):
    windows: list[str]  # "HH:MM-HH:MM", the node's local time
    always: bool  # no windows: always available
    inside: bool
    current_ends_at: str | None
    next_starts_at: str | None


class SliceInfo(TypedDict):
    of: str  # the full model's digest
    layers: str  # "FIRST-LAST" (LayerRange.span)
    total_layers: int


class Integrity(TypedDict):
    """What the agent's last verification of a held model found (agent/weights/verify.py)."""

    state: str  # "unverified", "verified" or "corrupt" (no server starts on it: model_corrupt)
    checked_at: str | None  # ISO 8601, UTC
    file: str | None  # the first file found bad, as the manifest names it
    reason: str | None  # what was wrong with it (and how many other files were bad)


class Encryption(TypedDict):
    """How a held model is encrypted at rest (agent/weights/sealed.py), and whether this agent can decrypt it."""

    cipher: str  # "aes-256-gcm"
    key_id: str  # the key it is sealed under, by id (never the key)
    key_held: bool  # the agent holds that key: without it no server starts on the model


class Architecture(TypedDict):
    """What a held model's KV cache is sized from (agent/weights/architecture.py): per token,
    layers x 2 (K and V) x kv_heads x head_dim x kv_dtype_bytes."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: int


class WeightsEntry(TypedDict):
    """A model held, whole or a slice."""

    digest: str
    name: str
    format: str  # "safetensors" or "gguf"
    bytes: int
    layers: int | None  # how many layers the held weights have (None: unknown, e.g. GGUF)
    slice: SliceInfo | None
    path: str
    simulated: NotRequired[bool]  # claimed by a simulated agent (fleet-agent simulate): no bytes behind it
    integrity: NotRequired[Integrity]  # sent by agents that verify what they hold
    encryption: NotRequired[Encryption]  # only for a model encrypted at rest
    architecture: NotRequired[Architecture]  # where the agent could read it from config.json or the GGUF metadata


class FetchJob(TypedDict):
    """A fetch running (in `fetches`), or the answer of GET/PUT /v1/weights/{digest} while one runs."""

    digest: str
    state: str  # "fetching", "present" or "failed"
    peer: str
    layers: str | None  # LayerRange as written, for a slice
    bytes_total: int
    bytes_done: int  # verified or on disk, counting what a resume found
    bytes_fetched: int  # crossed the wire in this job
    rate_bytes_per_s: int
    error: str | None
    code: NotRequired[str | None]  # a failure's stable code (disk_full, fetch_failed, ...)
    resumable: NotRequired[bool]  # failed keeping what arrived: asking again resumes
    bytes_forwarded: NotRequired[int]  # served to peers from this fetch's files before they were whole


class LinkRate(TypedDict):
    """What the agent measured on its recent fetches from one peer (agent/transfer/rates.py)."""

    peer: str  # "HOST:PORT", the peer agent's address as fleet.yaml gives it
    bytes_per_s: int  # the recent fetches' bytes over their seconds, ask to commit
    samples: int  # how many fetches (the last few, bounded)
    last_bytes_per_s: int
    measured_at: str  # ISO 8601, UTC: when the last of them ended


class ServerExit(TypedDict):
    code: int | None
    signal: int | None


class PipelineInfo(TypedDict):
    """A pipeline stage's place in its group (from the start's wire.plan_details.PipelineDetails)."""

    group: str
    rank: int
    world_size: int


class ServerEntry(TypedDict):
    id: str  # "CLUSTER@NODE" (wire.ids.server_id) for servers fleet started
    state: str  # "starting", "running", "failed", "stopping" or "stopped"
    model: str  # digest
    backend: str
    host: str
    port: int
    pid: int | None
    settings: dict[str, Any]  # as the plan resolved them (wire.plan_details.ServerSettings)
    speculative: dict[str, Any] | None
    uptime_s: float
    reason: str | None  # why it failed, first line first
    exit: ServerExit | None
    pipeline: NotRequired[PipelineInfo]  # only for a pipeline stage
    # What the worker asks of every request, as `Authorization: Bearer CREDENTIAL` (the router sends
    # it); absent from agents that predate it.
    credential: NotRequired[str]
    # The GPUs the agent gave this server and the bytes reserved on each, as the start asked
    # (wire.plan_details.GpuShare): what the planner's per-GPU ledger counts as fleet's own. Absent
    # (or empty) for a server on no GPU.
    gpus: NotRequired[list[GpuShare]]


class AgentState(TypedDict):
    identity: IdentityJson
    agent_version: str
    # "accelerator" (cpu, cuda or rocm), each engine's version or build, and "findings": a list of
    # {check, level, message, install} where a build does not match the GPUs (absent when none)
    variant: dict[str, Any]
    inventory: Inventory
    availability: Availability
    observed_at: str  # the agent's clock, ISO 8601 with its UTC offset
    weights: list[WeightsEntry]
    fetches: list[FetchJob]
    servers: list[ServerEntry]
    link_rates: NotRequired[list[LinkRate]]  # per peer, from the agent's own fetches (absent from older agents)
    # Added by GET /v1/state (not by AgentContext.state): the state's name, also its ETag; asked
    # with If-None-Match: "GENERATION", an agent whose state is unchanged answers 304.
    generation: NotRequired[str]
