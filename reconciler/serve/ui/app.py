"""The status page of `fleet serve`, on the control plane's own port (the router hands it /ui and
/ui/...): the page (index.html, plain JS modules, CSS: no build step, nothing from elsewhere), its
data (GET /ui/api/overview) and the same data pushed as server-sent events whenever the
heartbeat's view changes (GET /ui/api/events), from the view the router routes by.

Access: with API keys configured, the page and its data ask for one. POST /ui/login takes a key
(a form's body, never a URL) and answers with an HttpOnly, SameSite=Strict cookie holding a token
derived from the key (HMAC, so every `fleet serve` with the same keys accepts it, and removing a key
revokes its tokens); the data accept that cookie or `Authorization: Bearer KEY`; without either, 401.
The playground's requests are the ordinary authenticated /v1/chat/completions, with the key the
person typed (kept in the page's memory only)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import parse_qs

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from reconciler.core.desired import Desired
from reconciler.serve.heartbeat import View
from reconciler.serve.metrics import ServeMetrics
from reconciler.serve import overview as ov

log = logging.getLogger("fleet")

COOKIE = "fleet_ui"
FILES = {"app.js": "text/javascript", "render.js": "text/javascript", "playground.js": "text/javascript",
         "style.css": "text/css"}
PUBLIC = frozenset({"style.css"})  # the login page's style: the rest of the page needs a key
# The page runs only its own scripts and talks only to its own origin: nothing an agent reports can
# bring a script in even if it reached the page as markup (it never does: every text is textContent).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SECURITY = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer"), (b"cache-control", b"no-store")]
POLL_S = 0.2  # how often an event stream looks at the view (an int and a set's size: nothing at scale)
REFRESH_S = 5.0  # pushed at least this often when anything moved (rates, last heartbeat times)
PING_S = 15.0
HISTORY_S = 1.0  # alerts and applies read from the store at most this often
MAX_BODY = 4096  # a login form


def session_token(key: bytes) -> str:
    return hmac.new(key, b"fleet status page session", hashlib.sha256).hexdigest()


def _text(name: str) -> bytes:
    return resources.files("reconciler.serve.ui").joinpath(name).read_bytes()


History = Callable[[], tuple[list[dict[str, Any]], int, list[dict[str, Any]]]]  # (alerts, open count, applies)


def store_history(execute: Callable[..., Any]) -> History:
    """Alerts (the open ones, newest first, then the latest cleared) and the latest applies, read
    with `execute` (the state store's Sql.execute)."""
    keys = ("id", "node", "kind", "cause", "raised_at", "cleared_at")

    def read() -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]]:
        cols = "SELECT id, node, kind, cause, raised_at, cleared_at FROM alerts"
        opened = [dict(zip(keys, r)) for r in execute(
            f"{cols} WHERE cleared_at IS NULL ORDER BY id DESC LIMIT {ov.ALERTS_SHOWN}")]
        cleared = [dict(zip(keys, r)) for r in execute(
            f"{cols} WHERE cleared_at IS NOT NULL ORDER BY id DESC LIMIT {ov.ALERTS_SHOWN // 2}")]
        count = int(execute("SELECT COUNT(*) FROM alerts WHERE cleared_at IS NULL").fetchone()[0])
        applies = []
        for r in execute("SELECT id, started, finished, config_digest, summary, results FROM applies "
                         f"ORDER BY id DESC LIMIT {ov.APPLIES_SHOWN}"):
            try:
                results = json.loads(r[5]) if r[5] else []
            except ValueError:
                results = []
            applies.append(ov.apply_json(r, results if isinstance(results, list) else []))
        return opened + cleared, count, applies

    return read


def sample(metrics: ServeMetrics, at: float) -> ov.Sample:
    """The router's counters now, per cluster (prometheus_client's public collect())."""
    requests: dict[str, float] = {}
    errors: dict[str, float] = {}
    tokens: dict[str, float] = {}
    latency: dict[str, dict[float, float]] = {}
    for family in metrics.requests.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                c = s.labels["cluster"]
                requests[c] = requests.get(c, 0) + s.value
                if s.labels["status"].startswith("5"):
                    errors[c] = errors.get(c, 0) + s.value
    for family in metrics.tokens.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                tokens[s.labels["cluster"]] = s.value
    for family in metrics.latency.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                latency.setdefault(s.labels["cluster"], {})[float(s.labels["le"])] = s.value
    return ov.Sample(at, requests, errors, tokens,
                     {c: tuple(sorted(b.items())) for c, b in latency.items()})


@dataclass
class StatusPage:
    desired: Desired
    view: View
    metrics: ServeMetrics
    history: History | None = None
    keys: Sequence[bytes] = ()
    sampler: ov.Sampler = field(default_factory=ov.Sampler)
    _history: tuple[float, tuple[list[dict[str, Any]], int, list[dict[str, Any]]]] | None = None
    _sampled: float = -1e9
    _cache: dict[tuple[Any, ...], bytes] = field(default_factory=dict)

    # ---- access ----

    def authorized(self, request: Request) -> bool:
        if not self.keys:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() == "bearer" and given and any(hmac.compare_digest(given, k) for k in self.keys):
            return True
        cookie = request.cookies.get(COOKIE, "").encode()
        return bool(cookie) and any(hmac.compare_digest(cookie, session_token(k).encode()) for k in self.keys)

    # ---- the data ----

    def read_history(self) -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]]:
        now = trio.current_time()
        if self.history is None:
            return [], 0, []
        if self._history is None or now - self._history[0] >= HISTORY_S:
            try:
                self._history = (now, self.history())
            except Exception as exc:  # a store that cannot be read now: the page says so, the rest still shows
                log.warning("status page: cannot read alerts and applies: %s", exc)
                return [{"id": 0, "node": "fleet", "kind": "store_unreadable", "cause": str(exc).splitlines()[0]
                         if str(exc) else type(exc).__name__, "raised_at": "", "cleared_at": None}], 1, []
        return self._history[1]

    def traffic(self) -> dict[str, ov.Traffic]:
        now = trio.current_time()
        if now - self._sampled >= 1.0:
            self.sampler.add(sample(self.metrics, now))
            self._sampled = now
        return self.sampler.traffic()

    def overview(self, params: Mapping[str, str]) -> dict[str, Any]:
        alerts, open_count, applies = self.read_history()
        page = _int(params.get("page"), 0)
        per_page = _int(params.get("per_page"), ov.PER_PAGE)
        out = ov.overview(self.desired, self.view, alerts=alerts, applies=applies, traffic=self.traffic(),
                          page=page, per_page=per_page, query=params.get("q", "")[:200],
                          status=params.get("status", "") if params.get("status") in ov.STATUSES else "",
                          open_alerts=open_count)
        out["auth"] = bool(self.keys)
        return out

    def encoded(self, params: Mapping[str, str]) -> bytes:
        """The overview as JSON, computed once per change of the view for all the streams asking
        the same page of it."""
        key = (self.view.beats, len(self.view.draining), int(trio.current_time() / REFRESH_S),
               tuple(sorted(params.items())))
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) > 64:
                self._cache.clear()
            hit = self._cache[key] = json.dumps(self.overview(params), separators=(",", ":")).encode()
        return hit

    # ---- the app ----

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        path = scope["path"]
        method = scope["method"]
        response: Response
        if path in ("/ui", "/ui/") and method in ("GET", "HEAD"):
            response = self.page(request)
        elif path == "/ui/login" and method == "POST":
            response = await self.login(request)
        elif path == "/ui/logout" and method == "POST":
            response = Response(status_code=303, headers={"location": "/ui"})
            response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
        elif path.startswith("/ui/static/") and method in ("GET", "HEAD"):
            response = self.static(request, path.removeprefix("/ui/static/"))
        elif path == "/ui/api/overview" and method == "GET":
            response = (Response(self.encoded(dict(request.query_params)), media_type="application/json")
                        if self.authorized(request) else _refused())
        elif path == "/ui/api/events" and method == "GET":
            if not self.authorized(request):
                response = _refused()
            else:
                await self.events(dict(request.query_params), receive, send)
                return
        else:
            response = JSONResponse({"error": {"message": f"no {method} {path} on the status page",
                                               "type": "fleet_error", "code": "not_found"}}, status_code=404)
        response.raw_headers += SECURITY
        await response(scope, receive, send)

    def page(self, request: Request) -> Response:
        if self.authorized(request):
            return Response(_text("index.html"), media_type="text/html; charset=utf-8")
        return Response(_text("login.html"), status_code=401, media_type="text/html; charset=utf-8")

    async def login(self, request: Request) -> Response:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                return Response(b"login form too large", status_code=413)
        given = (parse_qs(body.decode(errors="replace")).get("key") or [""])[0].strip().encode()
        key = next((k for k in self.keys if given and hmac.compare_digest(given, k)), None)
        if key is None and self.keys:
            page = _text("login.html").replace(b'<p id="refused" hidden>', b'<p id="refused">')
            return Response(page, status_code=401, media_type="text/html; charset=utf-8")
        response = Response(status_code=303, headers={"location": "/ui"})
        if key is not None:
            response.set_cookie(COOKIE, session_token(key), path="/ui", httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
        return response

    def static(self, request: Request, name: str) -> Response:
        if name not in FILES:
            return JSONResponse({"error": {"message": f"no file {name!r}", "type": "fleet_error",
                                           "code": "not_found"}}, status_code=404)
        if name not in PUBLIC and not self.authorized(request):
            return _refused()
        return Response(_text(name), media_type=FILES[name] + "; charset=utf-8")

    async def events(self, params: Mapping[str, str], receive: Receive, send: Send) -> None:
        """The overview, sent again whenever it changes: the heartbeat's beats (and drains) are
        looked at every POLL_S; a comment every PING_S keeps proxies from closing a quiet stream."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), *SECURITY]})
        async with trio.open_nursery() as nursery:
            async def disconnected() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(disconnected)
            last, pinged = b"", trio.current_time()
            while True:
                data = self.encoded(params)
                now = trio.current_time()
                if data != last:
                    await send({"type": "http.response.body", "body": b"event: overview\ndata: " + data + b"\n\n",
                                "more_body": True})
                    last, pinged = data, now
                elif now - pinged >= PING_S:
                    await send({"type": "http.response.body", "body": b": ping\n\n", "more_body": True})
                    pinged = now
                await trio.sleep(POLL_S)


def _refused() -> Response:
    return JSONResponse({"error": {"message": "a valid API key is required (log in at /ui, or Authorization: "
                                              "Bearer KEY)", "type": "fleet_error", "code": "invalid_api_key"}},
                        status_code=401, headers={"www-authenticate": 'Bearer realm="fleet"'})


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
