"""The cluster secret: what makes one acceptable, and the ASGI middleware that asks every request
but /healthz for it, compared in constant time."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

MIN_SECRET_BYTES = 16
PUBLIC_PATHS = frozenset({"/healthz"})


class BadSecret(ValueError):
    """FLEET_CLUSTER_SECRET unset or too short; the message says so and never contains the secret."""


def cluster_secret(raw: str | None) -> bytes:
    """The secret from FLEET_CLUSTER_SECRET's value, or BadSecret saying why it cannot be used."""
    if not raw:
        raise BadSecret("FLEET_CLUSTER_SECRET is not set: every agent and the control plane share one "
                        f"cluster secret (at least {MIN_SECRET_BYTES} bytes), e.g. from `openssl rand -hex 32`")
    secret = raw.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise BadSecret(f"FLEET_CLUSTER_SECRET is {len(secret)} bytes; it must be at least {MIN_SECRET_BYTES}")
    return secret


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
