"""The one client entry point: OpenAI-compatible routes relayed to a running member of the cluster
the request names, streams chunk by chunk, the serving node's filesystem paths scrubbed."""

from __future__ import annotations

import hmac
import json
import logging
import math
from typing import Awaitable, Callable, Collection, Sequence
from urllib.parse import unquote

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from wire.ids import server_id

from reconciler.core.desired import ClusterSpec, Desired
from reconciler.serve.heartbeat import View
from reconciler.serve.metrics import ServeMetrics
from net import client
from net.http1 import Refused
from net.http1 import Request as Head
from reconciler.serve.scrub import Scrubber, scrub_reason


log = logging.getLogger("fleet")

RELAYED = frozenset({"/v1/completions", "/v1/chat/completions"})
OPEN = frozenset({"/healthz"})  # the paths answered without an API key; every other one needs it
RENEW_TIMEOUT_S = 5.0  # asking an agent for a restarted worker's credential, between beats
RENEW_EVERY_S = 2.0  # a node is asked again at most this often, however many requests are refused
Refresh = Callable[[Collection[str]], Awaitable[None]]  # ask these nodes now (Heartbeat.refresh)


# A non-streamed answer larger than this is refused (the member counts as not answering), not held:
# a whole completion is a few KiB to a few MiB of JSON.
WHOLE_ANSWER_LIMIT = 64 << 20


def worker_headers(credential: str, stream: bool = False) -> list[tuple[str, str]]:
    """What a request to a worker carries beside its body: the credential the worker asks of every
    request (agent/auth.py WorkerAuth; none from an agent too old to make one)."""
    headers = [("Content-Type", "application/json")]
    if stream:
        headers.append(("Accept", "text/event-stream"))
    if credential:
        headers.append(("Authorization", f"Bearer {credential}"))
    return headers


def refused_credential(status: int, www_authenticate: str) -> bool:
    """A worker's refusal of the credential sent (agent/auth.py WorkerAuth), not some other 401."""
    return status == 401 and 'realm="fleet-worker"' in www_authenticate


class RelayStream(Response):
    """A worker's streamed answer, relayed as it arrives with the node's paths scrubbed. Once bytes
    went to the client the request is never retried elsewhere: a member that dies mid-stream ends
    the stream cleanly, with an error event naming the machine. One task per stream listens for
    the client going away and stops the relay (which closes the worker's connection).

    No chunk is held back to wait for the next: each read takes everything that has arrived, so
    chunks coalesce only when the relay is behind. (A time window that batched chunks of fast
    streams was tried: it halved the relay's CPU on one fast stream but lengthened every stream
    by up to a window, epoll rounds sleeps up to whole milliseconds, and throughput fell.)"""

    def __init__(self, router: "Router", response: client.Response, scrub: Scrubber, node: str,
                 sid: str = "") -> None:
        self.router, self.upstream, self.scrub, self.node = router, response, scrub, node
        self.sid = sid  # the member's server id: its requests in flight are counted by it
        self.status_code = response.status
        self.content_type = response.headers.get("content-type", "text/event-stream")
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.router.metrics
        metrics.streams.inc()
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": [(b"content-type", self.content_type.encode()), (b"cache-control", b"no-cache")]})
            async with trio.open_nursery() as nursery:
                async def disconnected() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(disconnected)
                await self.relay(send)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                nursery.cancel_scope.cancel()
        finally:
            # However the relay ended (done, client gone, cancelled), the worker's connection is
            # released now: back to the pool after a clean end, closed otherwise.
            metrics.streams.dec()
            self.upstream.close()
            self.router.outstanding[self.sid] -= 1

    async def relay(self, send: Send) -> None:
        response, scrub, sent, timeout = self.upstream, self.scrub, self.router.metrics.relay_bytes, self.router.timeout
        # The worker may stay silent for `timeout`. Moving a deadline costs trio a heap push, so it
        # is moved at most every `step` seconds: silence is measured to within that step.
        step, moved = min(1.0, timeout / 4), -math.inf
        prev = last = b""  # the stream's last pieces: its usage chunk, for the status page's tokens
        try:
            with trio.CancelScope() as silence:
                while True:
                    now = trio.current_time()
                    if now - moved >= step:
                        silence.deadline, moved = now + timeout, now
                    piece = await response.read()
                    if not piece:
                        break
                    out = scrub.feed(piece)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        sent.inc(len(out))
                        prev, last = last, out
            if silence.cancelled_caught:
                raise client.ClientError(f"it sent nothing for {timeout:g}s", started=True)
            tail = scrub.flush()
        except client.ClientError as exc:
            log.warning("the member on %s failed mid-stream: %s", self.node, exc)
            event = {"error": {"message": f"the member on {self.node} failed mid-stream: {exc}",
                               "type": "fleet_error", "code": "member_failed_mid_stream", "node": self.node}}
            tail = scrub.flush() + b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
        if tail:
            await send({"type": "http.response.body", "body": tail, "more_body": True})
            sent.inc(len(tail))
        self.router.metrics.answered(self.sid.partition("@")[0], prev + last + tail)


def api_error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "fleet_error", "code": code}}, status_code=status)


class Router:
    ui: ASGIApp | None = None  # the status page (serve/ui/app.py), answering /ui and /ui/... when set

    def __init__(self, desired: Desired, view: View, *, api_keys: list[str] | None = None,
                 transport: client.Fetch | None = None, timeout: float = 300.0,
                 metrics: ServeMetrics | None = None, refresh: Refresh | None = None) -> None:
        self.d = desired
        self.timeout = timeout  # a worker silent this long (before or during its answer) is given up on
        self.metrics = metrics or ServeMetrics()
        self.view = view
        self.keys = [k.encode() for k in api_keys or []]
        self.outstanding: dict[str, int] = {}  # server id → requests in flight on that member
        # A worker restarted since the last beat has a new credential: its node is asked again
        # (once for all the requests that found out at the same time) before the request goes on.
        self.refresh = refresh
        self._renewing: dict[str, trio.Event] = {}
        self._renewed_at: dict[str, float] = {}  # node → when it was last asked (trio's clock)
        self.pool = client.Pool()  # idle connections to workers, for streamed and whole answers alike
        # How a whole answer is asked for: net/client.py's fetch on the pool, unless a test stands
        # a worker in (`transport`).
        self.fetch: client.Fetch = transport or self._fetch

    # ---- choosing a member ----

    def cluster_for(self, name: str) -> ClusterSpec | None:
        if name in self.d.clusters:
            return self.d.clusters[name]
        return next((c for c in self.d.clusters.values() if c.model == name), None)

    def in_flight(self, sid: str) -> int:
        return self.outstanding.get(sid, 0)

    def member_state(self, c: ClusterSpec, node: str) -> tuple[bool, str]:
        if not self.view.online.get(node, False):
            return False, f"{node}: node offline"
        if server_id(c.name, node) in self.view.draining:  # an apply replaces it (serve/drains.py)
            return False, f"{node}: draining for an apply"
        seen = self.view.nodes.get(node)
        server = seen.servers.get(server_id(c.name, node)) if seen is not None else None
        if server is None:
            return False, f"{node}: no server started"
        if server.state != "running":
            # The full reason (the engine's own words, the tail of its output), so a client learns
            # why without a shell on the node; scrubbed of the node's paths and any other path.
            reason = scrub_reason(server.reason.strip() if c.pipeline is None else server.reason.strip().splitlines()[0], self.scrubber(c, node).paths, c.name) if server.reason else ""  # a stage's: its fixed sentence, no output tail
            return False, f"{node}: server {server.state}" + (f" ({reason})" if reason else "")
        return True, ""

    def candidates(self, c: ClusterSpec) -> tuple[list[str], list[str]]:
        if c.pipeline is not None:
            # A pipeline answers through its first stage, and only while every stage runs: the
            # others hold layers a request cannot do without.
            down = [reason for good, reason in (self.member_state(c, node) for node in c.members) if not good]
            return ([] if down else [c.members[0]]), down
        members = self.view.members(self.d, c)
        ok: list[str] = []
        why: list[str] = []
        for node in members:
            good, reason = self.member_state(c, node)
            (ok if good else why).append(node if good else reason)
        # Least outstanding first.
        ok.sort(key=lambda n: (self.outstanding.get(server_id(c.name, n), 0), members.index(n)))
        return ok, why

    def credential(self, node: str, sid: str) -> str:
        """What the member's worker asks of every request, as its agent reported it ("" from an
        agent too old to make one: such a worker asks nothing)."""
        seen = self.view.nodes.get(node)
        server = seen.servers.get(sid) if seen is not None else None
        return server.credential if server is not None else ""

    async def renewed(self, node: str, sid: str, refused: str) -> str | None:
        """The member's credential after asking its agent again, or None when it is still the one
        refused (nothing to ask with, or the agent reports no other)."""
        current = self.credential(node, sid)
        if current and current != refused:  # renewed since this request set out
            return current
        pending = self._renewing.get(node)
        if pending is not None:
            await pending.wait()
        elif self.refresh is not None and self._may_ask(node):
            pending = self._renewing[node] = trio.Event()
            self._renewed_at[node] = trio.current_time()
            try:
                # Shielded, and bounded: a client that leaves must not cancel what others wait on.
                with trio.CancelScope(shield=True), trio.move_on_after(RENEW_TIMEOUT_S):
                    await self.refresh([node])
            finally:
                del self._renewing[node]
                pending.set()
        fresh = self.credential(node, sid)
        return fresh if fresh and fresh != refused else None

    def _may_ask(self, node: str) -> bool:
        """Whether `node` may be asked again now: a worker that keeps refusing must not turn every
        client request into a call to its agent."""
        last = self._renewed_at.get(node)
        return last is None or trio.current_time() - last >= RENEW_EVERY_S

    async def open_stream(self, node: str, sid: str, port: int, path: str, raw: bytes) -> client.Response:
        """A streaming POST to the member's worker with its credential, asked once more with a
        renewed one if the worker refuses it (ClientError, not started, if there is none)."""
        host, credential = self.d.nodes[node].address, self.credential(node, sid)
        response = await self._stream(host, port, path, raw, credential)
        if not refused_credential(response.status, response.headers.get("www-authenticate", "")):
            return response
        response.close()
        fresh = await self.renewed(node, sid, credential)
        if fresh is None:
            raise client.ClientError(f"{host}:{port} refused the credential its agent reported for {sid}",
                                     started=False)
        return await self._stream(host, port, path, raw, fresh)

    async def _stream(self, host: str, port: int, path: str, raw: bytes, credential: str) -> client.Response:
        return await client.request("POST", host, port, path, body=raw, headers=worker_headers(credential, True),
                                     pool=self.pool, peer="the worker")

    async def _fetch(self, method: str, host: str, port: int, target: str, *, body: bytes = b"",
                     headers: Sequence[tuple[str, str]] = ()) -> client.Whole:
        return await client.fetch(method, host, port, target, body=body, headers=headers, pool=self.pool,
                                  peer="the worker", limit=WHOLE_ANSWER_LIMIT)

    async def post_whole(self, node: str, sid: str, port: int, path: str, raw: bytes) -> client.Whole:
        """As open_stream, for an answer read whole (ClientError when it cannot be had)."""
        host, credential = self.d.nodes[node].address, self.credential(node, sid)
        for attempt in range(2):
            response = await self.fetch("POST", host, port, path, body=raw, headers=worker_headers(credential))
            if not refused_credential(response.status, response.headers.get("www-authenticate", "")):
                return response
            fresh = await self.renewed(node, sid, credential) if attempt == 0 else None
            if fresh is None:
                break
            credential = fresh
        raise client.ClientError(f"{host}:{port} refused the credential its agent reported for {sid}", started=False)

    def scrubber(self, c: ClusterSpec, node: str) -> Scrubber:
        """Scrubs the paths of `node`, and of every stage of a pipeline: the first stage relays what
        the others report (their failures name their own store)."""
        paths: list[str] = []
        for n in (c.members if c.pipeline is not None else (node,)):
            seen = self.view.nodes.get(n)
            paths += [w.path for w in seen.weights.values()] + [seen.home] if seen is not None else []
        return Scrubber([p for p in paths if p and p != "/"], c.name)

    # ---- relaying ----

    async def relay(self, request: Request) -> Response:
        started = trio.current_time()
        response = await self._relay(request)
        cluster = getattr(request.state, "cluster", "-")
        self.metrics.requests.labels(cluster, str(response.status_code)).inc()
        if cluster != "-" and response.status_code < 400:
            self.metrics.latency.labels(cluster).observe(trio.current_time() - started)
            if not isinstance(response, RelayStream):
                self.metrics.answered(cluster, bytes(response.body))
        return response

    async def _relay(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            name = body["model"]
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError, RecursionError):  # RecursionError: nested deep
            return api_error(400, "invalid_request", "the body must be JSON with a `model` naming a cluster")
        cluster = self.cluster_for(name)
        request.state.cluster = cluster.name if cluster else "-"
        if cluster is None:
            return api_error(404, "model_not_found", f"no cluster or model named {name!r}; see GET /v1/models")
        members, why = self.candidates(cluster)
        if not members and cluster.pipeline is not None:
            message = f"pipeline {cluster.name!r} is not serving: " + "; ".join(why)
            log.warning("%s", message)
            return api_error(503, "pipeline_unavailable", message)
        if not members:
            if not why and cluster.placement is not None:
                why = [f"placed (members: {{count: {cluster.placement.count}}}), and no node reports its server: "
                       "fleet apply places it"]
            message = f"cluster {cluster.name!r} has no running member: " + "; ".join(why)
            log.warning("%s", message)
            return api_error(503, "no_running_member", message)
        stream = bool(body.get("stream"))
        failures = []
        for node in members:
            path, sid = request.scope["path"], server_id(cluster.name, node)
            if sid in self.view.draining:  # drained while an earlier member was tried
                failures.append(f"{node}: draining for an apply")
                continue
            self.outstanding[sid] = self.outstanding.get(sid, 0) + 1
            streaming = False  # a stream that started keeps its member counted until it ends (RelayStream)
            try:
                with trio.fail_after(self.timeout):
                    if stream:
                        upstream_response = await self.open_stream(node, sid, cluster.port, path, raw)
                    else:
                        response = await self.post_whole(node, sid, cluster.port, path, raw)
            except trio.TooSlowError:
                failure = f"no answer within {self.timeout:g}s"
            except client.ClientError as exc:
                failure = str(exc)
            else:
                if stream:
                    streaming = True
                    return RelayStream(self, upstream_response, self.scrubber(cluster, node), node, sid)
                scrub = self.scrubber(cluster, node)
                content = scrub.feed(response.content) + scrub.flush()
                self.metrics.relay_bytes.inc(len(content))
                return Response(content, status_code=response.status,
                                media_type=response.headers.get("content-type", "application/json"))
            finally:
                if not streaming:
                    self.outstanding[sid] -= 1
            # Nothing reached the client yet: the next member may answer.
            failures.append(f"{node}: {failure}")
            log.warning("cluster %s: the member on %s did not answer: %s", cluster.name, node, failure)
        message = f"no member of {cluster.name!r} answered: " + "; ".join(failures)
        log.warning("%s", message)
        return api_error(502, "no_member_answered", message)

    # ---- the app ----

    def authorized(self, request: Request) -> bool:
        return self.key_given(request.headers.get("authorization", "").encode("latin-1"))

    def key_given(self, authorization: bytes) -> bool:
        """Whether an Authorization header's value holds one of the keys (or none is needed).
        Only `Bearer KEY` (the scheme is case-insensitive, RFC 9110 11.1): a bare key, or any
        other scheme, is no key at all."""
        if not self.keys:
            return True
        scheme, _, token = authorization.partition(b" ")
        given = token.strip()
        return scheme.lower() == b"bearer" and bool(given) and any(hmac.compare_digest(given, k) for k in self.keys)

    def admit(self, head: Head) -> None:
        """The front's check of a request's head, before its body is read (front.Front's
        `admit`): without a valid key, 401 and the connection closed, the body never taken in
        (20 clients posting 31 MiB without a key grew fleet serve by 650 MB while it read them
        whole to answer 401). The app checks the key again for callers without this front."""
        if not self.keys:
            return
        path = unquote(head.target.partition(b"?")[0].decode("latin-1"))
        if path in OPEN or self.ui is not None and (path + "/").startswith("/ui/"):  # the page checks its own (a cookie)
            return
        if not self.key_given(next((v for k, v in head.headers if k == b"authorization"), b"")):
            raise Refused(401, "a valid API key is required (Authorization: Bearer KEY)", "invalid_api_key")

    def app(self) -> ASGIApp:
        async def models(request: Request) -> Response:
            if not self.authorized(request):
                return api_error(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)")
            # Clusters only: which machines serve one is the fleet's business, not an API client's
            # (the router has no admin key to ask with).
            data = [{"id": c.name, "object": "model", "owned_by": "fleet", "model": c.model}
                    for c in self.d.clusters.values()]
            return JSONResponse({"object": "list", "data": data})

        async def relay(request: Request) -> Response:
            if not self.authorized(request):
                return api_error(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)")
            return await self.relay(request)

        async def fast(scope: Scope, receive: Receive, send: Send) -> None:
            # The relayed routes skip Starlette's routing and per-message exception wrappers:
            # at thousands of chunks a second they were a measurable share of the router's CPU.
            if self.ui is not None and scope["type"] == "http" and (scope["path"] + "/").startswith("/ui/"):
                await self.ui(scope, receive, send)
                return
            if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in RELAYED:
                response = await relay(Request(scope, receive))
                await response(scope, receive, send)
                return
            await routed(scope, receive, send)

        async def healthz(_: Request) -> Response:
            return JSONResponse({"status": "ok", "beats": self.view.beats})

        async def metrics(request: Request) -> Response:
            if not self.authorized(request):
                return api_error(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)")
            for node in self.d.nodes:
                self.metrics.node_up.labels(node).set(1 if self.view.online.get(node) else 0)
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

        routed = Starlette(routes=[Route("/healthz", healthz), Route("/v1/models", models), Route("/metrics", metrics),
                                   Route("/v1/completions", relay, methods=["POST"]),
                                   Route("/v1/chat/completions", relay, methods=["POST"])])
        return fast
