"""Each GPU's memory as the plan sees it, and the GPUs each server is given. Pure, like the planner.

Per node and GPU, the ledger holds what its agent measured (total and free, NVML's figures), what
fleet's own servers there reserve (each server reports the GPUs it was given and the bytes on each,
wire.state.ServerEntry.gpus), what processes that are not fleet's hold (`others`: what is used
beyond fleet's reservations), and what this plan adds. A running server that stays as it is is never
checked against its own memory: its reservation is simply kept. A replace, or a server this plan
stops, gives its share back before anything is taken; new servers on one node add up.

What a server needs is estimated from the model (estimate()): the weights as loaded (the bytes its
agent holds: the stored dtype, or the GGUF's quantisation), the KV cache for its context length and
concurrent sequences (from the model's architecture where the agent reports it, or the tensors of
a full manifest the planner holds; otherwise a fifth of the weights, said as such), and the
engine's overhead per GPU. The total is split evenly over the server's GPUs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import AbstractSet, Any, Mapping

from wire.plan_details import GPU_SEQUENCES, GpuShare, ServerSettings, VramEstimate

from reconciler.core.observed import Observed, ObservedNode

GIB = 1 << 30
MIB = 1 << 20
# The CUDA context, cuBLAS/cuDNN workspaces and the allocator's slack, per GPU a server uses: what a
# torch or llama.cpp process holds before its first tensor (300-500 MiB measured on CUDA 12), rounded up.
ENGINE_OVERHEAD = 512 * MIB
# What the workers use when the cluster sets no context length (agent/backends/torch/worker.py:
# 2,048 or the model's own limit, whichever is less; llama.cpp's worker the same), and how many
# sequences each keeps at once on its GPUs (wire.plan_details.GPU_SEQUENCES: the torch engine's
# --max-batch default, and the --parallel the agent gives the batched llama.cpp worker there, whose
# context holds that many sequences' KV cache).
DEFAULT_CONTEXT = 2048
SEQUENCES = {"safetensors": GPU_SEQUENCES, "gguf": GPU_SEQUENCES}
UNKNOWN_KV_FRACTION = 0.2  # the seed's rule, for a model whose architecture nothing reported
ACTIVE = ("starting", "running")  # a server in another state holds no GPU memory
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}
_K_PROJ = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.0\.(?:self_attn|attn|attention)\.(?:k_proj|key)\.weight$")


@dataclass(frozen=True, slots=True)
class Arch:
    """What the KV cache is sized from: per token, layers x 2 (K and V) x kv_width x elem bytes."""

    layers: int
    kv_width: int  # KV heads x head size
    elem_bytes: int  # the cache's dtype
    source: str  # where these came from, for `basis`


def arch_of(digest: str, o: Observed) -> Arch | None:
    """The architecture of model `digest`: as an agent reports it with the weights, else from the
    tensors of its full manifest where the planner holds one (the shape of layer 0's K projection)."""
    return Archs(o)(digest)


class Archs:
    """arch_of for one plan, each model's answer worked out once: the first node (in the observed
    order) whose agent reports an architecture for it, from one walk over every node's weights for
    all models (a walk per start made plans of 10,000 placed starts quadratic: 3.8 ms a node)."""

    def __init__(self, o: Observed) -> None:
        self.o = o
        self._reported: dict[str, tuple[int, int, int, int]] | None = None
        self._known: dict[str, Arch | None] = {}

    def __call__(self, digest: str) -> Arch | None:
        if digest in self._known:
            return self._known[digest]
        if self._reported is None:
            self._reported = {}
            for obs in self.o.nodes.values():
                for d, held in obs.weights.items():
                    if held.arch is not None and d not in self._reported:
                        self._reported[d] = held.arch
        got = self._reported.get(digest)
        arch: Arch | None
        if got is not None:
            layers, heads, head_dim, elem = got
            arch = Arch(layers, heads * head_dim, elem, f"{heads} KV heads x {head_dim}, as its agent reports")
        else:
            manifest = self.o.manifests.get(digest)
            arch = manifest_arch(manifest) if manifest else None
        self._known[digest] = arch
        return arch


def manifest_arch(manifest: Mapping[str, Any]) -> Arch | None:
    layers = manifest.get("layers")
    if not isinstance(layers, int) or layers <= 0:
        return None
    for f in manifest.get("files", ()):
        for t in f.get("tensors") or ():
            if _K_PROJ.search(t.get("name", "")) and t.get("shape"):
                elem = _DTYPE_BYTES.get(str(t.get("dtype")), 2)
                return Arch(layers, int(t["shape"][0]), elem, "KV width from the K projection's shape in the manifest")
    return None


def estimate(fmt: str, weights: int, arch: Arch | None, settings: ServerSettings, gpus: int,
             layers: int | None = None) -> VramEstimate:
    """What a server of `weights` bytes needs over `gpus` GPUs; `layers`: a pipeline stage's share
    of the model's layers (its KV cache holds only those). Of `settings`, only context_length and
    parallel are read (Estimates keys on them)."""
    tokens = int(settings.get("context_length") or DEFAULT_CONTEXT)
    seqs = int(settings.get("parallel") or SEQUENCES.get(fmt, 1))
    told = "" if settings.get("context_length") else " (the workers' default)"
    if arch is not None:
        n = layers if layers is not None else arch.layers
        kv = n * 2 * arch.kv_width * arch.elem_bytes * tokens * seqs
        basis = (f"{n} layers x 2 x {arch.kv_width} KV width x {arch.elem_bytes}-byte cache x {tokens:,} "
                 f"tokens{told} x {seqs} sequence{'s' if seqs > 1 else ''} ({arch.source})")
    else:
        kv = int(weights * UNKNOWN_KV_FRACTION)
        basis = ("architecture not reported (no layers, KV heads or head size): KV cache and activations taken "
                 f"as a fifth of the weights; context {tokens:,} tokens{told}")
    overhead = ENGINE_OVERHEAD * gpus
    return VramEstimate(weights_bytes=weights, kv_cache_bytes=kv, overhead_bytes=overhead,
                        total_bytes=weights + kv + overhead, basis=basis)


class Estimates:
    """estimate() for one plan, each (model, settings it reads, GPU count, layers) worked out once:
    placement sizes every candidate of a cluster and the assignment each start it places, the
    same sum with the same words. The estimates are shared between the changes that ask the same:
    not to be written to."""

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], VramEstimate] = {}

    def __call__(self, fmt: str, weights: int, arch: Arch | None, settings: ServerSettings, gpus: int,
                 layers: int | None = None) -> VramEstimate:
        key = (fmt, weights, arch, settings.get("context_length"), settings.get("parallel"), gpus, layers)
        got = self._known.get(key)
        if got is None:
            got = self._known[key] = estimate(fmt, weights, arch, settings, gpus, layers)
        return got


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


_NOTHING: frozenset[str] = frozenset()
_NO_PLAN: dict[str, int] = {}  # never written: a GPU's held is only read, Gpu.reserve makes its own plan


class Gpu:
    """One GPU of one node in the ledger. Its sums are kept as reservations are given back and
    made (release, reserve), not summed again each time they are read: a plan of 10,000 placed
    starts on nodes of 8 GPUs reads them half a million times."""

    __slots__ = ("index", "uuid", "name", "total", "free", "held", "others", "released", "planned", "fleet",
                 "after")

    def __init__(self, index: int, uuid: str, name: str, total: int, free: int, held: dict[str, int]) -> None:
        # One statement an attribute, held summed once and no max(): built 80,000 times a plan.
        self.index = index
        self.uuid = uuid
        self.name = name
        self.total = total
        self.free = free
        self.held = held  # server id -> bytes its agent reserved for it here (servers starting or running)
        fleet = sum(held.values()) if held else 0
        used = total - free - fleet
        self.others = used if used > 0 else 0  # used by processes that are not fleet's
        self._as_observed(fleet)

    def reset(self) -> None:
        """As the agent's figures alone make it: nothing given back, nothing reserved by this plan."""
        self._as_observed(sum(self.held.values()))

    def _as_observed(self, fleet: int) -> None:
        # Servers this plan replaces or stops, and server id -> bytes this plan reserves: shared empty
        # ones until the first (80,000 GPUs, most of which this plan never touches).
        self.released: AbstractSet[str] = _NOTHING
        self.planned: dict[str, int] = _NO_PLAN
        self.fleet = fleet  # fleet's reservations here that stay
        self.after = self.total - self.others - fleet  # free once this plan's reservations are made (may go negative)

    def release(self, sid: str) -> None:
        """`sid`'s reservation here given back, if it holds one."""
        if sid in self.held and sid not in self.released:
            self.released = self.released | {sid}
            self.fleet -= self.held[sid]
            self.after += self.held[sid]

    def reserve(self, sid: str, size: int) -> None:
        if self.planned is _NO_PLAN:
            self.planned = {}
        self.after += self.planned.get(sid, 0) - size
        self.planned[sid] = size

    def picture(self, node: str) -> str:
        return picture(self.to_json(node))

    def to_json(self, node: str) -> dict[str, Any]:
        return {"node": node, "index": self.index, "uuid": self.uuid, "total_bytes": self.total,
                "free_bytes": self.free, "others_bytes": self.others,
                "fleet": [{"server": s, "bytes": b} for s, b in sorted(self.held.items()) if s not in self.released],
                "freed": [{"server": s, "bytes": self.held[s]} for s in sorted(self.released) if s in self.held],
                "plan": [{"server": s, "bytes": b} for s, b in self.planned.items()],
                "free_after_bytes": self.after}


def picture(row: Mapping[str, Any]) -> str:
    """One GPU's row of a plan's `gpus` in words: `gpu-a GPU 1: 80.0 GiB, fleet 62.3 GiB (chat),
    others 1.1 GiB, this plan +14.0 GiB (code); 2.6 GiB free after this plan`."""
    fleet, freed, planned = row["fleet"], row["freed"], row["plan"]
    line = f"{row['node']} GPU {row['index']}: {gib(row['total_bytes'])}, fleet {gib(sum(f['bytes'] for f in fleet))}"
    line += f" ({', '.join(_cluster(f['server']) for f in fleet)})" if fleet else ""
    line += f", others {gib(row['others_bytes'])}"
    if planned:
        line += (f", this plan +{gib(sum(p['bytes'] for p in planned))} "
                 f"({', '.join(_cluster(p['server']) for p in planned)})")
    if freed:
        line += f", freed {gib(sum(f['bytes'] for f in freed))} ({', '.join(_cluster(f['server']) for f in freed)})"
    return line + f"; {gib(row['free_after_bytes'])} free after this plan"


def _cluster(sid: str) -> str:
    return sid.rpartition("@")[0] or sid


@dataclass(frozen=True, slots=True)
class Assigned:
    """The GPUs a server was given (None: it does not fit; `problem` says why, naming the GPUs)."""

    shares: list[GpuShare] | None
    problem: str = ""
    code: str = "insufficient_vram"


class Ledger:
    """The GPUs of every node that answered, built per node when first asked."""

    def __init__(self, nodes: Mapping[str, ObservedNode]) -> None:
        self.nodes = nodes
        self._gpus: dict[str, list[Gpu]] = {}
        # Nodes this plan reserves on or refuses, in the order it did: a refused one shows every GPU.
        self.touched: dict[str, bool] = {}
        self._written: list[Gpu] = []  # the GPUs given back or reserved on, for reset()

    def reset(self) -> None:
        """Every share given back and every reservation made undone, and the nodes touched
        forgotten: the ledger as the agents' figures alone make it, its GPUs still built (placement
        tries candidates on the plan's ledger, then hands it back so)."""
        for g in self._written:
            g.reset()
        self._written.clear()
        self.touched.clear()

    def gpus(self, node: str) -> list[Gpu]:
        got = self._gpus.get(node)
        if got is None:
            got = self._gpus[node] = _build(self.nodes[node]) if node in self.nodes else []
        return got

    def release(self, node: str, sid: str) -> None:
        """`sid`'s reservations on `node` given back (it is replaced or stopped by this plan)."""
        for g in self.gpus(node):
            if sid in g.held:
                g.release(sid)
                self._written.append(g)

    def assign(self, node: str, sid: str, need: int, n: int, pinned: tuple[int, ...] | None) -> Assigned:
        """`n` GPUs for server `sid` needing `need` bytes in all (need / n on each), best fit: the GPUs
        with the least memory left after this plan that still hold their share, ties by index; or
        exactly the `pinned` ones. Reserved in the ledger when they fit."""
        gpus = self.gpus(node)
        share = -(-need // max(1, n))
        if pinned:
            by_index = {g.index: g for g in gpus}
            missing = [i for i in pinned if i not in by_index]
            if missing:
                return Assigned(None, f"fleet.yaml pins GPU {', '.join(map(str, missing))} on {node!r}, which "
                                f"reports {len(gpus)} GPU(s) ({', '.join(str(g.index) for g in gpus)})",
                                "gpu_not_found")
            chosen = [by_index[i] for i in pinned]
            short = [g for g in chosen if g.after < share]
            if short:
                self.touched[node] = True
                return Assigned(None, f"the pinned GPU(s) {', '.join(str(g.index) for g in chosen)} need "
                                f"{gib(share)} each, but " + "; ".join(g.picture(node) for g in short))
        else:
            if n > len(gpus):
                self.touched[node] = True
                return Assigned(None, f"it asks for {n} GPUs together, but {node!r} reports {len(gpus)}",
                                "insufficient_gpus")
            if n == 1:  # the common case: the one best fit, in one pass, without sorting them all
                best: Gpu | None = None
                for g in gpus:
                    if g.after >= share and (best is None or g.after < best.after
                                             or (g.after == best.after and g.index < best.index)):
                        best = g
                fits = [best] if best is not None else []
            else:
                fits = sorted((g for g in gpus if g.after >= share), key=lambda g: (g.after, g.index))
            if len(fits) < n:
                self.touched[node] = True
                what = "no GPU" if n == 1 else f"only {len(fits)} of the {n} GPUs it needs"
                return Assigned(None, f"{what} of {node!r} {'has' if n == 1 else 'have'} {gib(share)}"
                                f"{' each' if n > 1 else ''} free after this plan: "
                                + "; ".join(g.picture(node) for g in gpus))
            chosen = fits if n == 1 else sorted(fits[:n], key=lambda g: g.index)
        for g in chosen:
            g.reserve(sid, share)
        self._written += chosen
        self.touched.setdefault(node, False)
        return Assigned([GpuShare(index=g.index, uuid=g.uuid, bytes=share) for g in chosen])

    def to_json(self) -> list[dict[str, Any]]:
        """The GPUs this plan reserves on or gives back, and every GPU of a node where it refused
        one: a plan of 10,000 starts on nodes of 8 GPUs carries 10,000 rows, not 80,000."""
        return [g.to_json(node) for node, every in self.touched.items() for g in self.gpus(node)
                if every or g.planned or (g.released and any(s in g.held for s in g.released))]

    def best_after(self, node: str) -> int:
        """The most any one GPU of `node` has free after this plan (0 without GPUs)."""
        return max((g.after for g in self.gpus(node)), default=0)


def _build(obs: ObservedNode) -> list[Gpu]:
    ids = obs.gpu_ids if len(obs.gpu_ids) == len(obs.gpus) else tuple((i, "") for i in range(len(obs.gpus)))
    held: dict[int, dict[str, int]] = {}
    for sid, srv in obs.servers.items():
        if srv.state in ACTIVE:
            for index, _uuid, b in srv.gpus:
                held.setdefault(index, {})[sid] = b
    return [Gpu(index, uuid, name, total, free, held.get(index, _NO_PLAN))  # held is only read
            for (name, free, total), (index, uuid) in zip(obs.gpus, ids)]
