"""A pipeline's group: who the stages are, forming the torch.distributed group at the rendezvous
the plan gave (a TCPStore on the first stage's node, tcp:// as torch calls it), the transport
(gloo, NCCL where every stage has its own CUDA device), and liveness: every stage beats in the
store, watches the others' beats, and the first failure posted there is the one every stage
reports.

The store lives in stage 0's process, so a stage that cannot reach it knows stage 0 is gone.

torch's TCPStore lets anyone who reaches the port read and write any key. So every key of the group
lives under a name derived from the group's secret (spec.group_key: its agent's, from the cluster
secret; never in the plan), which an outsider cannot guess: a stage without the secret never
appears as joined, and an outsider can neither read the stages' keys nor post their failure. The
store listens on stage 0's own address only (the plan's rendezvous must be it). A failure posted
for the group is a code, the ranks and the seconds it is about (Fault), never text: each stage
renders its sentence from its own copy of the plan's details."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore  # what torch.distributed re-exports

from wire.layers import LayerRange

from agent.backends.pipeline.spec import check_details

BEAT_S = 0.5  # how often a stage beats and looks at the others' beats
STORE_OP_TIMEOUT_S = 5.0  # one store operation once the group formed (a stopped stage 0 shows here)


# What a failure posted for the group may say: each code's sentence, rendered by every stage from
# its own copy of the plan's details ({stage}: the first rank named, {stages}: all of them).
SENTENCES = {
    "stopped": "{stage} stopped: the pipeline failed",
    "no_answer": "{stage} stopped answering: nothing arrived within {seconds:g} s",
    "closed": "{stage} stopped answering: its connection closed",
    "link_failed": "{stage} stopped answering",
    "silent": "{stage} stopped answering: no heartbeat for {seconds:g} s",
    "store_gone": "{stage} stopped answering: its rendezvous store is gone",
    "never_joined": "pipeline group {group} did not form within {seconds:g} s: {stages} never joined",
    "load_late": "{stages} did not load its slice within {seconds:g} s",
    "load_failed": "{stage} could not load its slice",
    "failed": "{stage} failed",
    "connect_failed": "{stage} could not connect to the other stages",
    "rendezvous_failed": "{stage} could not open the rendezvous on port {port}",
    "rendezvous_missing": "{stage} did not open the rendezvous at {address}:{port} within {seconds:g} s",
    "unreadable": "pipeline group {group} failed (its failure record could not be read)",
}
MAX_SECONDS = 1e7


@dataclass(frozen=True, slots=True)
class Fault:
    """A failure as the group's store holds it: a code of SENTENCES, the ranks and seconds it names."""

    code: str
    ranks: tuple[int, ...] = ()
    seconds: float = 0.0

    def render(self, spec: GroupSpec) -> str:
        named = [spec.stages[r] for r in self.ranks]
        return SENTENCES[self.code].format(stage=named[0] if named else "a stage", seconds=self.seconds,
                                           stages="; ".join(str(s) for s in named), group=spec.group,
                                           address=spec.rendezvous[0], port=spec.rendezvous[1])

    def encode(self) -> str:
        return json.dumps({"code": self.code, "ranks": list(self.ranks), "seconds": self.seconds})

    @staticmethod
    def decode(raw: bytes, spec: GroupSpec) -> Fault:
        """The fault `raw` holds; "unreadable" for anything else (a code not in SENTENCES, a rank
        not in the group, seconds not a number of at most MAX_SECONDS)."""
        try:
            value = json.loads(raw)
            code, ranks, seconds = value["code"], value["ranks"], value["seconds"]
            if (code in SENTENCES and isinstance(ranks, list) and len(ranks) <= spec.world_size
                    and all(type(r) is int and 0 <= r < spec.world_size for r in ranks)
                    and type(seconds) in (int, float) and math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
                return Fault(code, tuple(ranks), float(seconds))
        except (ValueError, TypeError, KeyError, RecursionError):
            pass
        return Fault("unreadable")


class PipelineFailed(Exception):
    """The group cannot go on: `fault` is what every stage reports; `detail` what this stage saw
    (for its own log only)."""

    def __init__(self, fault: Fault, detail: str = "") -> None:
        super().__init__(fault.code)
        self.fault, self.detail = fault, detail


def namespace(key: str, group: str) -> str:
    """Where the group's keys live in the store: derived from its secret (the group id itself where
    a stage was run by hand without one)."""
    if not key:
        return group
    return hmac.new(key.encode(), b"store keys\0" + group.encode(), hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class StageInfo:
    rank: int
    node: str
    address: str
    port: int
    layers: LayerRange

    def __str__(self) -> str:
        return f"pipeline stage {self.rank} (node {self.node}, {self.address}:{self.port}, layers {self.layers})"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A stage's place in its group, as the plan wrote it (wire.plan_details.PipelineDetails)."""

    group: str
    rank: int
    stages: tuple[StageInfo, ...]
    rendezvous: tuple[str, int]

    @staticmethod
    def parse(value: object, port: int) -> GroupSpec:
        """The details as the agent passed them (checked again here: BadSettings, a ValueError)."""
        details = check_details(value)
        stages = tuple(StageInfo(i, s["node"], s["address"], port, LayerRange.parse(s["layers"]))
                       for i, s in enumerate(details["stages"]))
        rdv = details["rendezvous"]
        return GroupSpec(details["group"], details["rank"], stages, (rdv["address"], rdv["port"]))

    @property
    def world_size(self) -> int:
        return len(self.stages)

    @property
    def me(self) -> StageInfo:
        return self.stages[self.rank]

    @property
    def last(self) -> bool:
        return self.rank == self.world_size - 1


def interface_of(address: str) -> str | None:
    """The network interface holding `address` (exactly, else by its subnet), for GLOO_SOCKET_IFNAME."""
    import psutil

    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    by_net = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                ip = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if ip == wanted:
                return name
            if a.netmask and ip.version == wanted.version and by_net is None:
                try:
                    if wanted in ipaddress.ip_network(f"{ip}/{a.netmask}", strict=False):
                        by_net = name
                except ValueError:
                    pass
    return by_net


def _gpu() -> str:
    if not torch.cuda.is_available():
        return ""
    return str(getattr(torch.cuda.get_device_properties(0), "uuid", "cuda:0"))


class Group:
    """This stage's membership: the store, the process group and the failure posted for all."""

    def __init__(self, spec: GroupSpec, store: TCPStore, backend: str, listener: socket.socket | None,
                 ns: str) -> None:
        self.spec, self.store, self.backend, self.ns = spec, store, backend, ns
        self.listener = listener  # the store's listening socket on stage 0: kept open as long as the group
        self.fail_key = f"{ns}/fail"

    @staticmethod
    def form(spec: GroupSpec, join_timeout_s: float, recv_timeout_s: float, key: str = "") -> Group:
        """Join the rendezvous, wait for every stage (naming those that never came), pick the
        transport and form the process group; PipelineFailed otherwise."""
        me, (host, port) = spec.me, spec.rendezvous
        ns = namespace(key, spec.group)
        iface = interface_of(me.address)
        if iface:  # gloo binds where the stage's own address lives, not where the hostname resolves
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        listener = None
        try:
            if spec.rank == 0:  # the store listens on the rendezvous address only, not on every interface
                listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((host, port))
                listener.listen(128)
            store = TCPStore(host, port, spec.world_size, spec.rank == 0, timeout=timedelta(seconds=join_timeout_s),
                             wait_for_workers=False, master_listen_fd=listener.fileno() if listener else None)
        except (RuntimeError, OSError) as exc:
            if spec.rank == 0:
                raise PipelineFailed(Fault("rendezvous_failed", (0,)), _first_line(exc)) from None
            raise PipelineFailed(Fault("rendezvous_missing", (0,), join_timeout_s), _first_line(exc)) from None
        store.add(f"{ns}/beat/{spec.rank}", 1)
        store.set(f"{ns}/joined/{spec.rank}", json.dumps({"gpu": _gpu()}))
        joined = _wait_joined(store, spec, ns, join_timeout_s)
        gpus = [j["gpu"] for j in joined]
        # NCCL needs a device of its own per stage; stages sharing one GPU (or any without) go over gloo.
        backend = "cpu:gloo,cuda:nccl" if all(gpus) and len(set(gpus)) == len(gpus) else "gloo"
        try:
            dist.init_process_group(backend, store=PrefixStore(f"{ns}/pg", store), rank=spec.rank,
                                    world_size=spec.world_size, timeout=timedelta(seconds=recv_timeout_s))
        except (RuntimeError, OSError) as exc:
            raise PipelineFailed(Fault("connect_failed", (spec.rank,)), f"{backend}: {_first_line(exc)}") from None
        store.set_timeout(timedelta(seconds=STORE_OP_TIMEOUT_S))
        return Group(spec, store, backend, listener, ns)

    def agree(self, name: str, value: str, timeout_s: float) -> list[str]:
        """Every stage's `value` of `name`, in rank order, once all have said theirs (a failure
        posted meanwhile ends the wait with its reason)."""
        spec = self.spec
        self.store.set(f"{self.ns}/{name}/{spec.rank}", value)
        keys = [f"{self.ns}/{name}/{r}" for r in range(spec.world_size)]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(self.store.check([k]) for k in keys):
                if self.store.check([self.fail_key]):
                    raise PipelineFailed(Fault.decode(bytes(self.store.get(self.fail_key)), spec))
                if time.monotonic() > deadline:
                    late = tuple(r for r, k in enumerate(keys) if not self.store.check([k]))
                    raise PipelineFailed(self.post(Fault("load_late", late, timeout_s)))
                time.sleep(0.05)
            return [bytes(self.store.get(k)).decode() for k in keys]
        except (RuntimeError, OSError) as exc:
            raise PipelineFailed(Fault("store_gone", (0,)), _first_line(exc)) from None

    def post(self, fault: Fault) -> Fault:
        """Record `fault` as the group's failure unless one was recorded first; the one recorded.
        A store out of reach means stage 0 is gone, whatever this stage saw."""
        try:
            return Fault.decode(bytes(self.store.compare_set(self.fail_key, "", fault.encode())), self.spec)
        except (RuntimeError, OSError):
            if self.spec.rank == 0:
                return fault
            return Fault("store_gone", (0,))

    def posted(self) -> Fault | None:
        try:
            if self.store.check([self.fail_key]):
                return Fault.decode(bytes(self.store.get(self.fail_key)), self.spec)
        except (RuntimeError, OSError):
            pass
        return None

    def watch(self, on_fail: Callable[[Fault], None], silence_s: float, armed: Callable[[], bool]) -> threading.Thread:
        """Beat every BEAT_S on a store connection of its own; call on_fail once with the group's
        failure: one posted by any stage, a stage silent for `silence_s` once `armed()` (this stage
        serves: while the group forms, loading can starve a stage's threads for seconds on a busy
        machine, and the formation's own timeouts bound it), or stage 0's store gone."""
        spec = self.spec
        host, port = spec.rendezvous

        def run() -> None:
            try:  # a connection of its own: the stage's thread may be blocked in a store call
                own = TCPStore(host, port, spec.world_size, False, timeout=timedelta(seconds=STORE_OP_TIMEOUT_S))
            except (RuntimeError, OSError):
                on_fail(self.post(Fault("store_gone", (0,))))
                return
            keys = [f"{self.ns}/beat/{r}" for r in range(spec.world_size)]
            seen: dict[int, tuple[bytes, float]] = {}
            while True:
                try:
                    own.add(keys[spec.rank], 1)
                    if own.check([self.fail_key]):
                        on_fail(Fault.decode(bytes(own.get(self.fail_key)), spec))
                        return
                    now = time.monotonic()
                    for r, value in enumerate(own.multi_get(keys)):
                        if r == spec.rank:
                            continue
                        old = seen.get(r)
                        if old is None or old[0] != value or not armed():
                            seen[r] = (value, now)
                        elif now - old[1] > silence_s:
                            on_fail(self.post(Fault("silent", (r,), silence_s)))
                            return
                except (RuntimeError, OSError):
                    on_fail(self.post(Fault("store_gone", (0,))))
                    return
                time.sleep(BEAT_S)

        thread = threading.Thread(target=run, name="pipeline-watch", daemon=True)
        thread.start()
        return thread


def _wait_joined(store: TCPStore, spec: GroupSpec, ns: str, timeout_s: float) -> list[dict[str, Any]]:
    keys = [f"{ns}/joined/{r}" for r in range(spec.world_size)]
    fail_key = f"{ns}/fail"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            present = [bool(store.check([k])) for k in keys]
            if all(present):
                return [json.loads(bytes(store.get(k))) for k in keys]
            if store.check([fail_key]):  # another stage gave up first: its reason is the group's
                raise PipelineFailed(Fault.decode(bytes(store.get(fail_key)), spec))
            if time.monotonic() > deadline:
                missing = Fault("never_joined", tuple(r for r, p in enumerate(present) if not p), timeout_s)
                raise PipelineFailed(Fault.decode(bytes(store.compare_set(fail_key, "", missing.encode())), spec))
            time.sleep(0.05)
    except (RuntimeError, OSError) as exc:
        raise PipelineFailed(Fault("store_gone", (0,)), f"while the group formed: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
