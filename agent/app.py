"""The agent's HTTP API (thin): authentication, /healthz, /v1/state."""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from wire import manifest as mf
from wire import windows
from wire.layers import LayerRange, LayerRangeError

from . import environment, inventory
from .blobs import BlobResponse
from .fetch import Fetcher
from .identity import Identity
from .store import Store, StoreError
from .workers import Refused, Workers

MIN_SECRET_BYTES = 16
PUBLIC_PATHS = frozenset({"/healthz"})


PEER_URL = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}/?$")


def local_now() -> datetime:
    return datetime.now().astimezone()


class Spawner:
    """Background work (fetches, server supervision) runs in the server's nursery, handed over once open."""

    def __init__(self) -> None:
        self.nursery: trio.Nursery | None = None

    def __call__(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        if self.nursery is None:
            raise RuntimeError("the agent's nursery is not open yet")
        self.nursery.start_soon(fn, *args)


@dataclass
class AgentContext:
    """Everything the routes need, injected: the clock and the GPU probe are seams for tests."""

    home: Path
    identity: Identity
    secret: bytes
    version: str
    gpu_probe: inventory.GpuProbe
    windows: tuple[windows.Window, ...] = ()
    clock: Callable[[], datetime] = local_now
    engines: dict[str, Any] = field(default_factory=environment.engines)
    spawner: Spawner = field(default_factory=Spawner)
    store: Store = field(init=False)
    fetcher: Fetcher = field(init=False)
    listen_host: str = "127.0.0.1"
    workers: Workers = field(init=False)

    def __post_init__(self) -> None:
        self.store = Store(self.home)
        self.fetcher = Fetcher(self.store, self.secret.decode(), self.spawner)
        self.workers = Workers(self.home, self.store, self.spawner, self.listen_host)

    def state(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "identity": {"id": self.identity.id, "name": self.identity.name,
                         "enrolled_at": self.identity.enrolled_at},
            "agent_version": self.version,
            "variant": {"accelerator": environment.variant(self.engines), **self.engines},
            "inventory": inventory.measure(self.home, self.gpu_probe),
            "availability": windows.status(self.windows, now),
            "observed_at": now.isoformat(),
            "weights": self.store.entries(),
            "fetches": [j.to_json() for j in self.fetcher.active()],
            "servers": [s.to_json() for s in self.workers.servers.values()],
        }


class BearerAuth:
    """Every path but /healthz needs `Authorization: Bearer <cluster secret>`, compared in constant
    time. The answer says whether the secret was missing or wrong, and never echoes it."""

    def __init__(self, app: ASGIApp, secret: bytes) -> None:
        self.app = app
        self.expected = b"Bearer " + secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if given is not None and hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        code, message = (("secret_missing", "this agent requires the cluster secret as 'Authorization: Bearer <secret>'")
                         if given is None else
                         ("secret_wrong", "the cluster secret sent does not match this agent's FLEET_CLUSTER_SECRET"))
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="fleet-agent"')]})
        await send({"type": "http.response.body", "body": body})


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def create_app(ctx: AgentContext) -> ASGIApp:
    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def state(_: Request) -> JSONResponse:
        return JSONResponse(ctx.state())

    async def not_found(request: Request, _exc: Exception) -> JSONResponse:
        return error_response(404, "not_found", f"no route {request.method} {request.url.path}")

    async def not_allowed(request: Request, _exc: Exception) -> JSONResponse:
        return error_response(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")

    def digest_param(request: Request) -> str:
        digest = request.path_params["digest"]
        mf.check_digest(digest)
        return str(digest)

    async def get_manifest(request: Request) -> Response:
        digest = digest_param(request)
        try:
            return Response(ctx.store.manifest_bytes(digest), media_type="application/json")
        except StoreError as exc:
            return error_response(404, "weights_not_held", str(exc))

    async def get_blob(request: Request) -> Response:
        sha = request.path_params["sha"]
        path = ctx.store.blob_path(sha)  # validates: 64 hex digits, nothing else reaches the disk
        if not path.is_file():
            return error_response(404, "blob_not_held", f"blob {sha} is not held here")
        return BlobResponse(path, request.headers.get("range"))

    async def put_weights(request: Request) -> Response:
        digest = digest_param(request)
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "bad_request", "the body must be JSON: {\"peer\": URL, ...}")
        if not isinstance(body, dict):
            return error_response(400, "bad_request", "the body must be a JSON object")
        if ctx.store.is_present(digest):
            return JSONResponse({"digest": digest, "state": "present"})
        peer = body.get("peer")
        if not isinstance(peer, str) or not PEER_URL.match(peer):
            return error_response(400, "bad_peer", "peer must be an agent URL such as http://10.0.0.2:7070")
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
        job = ctx.fetcher.request(digest, peer, name, source, rng)
        return JSONResponse(job.to_json(), status_code=202)

    async def get_weights(request: Request) -> Response:
        digest = digest_param(request)
        job = ctx.fetcher.jobs.get(digest)
        if ctx.store.is_present(digest):
            # The finished fetch, if this agent ran one, says how many bytes crossed the wire.
            return JSONResponse({**ctx.store.entry(digest), "state": "present",
                                 "fetch": job.to_json() if job is not None else None})
        if job is not None:
            return JSONResponse(job.to_json())
        return JSONResponse({"digest": digest, "state": "absent"}, status_code=404)

    async def delete_weights(request: Request) -> Response:
        digest = digest_param(request)
        job = ctx.fetcher.jobs.get(digest)
        if job is not None and job.state == "fetching":
            return error_response(409, "weights_busy", f"{digest} is being fetched; wait for the fetch to end")
        user = ctx.workers.using(digest)
        if user is not None:
            return error_response(409, "weights_in_use", f"{digest} is used by server {user}; stop it first")
        try:
            ctx.store.delete(digest)
        except StoreError as exc:
            return error_response(404, "weights_not_held", str(exc))
        ctx.fetcher.jobs.pop(digest, None)
        return JSONResponse({"digest": digest, "state": "deleted"})

    async def post_server(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "bad_request", "the body must be JSON")
        if not isinstance(body, dict):
            return error_response(400, "bad_request", "the body must be a JSON object")
        if isinstance(body.get("model"), str):
            mf.check_digest(body["model"])
        server = ctx.workers.start(body)
        return JSONResponse(server.to_json(), status_code=202)

    async def list_servers(_: Request) -> Response:
        return JSONResponse({"servers": [s.to_json() for s in ctx.workers.servers.values()]})

    async def get_server(request: Request) -> Response:
        server = ctx.workers.servers.get(request.path_params["sid"])
        if server is None:
            return error_response(404, "server_not_found", f"no server {request.path_params['sid']} on this node")
        return JSONResponse(server.to_json())

    async def delete_server(request: Request) -> Response:
        server = await ctx.workers.stop(request.path_params["sid"])
        return JSONResponse(server.to_json())

    registry = CollectorRegistry()
    registry.register(_AgentCollector(ctx))

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    async def refused(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Refused)
        return error_response(exc.status, exc.code, exc.message)

    async def bad_input(_: Request, exc: Exception) -> JSONResponse:
        return error_response(400, "bad_request", str(exc))

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[JSONResponse]]] = {
        404: not_found, 405: not_allowed, mf.ManifestError: bad_input, StoreError: bad_input, Refused: refused}
    app = Starlette(routes=[Route("/healthz", healthz), Route("/v1/state", state),
                            Route("/v1/manifests/{digest}", get_manifest),
                            Route("/v1/blobs/{sha}", get_blob),
                            Route("/v1/weights/{digest}", get_weights, methods=["GET"]),
                            Route("/v1/weights/{digest}", put_weights, methods=["PUT"]),
                            Route("/v1/weights/{digest}", delete_weights, methods=["DELETE"]),
                            Route("/v1/servers", list_servers, methods=["GET"]),
                            Route("/v1/servers", post_server, methods=["POST"]),
                            Route("/v1/servers/{sid}", get_server, methods=["GET"]),
                            Route("/v1/servers/{sid}", delete_server, methods=["DELETE"]),
                            Route("/metrics", metrics)],
                    exception_handlers=handlers)
    app.state.ctx = ctx
    return BearerAuth(app, ctx.secret)


class _AgentCollector:
    """Read at scrape time from the agent's own tables: nothing to keep in step."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    def collect(self) -> Any:
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


def routes(app: ASGIApp) -> list[tuple[str, set[str]]]:
    """(path, methods) of every route, for tests that must try them all."""
    inner = app.app if isinstance(app, BearerAuth) else app
    return [(r.path, set(r.methods or ())) for r in inner.routes if isinstance(r, Route)]  # type: ignore[attr-defined]
