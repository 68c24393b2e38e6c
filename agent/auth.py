"""Bearer credentials, compared in constant time: the cluster secret every agent request but /healthz
needs, and the per-server credential a worker asks of every request (only the router has it)."""

from __future__ import annotations

import hmac
import json
import os
import secrets
import sys

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


class _BearerGate:
    """An ASGI app behind `Authorization: Bearer <token>`, compared in constant time: a request that
    carries it (or asks for one of `public`) goes through, any other is refused by `refuse`."""

    public: frozenset[str] = frozenset()

    def __init__(self, app: ASGIApp, token: bytes) -> None:
        self.app = app
        self.expected = b"Bearer " + token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (scope["type"] == "http" and scope["path"] in self.public):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if given is not None and hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        await self.refuse(scope, send, given)

    async def refuse(self, scope: Scope, send: Send, given: bytes | None) -> None:
        raise NotImplementedError

    def admits(self, scope: Scope) -> bool:
        """Whether `scope` carries the credential (the agent's server prefers such connections)."""
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        return given is not None and hmac.compare_digest(given, self.expected)


class BearerAuth(_BearerGate):
    """Every path but /healthz needs `Authorization: Bearer <cluster secret>`, compared in constant
    time. The answer says whether the secret was missing or wrong, and never echoes it."""

    public = PUBLIC_PATHS

    async def refuse(self, scope: Scope, send: Send, given: bytes | None) -> None:
        code, message = (("secret_missing", "this agent requires the cluster secret as 'Authorization: Bearer <secret>'")
                         if given is None else
                         ("secret_wrong", "the cluster secret sent does not match this agent's FLEET_CLUSTER_SECRET"))
        await _refuse(scope, send, {"code": code, "message": message}, b"fleet-agent")


# A worker's credential reaches it in this environment variable, never on its command line: argv
# is readable by every user in /proc/PID/cmdline, a process's environment only by its owner.
WORKER_CREDENTIAL_ENV = "FLEET_WORKER_CREDENTIAL"


def new_worker_credential() -> str:
    """A fresh credential for one server: made at each start, so a replaced worker's is worthless."""
    return secrets.token_urlsafe(32)


class WorkerAuth(_BearerGate):
    """A worker's door: every request (health included: the agent's probe carries it too) needs
    `Authorization: Bearer <credential>`; anything else is a 401 in OpenAI's error shape. The
    router is given the credential through the agent's authenticated state; a client that reaches
    the worker's port directly has none, and so does not skip the router's API keys."""

    def __init__(self, app: ASGIApp, credential: str) -> None:
        super().__init__(app, credential.encode())

    async def refuse(self, scope: Scope, send: Send, given: bytes | None) -> None:
        message = ("this worker answers only fleet's router: send requests to `fleet serve`, which checks "
                   "your API key and forwards them")
        await _refuse(scope, send, {"message": message, "type": "invalid_request_error", "param": None,
                                    "code": "invalid_worker_credential"}, b"fleet-worker")


async def _refuse(scope: Scope, send: Send, error: dict[str, object], realm: bytes) -> None:
    """A 401 with `error` as its JSON body; a websocket is closed before it is accepted (the
    server answers its handshake 403)."""
    if scope["type"] != "http":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="%s"' % realm)]})
    await send({"type": "http.response.body", "body": body})


def worker_guard(app: ASGIApp) -> ASGIApp:
    """`app` behind the credential the agent gave this worker. The variable is taken out of the
    environment so that nothing the worker starts inherits it. A worker run by hand, without one,
    serves anyone (and says so on stderr): the agent always gives one."""
    credential = os.environ.pop(WORKER_CREDENTIAL_ENV, "")
    if not credential:
        print(f"warning: {WORKER_CREDENTIAL_ENV} is not set: this worker answers anyone who reaches its port",
              file=sys.stderr, flush=True)
        return app
    return WorkerAuth(app, credential)
