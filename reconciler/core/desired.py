"""The desired state of a fleet as frozen values: what fleet.yaml asks for, already checked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from wire.ids import replica_address
from wire.layers import LayerRange

DEFAULT_AGENT_PORT = 7070
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    address: str
    agent_port: int = DEFAULT_AGENT_PORT
    hostname: str | None = None
    identity: str | None = None
    tls: bool = False
    available: tuple[str, ...] = ()
    ca_file: str | None = None  # the CAs trusted for its agent's certificate (control_plane.agent_ca_file)
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def agent_url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{'https' if self.tls else 'http'}://{host}:{self.agent_port}"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    format: Literal["safetensors", "gguf", "peft"]  # peft: a LoRA adapter, served only as a cluster's adapter
    digest: str
    source: str
    encrypted: bool = False
    layers: int | None = None


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    model: str
    node: str
    layers: LayerRange | None = None  # None: the whole model

    @property
    def address(self) -> str:
        return replica_address(self.model, self.node)


@dataclass(frozen=True, slots=True)
class SpeculativeSpec:
    mode: Literal["draft", "prompt_lookup"]
    draft: str | None = None
    tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Settings:
    context_length: int | None = None
    threads: int | None = None
    batch_size: int | None = None
    parallel: int | None = None  # requests decoded together (sequences of KV cache)
    tensor_parallel: int | Literal["auto"] | None = None
    speculative: SpeculativeSpec | None = None
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    # GPUs pinned by index: ("*", (0, 1)) for every member, (NODE, (...)) for one; () lets the planner choose.
    gpus: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def gpus_for(self, node: str) -> tuple[int, ...] | None:
        if not self.gpus:  # the common case: asked per member and candidate, 40,000 times at 10,000 nodes
            return None
        own = next((g for n, g in self.gpus if n == node), None)
        return own if own is not None else next((g for n, g in self.gpus if n == "*"), None)


@dataclass(frozen=True, slots=True)
class Placement:
    """`members: {count: N}`: the planner chooses N nodes from `nodes` (all when empty) that carry
    every label in `labels` (reconciler/planning/placement.py)."""

    count: int
    nodes: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """A cluster whose members each hold a slice and run only its layers, one stage each, in
    member order; the first stage's node hosts the rendezvous on `rendezvous_port`."""

    rendezvous_port: int


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    name: str
    model: str
    members: tuple[str, ...]
    port: int
    settings: Settings = field(default_factory=Settings)
    pipeline: PipelineSpec | None = None  # None: every member serves the whole model
    placement: Placement | None = None  # members chosen by the planner: `members` is then () in fleet.yaml's Desired
    adapter: str | None = None  # a model of format peft, merged into `model` at load by each member


@dataclass(frozen=True, slots=True)
class ServeTlsSpec:
    """control_plane.tls: the certificate (PEM, chain included) and key `fleet serve` answers with."""

    cert: str
    key: str


@dataclass(frozen=True, slots=True)
class ControlPlaneSpec:
    node: str
    listen: str = DEFAULT_LISTEN
    api_keys_env: str | None = None
    tls: ServeTlsSpec | None = None
    state: str | None = None  # the state store's URL (reconciler/state/backend.py); never a password


@dataclass(frozen=True, slots=True)
class Desired:
    """Everything fleet.yaml asks for. Mappings are keyed by name and kept in file order."""

    version: int
    control_plane: ControlPlaneSpec
    nodes: dict[str, NodeSpec]
    models: dict[str, ModelSpec]
    replicas: tuple[ReplicaSpec, ...]
    clusters: dict[str, ClusterSpec]
    delete_last_copy: frozenset[str] = frozenset()  # digests whose last copy in the fleet may be deleted
