"""Golden planner cases: fleet.yaml + a compact observed.yaml → the plan, as readable lines.

observed.yaml names models by their fleet.yaml name; this module expands it into the snapshot
that `fleet observe -o` writes (agent states), so each case stays short enough to review."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import yaml

from reconciler.fleetfile import config
from reconciler.core.observed import from_snapshot
from reconciler.planning.plan import Plan
from reconciler.planning.planner import plan
from wire import manifest as mf
from wire.layers import LayerRange

CASES = Path(__file__).parent / "cases"
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)$")


def size(v: Any) -> int:
    if isinstance(v, int):
        return v
    m = _SIZE.match(str(v))
    assert m, f"bad size {v!r}"
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


def synthetic_manifest(layers: int) -> dict[str, Any]:
    """A full safetensors manifest with a realistic tensor index (fake hashes), for slicing."""
    tensors, pos = [], 8 + 1000

    def add(name: str, n: int) -> None:
        nonlocal pos
        tensors.append({"name": name, "dtype": "F32", "shape": [n // 4], "begin": pos, "end": pos + n,
                        "sha256": f"{len(tensors):064x}"})
        pos += n
    add("model.embed_tokens.weight", 4000)
    for i in range(layers):
        add(f"model.layers.{i}.self_attn.q_proj.weight", 8000)
        add(f"model.layers.{i}.mlp.up_proj.weight", 16000)
    add("model.norm.weight", 400)
    add("lm_head.weight", 4000)
    return {"version": 1, "format": "safetensors", "layers": layers, "slice": None, "files": [
        {"path": "config.json", "size": 600, "sha256": "c" * 64},
        {"path": "model.safetensors", "size": pos, "sha256": "d" * 64, "tensors": tensors},
        {"path": "tokenizer.json", "size": 9000, "sha256": "e" * 64}]}


def snapshot(fleet: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    models = fleet.get("models", {})
    manifests = {m["digest"]: synthetic_manifest(m["layers"]) for m in models.values() if m.get("layers")}
    nodes: dict[str, Any] = {}
    for name, n in (spec.get("nodes") or {}).items():
        n = n or {}
        if "error" in n:
            nodes[name] = {"state": None, "error": {"code": n["error"], "message": f"{n['error']}: {name}"}}
            continue
        weights = []
        for w in n.get("weights", []):
            w = {"model": w} if isinstance(w, str) else w
            m = models[w["model"]]
            entry = {"digest": m["digest"], "format": m["format"], "bytes": size(w.get("bytes", "1G")),
                     "slice": None}
            if "layers" in w:
                sliced = mf.make_slice(manifests[m["digest"]], m["digest"], LayerRange.parse(w["layers"]))
                entry.update(digest=mf.digest_of(sliced), slice=sliced["slice"])
            if "digest" in w:
                entry["digest"] = w["digest"]
            if "key" in w:  # an encrypted model: {key_id, key_held}, as its agent reports it
                entry["encryption"] = {"cipher": "aes-256-gcm", **w["key"]}
            if "corrupt" in w:  # {file, reason}: what the agent's verification found
                entry["integrity"] = {"state": "corrupt", "checked_at": "2026-11-30T11:00:00+00:00", **w["corrupt"]}
            if "architecture" in w:  # {layers, kv_heads, head_dim, kv_dtype_bytes}, as an agent may report it
                entry["architecture"] = w["architecture"]
            weights.append(entry)
        servers = [{"id": s["id"], "state": s.get("state", "running"), "model": models[s["model"]]["digest"]
                    if s["model"] in models else s["model"], "port": s["port"], "settings": s.get("settings", {}),
                    "reason": s.get("reason"),
                    # [{index, bytes}]: the GPUs its agent gave it and what it reserved on each
                    **({"gpus": [{"index": g["index"], "uuid": f"GPU-{g['index']}", "bytes": size(g["bytes"])}
                                 for g in s["gpus"]]} if "gpus" in s else {})} for s in n.get("servers", [])]
        for server, s in zip(servers, n.get("servers", [])):
            if "layers" in s:  # a pipeline stage: it serves its slice, in its group
                m = models[s["model"]]
                server["model"] = mf.digest_of(mf.make_slice(manifests[m["digest"]], m["digest"],
                                                             LayerRange.parse(s["layers"])))
                server["pipeline"] = {"group": s.get("group", "0" * 16), "rank": s.get("rank", 0),
                                      "world_size": s.get("world_size", 1)}
        nodes[name] = {"state": {
            "identity": {"id": n.get("identity", "0" * 32), "name": n.get("name", name), "enrolled_at": "2026-01-01T00:00:00Z"},
            "agent_version": "test", "variant": {"accelerator": "cpu", **({"findings": n["findings"]} if "findings" in n
                                                                         else {})}, "observed_at": n.get("time", "2026-11-30T12:00:00+00:00"),
            "inventory": {"cores": {"logical": 8, "usable": n.get("cores", 8)},
                          "memory": {"total_bytes": size(n.get("memory", 1)), "available_bytes": size(n.get("memory", 1))},
                          "disk": {"free_bytes": size(n.get("disk_free", "1T")), "total_bytes": size("2T"),
                                   "reserve_bytes": size(n.get("disk_reserve", 0))},
                          # a GPU: its size (all of it free), or {total, free} as NVML reports them
                          "gpus": [{"index": i, "name": "GPU", "uuid": f"GPU-{i}",
                                    "memory_total_bytes": size(g["total"] if isinstance(g, dict) else g),
                                    "memory_free_bytes": size(g["free"] if isinstance(g, dict) else g)}
                                   for i, g in enumerate(n.get("gpus", []))],
                          "simulated": True},
            "availability": {"inside": n.get("inside_window", True), "windows": n.get("windows", []),
                             "current_ends_at": n.get("window_ends_at")},
            # {peer: HOST:PORT, bytes_per_s, samples}: what the agent measured on its recent fetches
            **({"link_rates": n["link_rates"]} if "link_rates" in n else {}),
            "weights": weights, "fetches": [{"digest": models[f]["digest"]} for f in n.get("fetching", [])],
            "servers": servers}}
    return {"format_version": "1.0", "nodes": nodes, "manifests": manifests}


def run_case(case: Path) -> Plan:
    loaded = config.load(case / "fleet.yaml")
    assert loaded.ok and loaded.desired, [d.summary for d in loaded.diagnostics]
    spec = yaml.safe_load((case / "observed.yaml").read_text()) or {}
    snap = snapshot(loaded.document.data, spec)  # type: ignore[union-attr]
    desired = loaded.desired
    planned_groups(snap, lambda s: plan(desired, from_snapshot(s)))
    return plan(desired, from_snapshot(snap), targets=tuple(spec.get("targets", ())))


def planned_groups(snap: dict[str, Any], make: Callable[[dict[str, Any]], Plan]) -> None:
    """A stage observed with `group: planned` is in the group this fleet.yaml plans (its id is a
    digest of slices and settings, too long to keep by hand): found by planning without them."""
    stages = [s for n in snap["nodes"].values() if n["state"] for s in n["state"]["servers"]
              if s.get("pipeline", {}).get("group") == "planned"]
    if not stages:
        return
    bare = {**snap, "nodes": {name: n if not n["state"] else {**n, "state": {**n["state"], "servers": [
        s for s in n["state"]["servers"] if s not in stages]}} for name, n in snap["nodes"].items()}}
    groups = {c.details["cluster"]: c.details["pipeline"]["group"] for c in make(bare).changes
              if "pipeline" in c.details}
    for s in stages:
        s["pipeline"]["group"] = groups[s["id"].partition("@")[0]]


# Codes whose words are part of the case: they name the GPUs, what holds them and what is short.
SAID = {"insufficient_vram", "insufficient_gpus", "gpu_not_found", "placement_failed", "identity_of_another_node"}


def render_lines(p: Plan) -> dict[str, Any]:
    changes = []
    for c in p.changes:
        line = f"{c.action.value} {c.address}"
        if "peer" in c.details:  # a replicate, or the replace of a corrupt replica
            line += f" from {c.details['peer']}"
        if c.details.get("gpus"):
            line += " on GPU " + ",".join(str(g["index"]) for g in c.details["gpus"])
            line += f" ({c.details['gpus'][0]['bytes'] / 2**30:.1f} GiB each)"
        if c.depends_on:
            line += " after " + ", ".join(c.depends_on)
        changes.append(f"{line} -- {c.reason}")
    out: dict[str, Any] = {"changes": changes, "diagnostics": [
        f"{d.severity.value} {d.code} {d.address}" + (f": {d.summary}" if d.code in SAID else "")
        for d in p.diagnostics]}
    if p.gpus:
        from reconciler.cli.render import gpu_lines
        out["gpus"] = gpu_lines(p)
    return out
