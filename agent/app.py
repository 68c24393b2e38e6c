"""The agent's HTTP API (thin): authentication, /healthz, /v1/state."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from . import environment, inventory, windows
from .identity import Identity

MIN_SECRET_BYTES = 16
PUBLIC_PATHS = frozenset({"/healthz"})


def local_now() -> datetime:
    return datetime.now().astimezone()


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
            "weights": [],
            "servers": [],
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

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[JSONResponse]]] = {404: not_found, 405: not_allowed}
    app = Starlette(routes=[Route("/healthz", healthz), Route("/v1/state", state)],
                    exception_handlers=handlers)  # type: ignore[arg-type]
    app.state.ctx = ctx
    return BearerAuth(app, ctx.secret)


def routes(app: ASGIApp) -> list[tuple[str, set[str]]]:
    """(path, methods) of every route, for tests that must try them all."""
    inner = app.app if isinstance(app, BearerAuth) else app
    return [(r.path, set(r.methods or ())) for r in inner.routes if isinstance(r, Route)]  # type: ignore[attr-defined]
