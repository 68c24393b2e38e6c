"""The one client entry point: OpenAI-compatible routes relayed to a running member of the cluster
the request names, streams chunk by chunk, the serving node's filesystem paths scrubbed."""

from __future__ import annotations

import hmac
import json
from typing import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..model import ClusterSpec, Desired
from .heartbeat import View
from .metrics import ServeMetrics
from .scrub import Scrubber


def api_error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "fleet_error", "code": code}}, status_code=status)


class Router:
    def __init__(self, desired: Desired, view: View, *, api_keys: list[str] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, timeout: float = 300.0,
                 metrics: ServeMetrics | None = None) -> None:
        self.d = desired
        self.metrics = metrics or ServeMetrics()
        self.view = view
        self.keys = [k.encode() for k in api_keys or []]
        self.outstanding: dict[str, int] = {}
        self.http = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout, connect=5.0),
                                      limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))

    # ---- choosing a member ----

    def cluster_for(self, name: str) -> ClusterSpec | None:
        if name in self.d.clusters:
            return self.d.clusters[name]
        return next((c for c in self.d.clusters.values() if c.model == name), None)

    def member_state(self, c: ClusterSpec, node: str) -> tuple[bool, str]:
        if not self.view.online.get(node, False):
            return False, f"{node}: node offline"
        server = next((s for s in self.view.states.get(node, {}).get("servers", []) if s["id"] == f"{c.name}@{node}"),
                      None)
        if server is None:
            return False, f"{node}: no server started"
        if server["state"] != "running":
            reason = (server.get("reason") or "").splitlines()[0] if server.get("reason") else ""
            return False, f"{node}: server {server['state']}" + (f" ({reason})" if reason else "")
        return True, ""

    def candidates(self, c: ClusterSpec) -> tuple[list[str], list[str]]:
        ok, why = [], []
        for node in c.members:
            good, reason = self.member_state(c, node)
            (ok if good else why).append(node if good else reason)
        ok.sort(key=lambda n: (self.outstanding.get(n, 0), c.members.index(n)))  # least outstanding first
        return ok, why

    def scrubber(self, node: str, replacement: str) -> Scrubber:
        state = self.view.states.get(node, {})
        paths = [w.get("path", "") for w in state.get("weights", [])]
        paths.append(state.get("inventory", {}).get("disk", {}).get("path", ""))
        return Scrubber([p for p in paths if p and p != "/"], replacement)

    # ---- relaying ----

    async def relay(self, request: Request) -> Response:
        response = await self._relay(request)
        self.metrics.requests.labels(getattr(request.state, "cluster", "-"), str(response.status_code)).inc()
        return response

    async def _relay(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            name = body["model"]
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            return api_error(400, "invalid_request", "the body must be JSON with a `model` naming a cluster")
        cluster = self.cluster_for(name)
        request.state.cluster = cluster.name if cluster else "-"
        if cluster is None:
            return api_error(404, "model_not_found", f"no cluster or model named {name!r}; see GET /v1/models")
        members, why = self.candidates(cluster)
        if not members:
            return api_error(503, "no_running_member",
                             f"cluster {cluster.name!r} has no running member: " + "; ".join(why))
        stream = bool(body.get("stream"))
        failures = []
        for node in members:
            url = f"http://{self.d.nodes[node].address}:{cluster.port}{request.url.path}"
            upstream = self.http.build_request("POST", url, content=raw, headers={"content-type": "application/json"})
            self.outstanding[node] = self.outstanding.get(node, 0) + 1
            try:
                response = await self.http.send(upstream, stream=True)
            except httpx.TransportError as exc:
                # Nothing reached the client yet: the next member may answer.
                self.outstanding[node] -= 1
                failures.append(f"{node}: {type(exc).__name__}: {exc}")
                continue
            scrub = self.scrubber(node, cluster.name)
            if not stream:
                try:
                    content = await response.aread()
                except httpx.TransportError as exc:
                    return api_error(502, "member_failed", f"{node} failed while answering: {exc}")
                finally:
                    await response.aclose()
                    self.outstanding[node] -= 1
                content = scrub.feed(content) + scrub.flush()
                self.metrics.relay_bytes.inc(len(content))
                return Response(content, status_code=response.status_code,
                                media_type=response.headers.get("content-type", "application/json"))
            return StreamingResponse(self._stream(response, scrub, node), status_code=response.status_code,
                                     media_type=response.headers.get("content-type", "text/event-stream"))
        return api_error(502, "no_member_answered", f"no member of {cluster.name!r} answered: " + "; ".join(failures))

    async def _stream(self, response: httpx.Response, scrub: Scrubber, node: str) -> AsyncIterator[bytes]:
        # Once bytes went to the client the request is never retried elsewhere: a member that
        # dies mid-stream ends the stream cleanly, with an error event naming the machine.
        self.metrics.streams.inc()
        try:
            async for chunk in response.aiter_raw():
                out = scrub.feed(chunk)
                if out:
                    self.metrics.relay_bytes.inc(len(out))
                    yield out
            tail = scrub.flush()
            if tail:
                yield tail
        except httpx.HTTPError as exc:
            tail = scrub.flush()
            event = {"error": {"message": f"the member on {node} failed mid-stream: {type(exc).__name__}: {exc}",
                               "type": "fleet_error", "code": "member_failed_mid_stream", "node": node}}
            yield tail + b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            self.metrics.streams.dec()
            await response.aclose()
            self.outstanding[node] -= 1

    # ---- the app ----

    def authorized(self, request: Request) -> bool:
        if not self.keys:
            return True
        given = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
        return any(hmac.compare_digest(given, k) for k in self.keys)

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            if not self.authorized(request):
                return api_error(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)")
            data = [{"id": c.name, "object": "model", "owned_by": "fleet", "model": c.model,
                     "members": list(c.members)} for c in self.d.clusters.values()]
            return JSONResponse({"object": "list", "data": data})

        async def relay(request: Request) -> Response:
            if not self.authorized(request):
                return api_error(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)")
            return await self.relay(request)

        async def healthz(_: Request) -> Response:
            return JSONResponse({"status": "ok", "beats": self.view.beats})

        async def metrics(request: Request) -> Response:
            if not self.authorized(request):
                return api_error(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)")
            for node in self.d.nodes:
                self.metrics.node_up.labels(node).set(1 if self.view.online.get(node) else 0)
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

        return Starlette(routes=[Route("/healthz", healthz), Route("/v1/models", models), Route("/metrics", metrics),
                                 Route("/v1/completions", relay, methods=["POST"]),
                                 Route("/v1/chat/completions", relay, methods=["POST"])])
