"""The status page's data: what `fleet serve` knows about the fleet (the heartbeat's View, the
router's measurements, the state store's alerts and applies), as JSON values. Pure functions of
their arguments: the page's app (serve/ui/app.py) gathers them and these shape them.

Every text that came from an agent or a worker (a reason, a model's name, an error) is passed
through the router's scrubber first: the page shows no filesystem path a client answer would not.
At 10,000 nodes the overview summarises the whole fleet and lists one page of nodes (filtered by
name or status); clusters list their members' counts by state and the members that are not running
first, up to MEMBERS_SHOWN; a model's holders likewise."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wire.ids import server_id

from reconciler.core.desired import ClusterSpec, Desired
from reconciler.core.observed import ObservedNode
from reconciler.serve.heartbeat import View
from reconciler.serve.scrub import scrub_reason

PER_PAGE = 100  # nodes listed on one page of the overview
MAX_PER_PAGE = 500
CLUSTERS_SHOWN = 100  # cluster cards listed, those not wholly running first (every name is listed)
MEMBERS_SHOWN = 50  # a cluster's members, or a model's holders, listed (the rest counted)
ALERTS_SHOWN = 100
APPLIES_SHOWN = 20
STATUSES = ("online", "missed", "offline", "unknown")
_REPEATED = re.compile(r"(?:<path>){2,}")
JSON = dict[str, Any]


def node_paths(nodes: Iterable[ObservedNode | None]) -> list[str]:
    """What the router scrubs for these nodes: their stores' paths and their homes (Router.scrubber)."""
    paths: list[str] = []
    for seen in nodes:
        if seen is not None:
            paths += [w.path for w in seen.weights.values()] + [seen.home]
    return [p for p in paths if p and p != "/"]


def scrubbed(text: str | None, paths: list[str], replacement: str) -> str | None:
    """`text` as a client may see it (serve/scrub.scrub_reason), None kept None."""
    if not text:
        return text
    return _REPEATED.sub("<path>", scrub_reason(text, paths, replacement))  # a known path's tail is a path too


def node_status(view: View, name: str) -> str:
    """online: answered the last beat. missed: answered before, and has missed fewer beats than
    take it offline (the heartbeat keeps it online meanwhile). offline: as the router sees it (no
    request goes there). unknown: not asked yet."""
    if view.online.get(name, False):
        return "missed" if view.misses.get(name, 0) > 0 else "online"
    return "unknown" if name not in view.misses else "offline"


_BARS: dict[str, tuple[ObservedNode, list[JSON]]] = {}  # node → (the node object, its bars): a node unchanged
# between beats is the very same object (observe.py), and its bars are not worked out again


def gpu_bars(node: ObservedNode) -> list[JSON]:
    """Each GPU's memory: total, what fleet's servers reserve there (their `gpus` shares), what
    others use (used less fleet's), and free; as the agent's inventory reports them."""
    kept = _BARS.get(node.name)
    if kept is not None and kept[0] is node:
        return kept[1]
    bars = _gpu_bars(node)
    if len(_BARS) > 200_000:
        _BARS.clear()
    _BARS[node.name] = (node, bars)
    return bars


def _gpu_bars(node: ObservedNode) -> list[JSON]:
    state = node.state or {}
    listed = (state.get("inventory") or {}).get("gpus") or []
    ours: dict[int, int] = {}
    for s in state.get("servers") or []:
        if s.get("state") in ("stopped",):
            continue
        for share in s.get("gpus") or []:
            ours[int(share.get("index", -1))] = ours.get(int(share.get("index", -1)), 0) + int(share.get("bytes", 0))
    out = []
    for i, (name, free, total) in enumerate(node.gpus):
        index = int(listed[i].get("index", i)) if i < len(listed) and isinstance(listed[i], dict) else i
        fleet = min(ours.get(index, 0), max(total - free, 0))
        out.append({"index": index, "name": name, "total": total, "free": free, "fleet": fleet,
                    "others": max(total - free - fleet, 0)})
    return out


def node_json(d: Desired, view: View, name: str, names: Mapping[str, str]) -> JSON:
    """One node as the page lists it. `names`: model digest → the fleet file's name for it."""
    spec = d.nodes[name]
    seen = view.nodes.get(name)
    status = node_status(view, name)
    out: JSON = {"name": name, "address": spec.address, "status": status, "misses": view.misses.get(name, 0),
                 "labels": dict(spec.labels), "last_seen": None, "error": None}
    if seen is None:
        return out
    paths = node_paths([seen])
    state = seen.state or {}
    inv = state.get("inventory") or {}
    avail = state.get("availability") or {}
    cores, memory, disk = inv.get("cores") or {}, inv.get("memory") or {}, inv.get("disk") or {}
    integrity = {w.get("digest"): (w.get("integrity") or {}).get("state", "unverified")
                 for w in state.get("weights") or [] if isinstance(w, dict)}
    out.update({
        "last_seen": seen.observed_at, "agent_version": seen.agent_version, "accelerator": seen.accelerator,
        "simulated": seen.simulated,
        "availability": {"windows": list(seen.windows), "inside": seen.inside_window,
                         "ends_at": avail.get("current_ends_at"), "next_at": avail.get("next_starts_at")},
        "cores": {"logical": cores.get("logical"), "usable": cores.get("usable")},
        "memory": {"total": memory.get("total_bytes"), "available": memory.get("available_bytes")},
        "disk": {"total": disk.get("total_bytes"), "free": seen.disk_free, "reserve": seen.disk_reserve},
        "gpus": gpu_bars(seen),
        "holds": [{"digest": w.digest, "model": names.get(w.slice_of or w.digest) or scrubbed(w.name, paths, "<path>"),
                   "format": w.format, "bytes": w.bytes, "layers": w.layers, "whole": w.slice_of is None,
                   "verification": "corrupt" if w.corrupt else integrity.get(w.digest, "unverified"),
                   "corrupt": scrubbed(w.corrupt, paths, "<path>"), "key_missing": w.key_missing}
                  for w in sorted(seen.weights.values(), key=lambda w: (w.name, w.digest))],
        "runs": [{"id": s.id, "state": s.state, "model": names.get(s.model, s.model), "port": s.port,
                  "reason": scrubbed(s.reason, paths, s.id.partition("@")[0])}
                 for s in sorted(seen.servers.values(), key=lambda s: s.id)],
        "fetches": fetches(seen, names, paths),
    })
    if not seen.ok or status != "online":
        out["error"] = scrubbed(f"{seen.error_code}: {seen.error}" if seen.error_code else None, paths, "<path>")
    return out


def fetches(node: ObservedNode, names: Mapping[str, str], paths: list[str]) -> list[JSON]:
    state = node.state or {}
    return [{"node": node.name, "digest": f.get("digest"), "model": names.get(str(f.get("digest")), ""),
             "state": f.get("state", "fetching"), "peer": f.get("peer"), "layers": f.get("layers"),
             "bytes_total": int(f.get("bytes_total") or 0), "bytes_done": int(f.get("bytes_done") or 0),
             "rate": int(f.get("rate_bytes_per_s") or 0), "error": scrubbed(f.get("error"), paths, "<path>")}
            for f in state.get("fetches") or [] if isinstance(f, dict)]


def member_state(view: View, c: ClusterSpec, node: str, digest: str) -> tuple[str, str | None]:
    """A member's state and reason, as the heartbeat's server rows say it (Heartbeat.reconcile_rows),
    with `drained` for a member an apply took out of routing."""
    sid = server_id(c.name, node)
    if not view.online.get(node, False):
        return "node_offline", f"node {node} is offline" if node in view.misses else f"node {node} not asked yet"
    seen = view.nodes[node]
    server = seen.servers.get(sid)
    if server is None:
        return "missing", f"{node} reports no server {sid} (not applied yet?)"
    if sid in view.draining:
        return "drained", f"{node}: draining for an apply"
    if server.model != digest and c.pipeline is None:
        return "drifted", f"{node} runs {sid} with another model"
    return server.state, server.reason


@dataclass
class Traffic:
    """A cluster's traffic over the window the page's sampler keeps (Sampler.traffic)."""

    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    errors_per_s: float = 0.0
    p50_s: float | None = None
    p99_s: float | None = None
    requests: int = 0  # since fleet serve started
    window_s: float = 0.0


def cluster_json(d: Desired, view: View, c: ClusterSpec, traffic: Traffic | None) -> JSON:
    digest = d.models[c.model].digest
    paths: list[str] | None = None  # the members' paths, gathered only when a reason needs scrubbing
    members = []
    counts: dict[str, int] = {}
    named = view.members(d, c)
    for i, node in enumerate(named):
        state, reason = member_state(view, c, node, digest)
        counts[state] = counts.get(state, 0) + 1
        # Only a server's own reason is the agent's words (the others are the heartbeat's own).
        agents = state not in ("node_offline", "missing", "drained", "drifted")
        if reason and agents and paths is None:
            paths = node_paths(view.nodes.get(n) for n in named)
        members.append((state == "running", i, {"node": node, "state": state,
                                                "reason": scrubbed(reason, paths or [], c.name) if agents else reason,
                                                "id": server_id(c.name, node)}))
    shown = [m for _, _, m in sorted(members, key=lambda m: m[:2])[:MEMBERS_SHOWN]]
    t = traffic or Traffic()
    return {"name": c.name, "model": c.model, "port": c.port, "pipeline": c.pipeline is not None,
            "members_total": len(named), "states": counts, "members": shown,
            "serving": counts.get("running", 0) > 0 if c.pipeline is None else counts.get("running", 0) == len(named),
            "traffic": {"requests_per_s": round(t.requests_per_s, 3), "tokens_per_s": round(t.tokens_per_s, 3),
                        "errors_per_s": round(t.errors_per_s, 3), "p50_s": t.p50_s, "p99_s": t.p99_s,
                        "requests": t.requests, "window_s": round(t.window_s, 1)}}


def clusters_json(d: Desired, view: View, traffic: Mapping[str, Traffic]) -> list[JSON]:
    """Every cluster whose members are not all running, then the others, in file order; the first
    CLUSTERS_SHOWN of them (a 10,000-node fleet's 1,000 clusters were 1.1 MB of JSON)."""
    out = [cluster_json(d, view, c, traffic.get(c.name)) for c in d.clusters.values()]
    out.sort(key=lambda c: c["states"].get("running", 0) == c["members_total"])
    return out[:CLUSTERS_SHOWN]


def weights_json(d: Desired, view: View, names: Mapping[str, str]) -> JSON:
    """Which node holds which model (whole or which layers) with its verification, and every
    replication under way with its bytes and rate."""
    models: dict[str, JSON] = {}
    for m in d.models.values():
        models[m.digest] = {"name": m.name, "digest": m.digest, "format": m.format, "holders_total": 0,
                            "corrupt": 0, "holders": []}
    moving: list[JSON] = []
    for name in d.nodes:
        seen = view.nodes.get(name)
        if seen is None:
            continue
        paths = node_paths([seen]) if seen.fetching or any(w.corrupt for w in seen.weights.values()) else []
        verified: dict[str, str] | None = None  # read from the state only for a holder listed
        for w in seen.weights.values():
            whole = w.slice_of or w.digest
            entry = models.get(whole)
            if entry is None:  # held, but not a model of the fleet file
                entry = models[whole] = {"name": scrubbed(w.name, paths, "<path>") or whole[:19], "digest": whole,
                                         "format": w.format, "holders_total": 0, "corrupt": 0, "holders": [],
                                         "undeclared": True}
            entry["holders_total"] += 1
            entry["corrupt"] += 1 if w.corrupt else 0
            if len(entry["holders"]) < MEMBERS_SHOWN or w.corrupt:
                if verified is None:
                    verified = {str(h.get("digest")): (h.get("integrity") or {}).get("state", "unverified")
                                for h in (seen.state or {}).get("weights") or [] if isinstance(h, dict)}
                entry["holders"].append({"node": name, "layers": w.layers if w.slice_of else None,
                                         "verification": "corrupt" if w.corrupt else verified.get(w.digest, "unverified"),
                                         "corrupt": scrubbed(w.corrupt, paths, "<path>"),
                                         "key_missing": w.key_missing, "bytes": w.bytes})
        if (seen.state or {}).get("fetches"):
            moving += fetches(seen, names, paths or node_paths([seen]))
    for entry in models.values():
        entry["holders"].sort(key=lambda h: (h["verification"] != "corrupt", h["node"]))
        del entry["holders"][MEMBERS_SHOWN:]
    return {"models": sorted(models.values(), key=lambda m: m["name"]), "replications": moving[:MEMBERS_SHOWN * 4],
            "replications_total": len(moving)}


def summary(d: Desired, view: View, alerts: Sequence[JSON], open_alerts: int | None = None) -> JSON:
    """The whole fleet in counts, however many nodes it has."""
    statuses = {s: 0 for s in STATUSES}
    servers: dict[str, int] = {}
    gpu = {"count": 0, "total": 0, "fleet": 0, "others": 0, "free": 0}
    for name in d.nodes:
        statuses[node_status(view, name)] += 1
        seen = view.nodes.get(name)
        if seen is None:
            continue
        for s in seen.servers.values():
            servers[s.state] = servers.get(s.state, 0) + 1
        for bar in gpu_bars(seen) if seen.gpus else ():
            gpu["count"] += 1
            for k in ("total", "fleet", "others", "free"):
                gpu[k] += bar[k]
    shown_open = sum(1 for a in alerts if a.get("cleared_at") is None)
    return {"nodes": len(d.nodes), "statuses": statuses, "servers": servers, "gpus": gpu, "clusters": len(d.clusters),
            "alerts_open": shown_open if open_alerts is None else open_alerts,
            "drift": view.plan is not None and bool(view.plan.changes),
            "drift_summary": view.plan.summary() if view.plan is not None and view.plan.changes else None,
            "beats": view.beats}


def matches(view: View, name: str, query: str, status: str) -> bool:
    return (not query or query in name) and (not status or node_status(view, name) == status)


def overview(d: Desired, view: View, *, alerts: Sequence[JSON] = (), applies: Sequence[JSON] = (),
             traffic: Mapping[str, Traffic] | None = None, page: int = 0, per_page: int = PER_PAGE,
             query: str = "", status: str = "", open_alerts: int | None = None) -> JSON:
    """The page's whole view: a summary of the fleet, one page of nodes (those matching `query`, a
    part of the name, and `status`; offline and missed first), every cluster, alerts (open first),
    the latest applies and the weights."""
    names = {m.digest: m.name for m in d.models.values()}
    per_page = max(1, min(per_page, MAX_PER_PAGE))
    rank = {"offline": 0, "missed": 1, "unknown": 2, "online": 3}
    picked = sorted((n for n in d.nodes if matches(view, n, query, status)),
                    key=lambda n: (rank[node_status(view, n)], n))
    pages = max(1, math.ceil(len(picked) / per_page))
    page = max(0, min(page, pages - 1))
    shown = picked[page * per_page:(page + 1) * per_page]
    return {
        "summary": summary(d, view, alerts, open_alerts),
        "nodes": {"total": len(picked), "page": page, "pages": pages, "per_page": per_page, "query": query,
                  "status": status, "items": [node_json(d, view, n, names) for n in shown]},
        "clusters": clusters_json(d, view, traffic or {}),
        "clusters_total": len(d.clusters),
        "cluster_names": [{"name": c.name, "model": c.model} for c in d.clusters.values()],
        "alerts": alerts_json(alerts, view),
        "applies": list(applies[:APPLIES_SHOWN]),
        "weights": weights_json(d, view, names),
    }


def alerts_json(alerts: Sequence[JSON], view: View) -> list[JSON]:
    """Open alerts first (newest first), then the cleared ones, newest first; ALERTS_SHOWN of them,
    each cause scrubbed of its node's paths (and every other path)."""
    ordered = sorted(alerts, key=lambda a: (a.get("cleared_at") is not None, -int(a.get("id") or 0)))
    return [{**a, "cause": scrubbed(a.get("cause"), node_paths([view.nodes.get(str(a.get("node")))]), "<path>")}
            for a in ordered[:ALERTS_SHOWN]]


def apply_json(row: Sequence[Any], results: Sequence[Mapping[str, Any]]) -> JSON:
    """A row of the store's `applies` (id, started, finished, config_digest, summary; its results
    parsed): when, what, and its outcome (actions done, failed and skipped, the failures' words).
    The store does not record who applied."""
    failed = [r for r in results if r.get("status") == "failed"]
    skipped = sum(1 for r in results if r.get("status") == "skipped")
    return {"id": row[0], "started": row[1], "finished": row[2], "config_digest": row[3], "summary": row[4],
            "actions": len(results), "failed": len(failed), "skipped": skipped,
            "outcome": "failed" if failed else "done",
            "failures": [{"address": r.get("address"), "action": r.get("action"), "code": r.get("code"),
                          "message": scrub_reason(str(r.get("message") or ""), [], "<path>")}
                         for r in failed[:10]]}


# ---- the router's measurements, as rates over a window ----

def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram's cumulative buckets [(upper bound, count), ..., (inf, count)],
    interpolated within a bucket as Prometheus' histogram_quantile does; None with no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


@dataclass(frozen=True)
class Sample:
    """The router's counters at one moment, per cluster: requests, failed requests (5xx),
    completion tokens and the latency histogram's cumulative buckets."""

    at: float
    requests: Mapping[str, float]
    errors: Mapping[str, float]
    tokens: Mapping[str, float]
    latency: Mapping[str, tuple[tuple[float, float], ...]]


@dataclass
class Sampler:
    """Keeps samples `window_s` apart at most (the oldest kept is at most two windows old), and
    turns the newest and the oldest into each cluster's rates and latency over that span."""

    window_s: float = 60.0
    samples: list[Sample] = field(default_factory=list)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        while len(self.samples) > 2 and sample.at - self.samples[1].at >= self.window_s:
            self.samples.pop(0)

    def traffic(self) -> dict[str, Traffic]:
        if not self.samples:
            return {}
        new, old = self.samples[-1], self.samples[0]
        span = new.at - old.at
        out = {}
        for cluster in set(new.requests) | set(new.latency):
            t = Traffic(requests=int(new.requests.get(cluster, 0)), window_s=span)
            if span > 0:
                t.requests_per_s = (new.requests.get(cluster, 0) - old.requests.get(cluster, 0)) / span
                t.errors_per_s = (new.errors.get(cluster, 0) - old.errors.get(cluster, 0)) / span
                t.tokens_per_s = (new.tokens.get(cluster, 0) - old.tokens.get(cluster, 0)) / span
            now, then = new.latency.get(cluster, ()), dict(old.latency.get(cluster, ()))
            recent = tuple((b, c - then.get(b, 0)) for b, c in now) if span > 0 else now
            if not recent or recent[-1][1] <= 0:
                recent = now  # nothing in the window: since fleet serve started
            t.p50_s, t.p99_s = quantile(0.5, recent), quantile(0.99, recent)
            out[cluster] = t
        return out


# ---- the same view as Prometheus metrics (examples/prometheus/alerts.yml alerts on them) ----

class ViewCollector(Collector):
    """Gauges computed from the view when /metrics is scraped: each cluster's members by state,
    every corrupt copy of a model, and every replication under way with its bytes and rate.
    Registered on ServeMetrics' registry by serve/run.py."""

    def __init__(self, d: Desired, view: View) -> None:
        self.d, self.view = d, view

    def collect(self) -> Iterator[Metric]:
        members = GaugeMetricFamily("fleet_cluster_members", "Cluster members by state, as the heartbeat saw them "
                                    "(running, starting, failed, node_offline, missing, drained, drifted, ...)",
                                    labels=["cluster", "state"])
        for c in self.d.clusters.values():
            digest = self.d.models[c.model].digest
            counts: dict[str, int] = {"running": 0, "failed": 0}
            for node in self.view.members(self.d, c):
                state, _ = member_state(self.view, c, node, digest)
                counts[state] = counts.get(state, 0) + 1
            for state, n in sorted(counts.items()):
                members.add_metric([c.name, state], n)
        names = {m.digest: m.name for m in self.d.models.values()}
        corrupt = GaugeMetricFamily("fleet_weights_corrupt", "1 for each copy of a model its agent's verification "
                                    "found corrupt", labels=["node", "model"])
        done = GaugeMetricFamily("fleet_replication_bytes_done", "Bytes a replication under way has on disk",
                                 labels=["node", "model"])
        total = GaugeMetricFamily("fleet_replication_bytes_total", "Bytes a replication under way fetches in all",
                                  labels=["node", "model"])
        rate = GaugeMetricFamily("fleet_replication_rate_bytes_per_second", "A replication's rate as its agent "
                                 "measures it", labels=["node", "model"])
        for name in self.d.nodes:
            seen = self.view.nodes.get(name)
            if seen is None:
                continue
            for w in seen.weights.values():
                if w.corrupt:
                    corrupt.add_metric([name, names.get(w.slice_of or w.digest, w.digest)], 1)
            for f in fetches(seen, names, []):
                if f["state"] != "fetching":
                    continue
                label = [name, f["model"] or str(f["digest"])]
                done.add_metric(label, f["bytes_done"])
                total.add_metric(label, f["bytes_total"])
                rate.add_metric(label, f["rate"])
        yield from (members, corrupt, done, total, rate)
