"""The agent's HTTP routes: one handler per route, each a thin reading of the AgentContext it was
given; every refusal answers {"error": {"code", "message"}} with a stable code."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, Sequence

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wire import live
from wire import manifest as mf
from wire.layers import LayerRange, LayerRangeError
from wire.state import GpuJson, ServerEntry
from wire.windows import status

from agent.transfer.blobs import BlobResponse
from agent.transfer.forward import PartialBlobResponse
from agent.weights.store import StoreError
from agent.serving.supervisor import HOLDING, RequestRefused, check_settings

if TYPE_CHECKING:
    from agent.api.context import AgentContext

# \Z, not $: under re.match `$` also matches before a final newline.
PEER_URL = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}/?\Z")
# The name a peer's certificate is checked against (its fleet.yaml hostname): a host name or address,
# nothing that could change what the TLS handshake sends.
PEER_HOSTNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,253}\Z")

ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


def _corrupt(ctx: AgentContext, digest: str) -> bool:
    integrity = ctx.store.entry(digest).get("integrity")
    return integrity is not None and integrity["state"] == "corrupt"


def outside_window(ctx: AgentContext) -> JSONResponse | None:
    """New work (a fetch, a start) refused outside the node's availability window, whoever asks: the
    planner refuses it too, but a plan made inside a window can be applied after it closed."""
    now = ctx.clock()
    avail = status(ctx.windows, now)
    if avail["inside"]:
        return None
    return error_response(409, "outside_availability_window",
                          f"{ctx.identity.name} is outside its availability window ({', '.join(avail['windows'])}) "
                          f"at its local time {now:%H:%M}; no new work starts before {avail['next_starts_at']}")


def past_window(ctx: AgentContext, peer: str, nbytes: object) -> JSONResponse | None:
    """A fetch of `nbytes` (the plan's figure, when the asker gives it) that would end after the
    window the node is in closes, at the rate this agent measured from `peer`: refused before it
    starts, as the planner refuses it, for a plan applied later than it was made."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        return None
    seconds = ctx.fetcher.rates.seconds_for(peer, nbytes)
    now = ctx.clock()
    ends = status(ctx.windows, now)["current_ends_at"]
    if seconds is None or ends is None or now + timedelta(seconds=seconds) <= datetime.fromisoformat(ends):
        return None
    return error_response(409, "replication_exceeds_window",
                          f"fetching {nbytes:,} bytes from {peer} takes ~{seconds:.0f} s at the rate {ctx.identity.name} "
                          f"measured, ending {now + timedelta(seconds=seconds):%H:%M}, after its availability window "
                          f"({', '.join(str(w) for w in ctx.windows)}) closes at {datetime.fromisoformat(ends):%H:%M}")


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def digest_param(request: Request) -> str:
    """The {digest} of the path, checked before it names anything on disk (ManifestError: 400)."""
    digest = request.path_params["digest"]
    mf.check_digest(digest)
    return str(digest)


async def _json_object(request: Request, hint: str) -> dict[str, Any] | JSONResponse:
    try:
        body = await request.json()
    except ValueError:
        return error_response(400, "bad_request", f"the body must be JSON{hint}")
    except RecursionError:  # json's decoder recurses per level: 100,000 brackets end here, not in a 500
        return error_response(400, "bad_request", f"the body is nested too deeply to be read; it must be JSON{hint}")
    if not isinstance(body, dict):
        return error_response(400, "bad_request", "the body must be a JSON object")
    return body


class Weights:
    """/v1/manifests, /v1/blobs and /v1/weights: what this node holds, serves to peers, and fetches."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    async def manifest(self, request: Request) -> Response:
        digest = digest_param(request)
        try:
            held = self.ctx.store.manifest_bytes(digest)
            if json.loads(held).get("encryption") is not None:
                return error_response(403, "encrypted_not_served", f"{digest} is encrypted at rest on node "
                                      f"{self.ctx.identity.name!r}: encrypted weights never leave the node that holds "
                                      "their key, so no peer is served its manifest or its files")
            return Response(held, media_type="application/json")
        except StoreError as exc:
            fetching = self.ctx.fetcher.manifest_of(digest)  # a chain: served while it is fetched here
            if fetching is not None:
                return Response(fetching, media_type="application/json")
            job = self.ctx.fetcher.jobs.get(digest)
            if job is not None and job.state == "failed":  # a peer chained from here stops waiting at once
                return error_response(409, "peer_fetch_failed", f"node {self.ctx.fetcher.node!r} could not fetch "
                                      f"{digest} itself: {job.error}")
            return error_response(404, "weights_not_held", str(exc))

    async def blob(self, request: Request) -> Response:
        sha = request.path_params["sha"]
        path = self.ctx.store.blob_path(sha)  # validates: 64 hex digits, nothing else reaches the disk
        if not path.is_file():
            partial = self.ctx.fetcher.partials.get(sha)  # being fetched: its verified pieces are served
            if partial is not None:
                return PartialBlobResponse(partial, request.headers.get("range"))
            return error_response(404, "blob_not_held", f"blob {sha} is not held here")
        return BlobResponse(path, request.headers.get("range"))

    async def put(self, request: Request) -> Response:
        digest = digest_param(request)
        body = await _json_object(request, ': {"peer": URL, ...}')
        if isinstance(body, JSONResponse):
            return body
        if self.ctx.store.is_present(digest) and not _corrupt(self.ctx, digest):
            return JSONResponse({"digest": digest, "state": "present"})  # a corrupt copy is fetched again
        if (refused := outside_window(self.ctx)) is not None:
            return refused
        peer = body.get("peer")
        if not isinstance(peer, str) or not PEER_URL.match(peer):
            return error_response(400, "bad_peer", "peer must be an agent URL such as http://10.0.0.2:7070")
        if (refused := past_window(self.ctx, peer, body.get("bytes"))) is not None:
            return refused
        peer_hostname = body.get("peer_hostname")
        if peer_hostname is not None and (not isinstance(peer_hostname, str) or not PEER_HOSTNAME.match(peer_hostname)):
            return error_response(400, "bad_peer", "peer_hostname must be the peer's host name, such as node-a.example")
        name = body.get("name", "")
        if not isinstance(name, str) or len(name) > 256 or "\x00" in name:
            return error_response(400, "bad_request", "name must be a string of at most 256 characters")
        layers, source, rng = body.get("layers"), body.get("source_digest"), None
        if layers is not None:
            if not isinstance(layers, str):
                return error_response(400, "bad_layers", "layers must be a string FIRST-LAST")
            try:
                rng = LayerRange.parse(layers)
            except LayerRangeError as exc:
                return error_response(400, "bad_request", str(exc))
            if not isinstance(source, str):
                return error_response(400, "bad_request", "a slice needs source_digest: the full model's digest")
            mf.check_digest(source)
        job = self.ctx.fetcher.request(digest, peer, name, source, rng, peer_hostname)
        return JSONResponse(job.to_json(), status_code=202)

    async def get(self, request: Request) -> Response:
        digest = digest_param(request)
        job = self.ctx.fetcher.jobs.get(digest)
        # A held model fetched again because it was found corrupt: the fetch answers until it ends.
        if self.ctx.store.is_present(digest) and (job is None or job.state != "fetching"):
            entry = self.ctx.store.entry(digest)
            if not _corrupt(self.ctx, digest):
                # The finished fetch, if this agent ran one, says how many bytes crossed the wire.
                return JSONResponse({**entry, "state": "present", "fetch": job.to_json() if job is not None else None})
            if job is None or job.state != "failed":
                return JSONResponse({**entry, "state": "corrupt"})
        if job is not None:
            return JSONResponse(job.to_json())
        return JSONResponse({"digest": digest, "state": "absent"}, status_code=404)

    async def verify(self, request: Request) -> Response:
        """Re-hash a held model now (after a verification already running) and answer what was found."""
        digest = digest_param(request)
        if self.ctx.verifier is None:
            return error_response(409, "verify_unsupported", "this agent holds no bytes to verify (simulated)")
        try:
            integrity = await self.ctx.verifier.verify(digest)
        except StoreError as exc:
            return error_response(404, "weights_not_held", str(exc))
        return JSONResponse({"digest": digest, "integrity": integrity})

    async def delete(self, request: Request) -> Response:
        digest = digest_param(request)
        job = self.ctx.fetcher.jobs.get(digest)
        if job is not None and job.state == "fetching":
            return error_response(409, "weights_busy", f"{digest} is being fetched; wait for the fetch to end")
        user = self.ctx.workers.using(digest)
        if user is not None:
            return error_response(409, "weights_in_use", f"{digest} is used by server {user}; stop it first")
        not_held = None
        try:
            self.ctx.store.delete(digest)
        except StoreError as exc:
            not_held = str(exc)
        # What a failed fetch kept for a resume goes too: nothing else would ever remove it.
        partial_bytes = self.ctx.fetcher.discard(digest)
        if not_held is not None and partial_bytes is None:
            return error_response(404, "weights_not_held", not_held)
        self.ctx.fetcher.jobs.pop(digest, None)
        return JSONResponse({"digest": digest, "state": "deleted", "partial_bytes_removed": partial_bytes or 0})


class Servers:
    """/v1/servers: start, list, read and stop the servers this node runs."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    async def post(self, request: Request) -> Response:
        body = await _json_object(request, "")
        if isinstance(body, JSONResponse):
            return body
        if isinstance(body.get("model"), str):
            mf.check_digest(body["model"])
        if (refused := outside_window(self.ctx)) is not None:
            return refused
        check_settings(body.get("settings"))  # what a plan's start may carry (schemas/plan.schema.json)
        server = self.ctx.workers.start(body, [g.to_json() for g in self.ctx.gpu_probe.gpus()])  # as they are now
        # A few turns of the scheduler for its supervision's first steps: a server that answers its
        # health check at once (a simulated one) is then running in this answer, and fleet apply
        # needs no poll for it. No time passes: a real engine is still starting here.
        for _ in range(5):
            if server.state != "starting":
                break
            await trio.lowlevel.checkpoint()
        return JSONResponse(server.to_json(), status_code=202)

    async def list(self, _: Request) -> Response:
        present = [g.to_json() for g in self.ctx.gpu_probe.gpus()]
        return JSONResponse({"servers": [with_gpus_gone(s.to_json(), present, self.ctx.gpu_probe.source)
                                         for s in self.ctx.workers.servers.values()]})

    async def get(self, request: Request) -> Response:
        server = self.ctx.workers.servers.get(request.path_params["sid"])
        if server is None:
            return error_response(404, "server_not_found", f"no server {request.path_params['sid']} on this node")
        present = [g.to_json() for g in self.ctx.gpu_probe.gpus()]
        return JSONResponse(with_gpus_gone(server.to_json(), present, self.ctx.gpu_probe.source))

    async def delete(self, request: Request) -> Response:
        server = await self.ctx.workers.stop(request.path_params["sid"])
        return JSONResponse(server.to_json())


def with_gpus_gone(entry: ServerEntry, present: Sequence[GpuJson], source: str) -> ServerEntry:
    """A server's entry, its reason saying which of its GPUs the node no longer reports (removed,
    fallen off the bus): the server is reported as it is, and the plan sees why it may not serve."""
    have = {g["uuid"] for g in present}
    gone = [g for g in entry.get("gpus") or [] if g["uuid"] not in have]
    if not gone or entry["state"] not in HOLDING:
        return entry
    words = ", ".join(f"GPU {g['index']} ({g['uuid']})" for g in gone)
    said = f"{words} given to this server {'is' if len(gone) == 1 else 'are'} no longer reported by {source}"
    return {**entry, "reason": f"{said}; {entry['reason']}" if entry.get("reason") else said}


class Node:
    """/healthz, /v1/state and /metrics: the node as a whole."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.registry = CollectorRegistry()
        self.registry.register(AgentCollector(ctx))

    async def healthz(self, _: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def state(self, request: Request) -> Response:
        state = self.ctx.state()
        state["servers"] = [with_gpus_gone(s, state["inventory"]["gpus"], state["inventory"]["gpu_source"])
                            for s in state["servers"]]
        tag = self.ctx.generations(state)
        etag = f'"{tag}"'
        # The control plane asks again with the generation it holds: unchanged, it gets no body,
        # only the values a generation leaves out (wire/live.py), so what it holds is brought up to now.
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"etag": etag, live.HEADER: live.encode(state)})
        return JSONResponse({**state, "generation": tag}, headers={"etag": etag})

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")


class AgentCollector:
    """Read at scrape time from the agent's own tables: nothing to keep in step."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    def collect(self) -> Iterator[Metric]:
        servers = GaugeMetricFamily("fleet_agent_servers", "Servers by state", labels=["state"])
        counts: dict[str, int] = {}
        for srv in self.ctx.workers.servers.values():
            counts[srv.state] = counts.get(srv.state, 0) + 1
        for state in ("starting", "running", "failed", "stopping"):
            servers.add_metric([state], counts.get(state, 0))
        yield servers
        fetched = CounterMetricFamily("fleet_agent_fetched_bytes", "Bytes fetched from peers by this agent")
        fetched.add_metric([], sum(j.bytes_fetched for j in self.ctx.fetcher.jobs.values()))
        yield fetched
        yield GaugeMetricFamily("fleet_agent_fetches_in_flight", "Weight fetches running",
                                value=len(self.ctx.fetcher.active()))
        yield GaugeMetricFamily("fleet_agent_models_held", "Models present in the store",
                                value=sum(1 for _ in self.ctx.store.digests()))
        yield GaugeMetricFamily("fleet_agent_models_corrupt", "Models held that failed their last verification",
                                value=sum(1 for d in self.ctx.store.digests() if _corrupt(self.ctx, d)))


def table(ctx: AgentContext) -> list[Route]:
    """Every route of the agent, bound to ctx."""
    node, weights, servers = Node(ctx), Weights(ctx), Servers(ctx)
    return [Route("/healthz", node.healthz), Route("/v1/state", node.state),
            Route("/v1/manifests/{digest}", weights.manifest),
            Route("/v1/blobs/{sha}", weights.blob),
            Route("/v1/weights/{digest}", weights.get, methods=["GET"]),
            Route("/v1/weights/{digest}", weights.put, methods=["PUT"]),
            Route("/v1/weights/{digest}", weights.delete, methods=["DELETE"]),
            Route("/v1/weights/{digest}/verify", weights.verify, methods=["POST"]),
            Route("/v1/servers", servers.list, methods=["GET"]),
            Route("/v1/servers", servers.post, methods=["POST"]),
            Route("/v1/servers/{sid}", servers.get, methods=["GET"]),
            Route("/v1/servers/{sid}", servers.delete, methods=["DELETE"]),
            Route("/metrics", node.metrics)]


async def not_found(request: Request, _exc: Exception) -> Response:
    return error_response(404, "not_found", f"no route {request.method} {request.url.path}")


async def not_allowed(request: Request, _exc: Exception) -> Response:
    return error_response(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")


async def refused(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestRefused)
    return error_response(exc.status, exc.code, exc.message)


async def bad_input(_: Request, exc: Exception) -> Response:
    return error_response(400, "bad_request", str(exc))


# Raised from handlers (a digest or sha that does not parse, a refusal from the workers) and turned
# into the same error body as the refusals handlers return themselves.
ERRORS: dict[Any, ErrorHandler] = {404: not_found, 405: not_allowed, mf.ManifestError: bad_input,
                                   StoreError: bad_input, RequestRefused: refused}
