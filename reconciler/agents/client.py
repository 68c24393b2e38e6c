"""AgentClient: the control plane's side of the agent API, on trio. Every failure becomes one of
our errors naming the node (reconciler/agents/errors.py); each says whether retrying later can help.
How the bytes travel is the injected Transport (reconciler/agents/transport.py)."""

from __future__ import annotations

import copy
import json
import math
import re
import ssl
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Callable, Sequence

import trio

from wire import live
from wire.live import Live

from reconciler.agents import bounded
from reconciler.agents.errors import AgentError, AgentHTTPError, AgentProtocolError, NodeAuthRejected, NodeTlsFailed, NodeUnreachable, NotAnAgent, cause, excerpt
from reconciler.core.diagnostics import format_path
from reconciler.core.desired import NodeSpec
from reconciler.schemas import Validator, load_schema
from reconciler.agents.batch import TimedOut, batchable, exchange_all
from reconciler.agents.transport import AgentRequest, SocketTransport, Transport

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator

__all__ = ["AgentClient", "Unchanged", "AgentError", "AgentHTTPError", "AgentProtocolError", "NodeAuthRejected",
           "NodeTlsFailed", "NodeUnreachable", "NotAnAgent"]


# What agent/app.generation makes. Anything else (a state from something else, a damaged cache) is
# not asked about: it would go into the request's head as it is, CR and LF included.
_GENERATION = re.compile(r"[0-9a-f]{32}")


def _askable(unless: str | None) -> str | None:
    return unless if unless is not None and _GENERATION.fullmatch(unless) else None


def _tls_error(exc: BaseException | None) -> ssl.SSLError | None:
    """The TLS error under a failed call (trio raises BrokenResourceError from it), if any."""
    while exc is not None and not isinstance(exc, ssl.SSLError):
        exc = exc.__cause__ or exc.__context__
    return exc


@cache
def _state_validator() -> Draft202012Validator:
    return Validator(load_schema("agent-state.schema.json"))


@cache
def _state_check() -> Callable[[Any], Any]:
    """The same schema compiled to Python: about 17x faster than the generic validator, which
    matters at a thousand nodes per plan. It uses only keywords that mean the same in draft 7, the
    newest fastjsonschema compiles; on a failure the generic validator names the field."""
    import fastjsonschema  # here, not at the top: a plan whose agents all answer 304 checks no state

    return fastjsonschema.compile({**copy.deepcopy(load_schema("agent-state.schema.json")),
                                   "$schema": "http://json-schema.org/draft-07/schema#"})


@dataclass(frozen=True, slots=True)
class Unchanged:
    """GET /v1/state's 304: the state is still the generation asked about. `live`: its moving values
    now (wire/live.py); None from an agent that does not send them, or sent something else."""

    live: Live | None


class AgentClient:
    """One client for all nodes. Each call is one request on a connection of its own, closed after
    the answer: an agent is asked rarely enough (a heartbeat every 30 s, a plan, an apply's few
    calls per action) that a kept connection would be closed by the agent in between."""

    def __init__(self, secret: str, *, timeout: float = 10.0, transport: Transport | None = None,
                 ca_file: str | None = None) -> None:
        # ca_file: for the default transport, trust agents' certificates signed by this CA.
        self._secret, self._timeout = secret, timeout
        self._transport = transport if transport is not None else SocketTransport(ca_file)

    async def aclose(self) -> None:
        pass  # nothing is kept between calls

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(self, node: NodeSpec, method: str, path: str, *, raw: bool = False, ok404: bool = False,
                      json_body: Any = None, unless: str | None = None, timeout: float | None = None) -> Any:
        """`unless`: a generation the caller holds (If-None-Match); None when the agent says unchanged
        (304). `timeout`: this call's, instead of the client's; math.inf: none of its own, the caller's
        deadline bounds it (observe moves one deadline per worker: a scope per call was a tenth of a
        quiet heartbeat's CPU at 10,000 agents)."""
        status, content = await self._exchange(node, method, path, json_body, unless, timeout)
        return _answer(node, status, content, raw=raw, ok404=ok404, request=(method, path))

    async def _exchange(self, node: NodeSpec, method: str, path: str, json_body: Any, unless: str | None,
                        timeout: float | None) -> tuple[int, bytes]:
        body = json.dumps(json_body).encode() if json_body is not None else None
        timeout = self._timeout if timeout is None else timeout
        request = AgentRequest(method, node, path, body, self._secret, _askable(unless))
        try:
            if timeout == math.inf:
                status, content = await self._transport.exchange(request)
            else:
                with trio.fail_after(timeout):
                    status, content = await self._transport.exchange(request)
        except trio.TooSlowError:
            raise NodeUnreachable(node, f"timed out (no answer within {timeout:g}s)") from None
        except (OSError, trio.BrokenResourceError) as exc:
            tls = _tls_error(exc)
            if tls is not None:
                why = (f"certificate verify failed: {tls.verify_message}"
                       if isinstance(tls, ssl.SSLCertVerificationError) else str(tls))
                raise NodeTlsFailed(node, why) from None
            raise NodeUnreachable(node, cause(exc)) from None
        return status, content

    async def state(self, node: NodeSpec, unless: str | None = None,
                    timeout: float | None = None) -> dict[str, Any] | Unchanged:
        """The node's state, checked against the schema; Unchanged when it is still generation `unless`."""
        unless = _askable(unless)
        status, content = await self._exchange(node, "GET", "/v1/state", None, unless, timeout)
        return _state(node, status, content, unless)

    def batches(self, node: NodeSpec) -> bool:
        """Whether states() asks this node in its batch: a one-shot socket transport (not the
        heartbeat's, which keeps connections), plain HTTP to an address."""
        return isinstance(self._transport, SocketTransport) and not self._transport.keeps and batchable(node)

    async def states(self, asks: Sequence[tuple[NodeSpec, str | None]], *, concurrency: int,
                     timeout: float) -> list[dict[str, Any] | Unchanged | AgentError | TimedOut]:
        """state() for many nodes at once (each one that batches(), with its `unless`), on one
        epoll (burst.py): each node's state, Unchanged, the error that stands in for it, or
        TimedOut when it did not answer within `timeout` seconds."""
        asks = [(node, _askable(unless)) for node, unless in asks]
        requests = [AgentRequest("GET", node, "/v1/state", None, self._secret, unless) for node, unless in asks]
        out: list[dict[str, Any] | Unchanged | AgentError | TimedOut] = []
        for (node, unless), result in zip(asks, await exchange_all(requests, concurrency=concurrency,
                                                                   timeout=timeout)):
            try:
                if isinstance(result, BaseException):
                    raise result
                out.append(_state(node, *result, unless))
            except OSError as exc:
                out.append(NodeUnreachable(node, cause(exc)))
            except (AgentError, TimedOut) as exc:
                out.append(exc)
            except Exception as exc:  # one answer that breaks the reading is its node's error, not the batch's
                out.append(AgentProtocolError(node, f"an answer that could not be read ({type(exc).__name__})"))
        return out

    async def manifest(self, node: NodeSpec, digest: str) -> bytes:
        return await self.request(node, "GET", f"/v1/manifests/{digest}", raw=True)  # type: ignore[no-any-return]

    async def weights(self, node: NodeSpec, digest: str) -> dict[str, Any] | None:
        """Presence or progress of a model on a node; None when the node neither holds nor fetches it."""
        return await self.request(node, "GET", f"/v1/weights/{digest}", ok404=True)  # type: ignore[no-any-return]

    async def fetch(self, node: NodeSpec, digest: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request(node, "PUT", f"/v1/weights/{digest}", json_body=body)  # type: ignore[no-any-return]

    async def delete_weights(self, node: NodeSpec, digest: str) -> None:
        await self.request(node, "DELETE", f"/v1/weights/{digest}", ok404=True)

    async def start_server(self, node: NodeSpec, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request(node, "POST", "/v1/servers", json_body=body)  # type: ignore[no-any-return]

    async def server(self, node: NodeSpec, sid: str) -> dict[str, Any] | None:
        return await self.request(node, "GET", f"/v1/servers/{sid}", ok404=True)  # type: ignore[no-any-return]

    async def stop_server(self, node: NodeSpec, sid: str) -> None:
        await self.request(node, "DELETE", f"/v1/servers/{sid}", ok404=True)


def _state(node: NodeSpec, status: int, content: bytes, unless: str | None) -> dict[str, Any] | Unchanged:
    """An answer to GET /v1/state: the state, checked against the schema, or Unchanged (a 304)."""
    if status == 304:
        if unless is None:
            raise AgentProtocolError(node, "304 Not Modified to a request that named no generation")
        return Unchanged(live.decode(content) if content else None)
    data = _answer(node, status, content)
    check = _state_check()
    from fastjsonschema import JsonSchemaException  # loaded by _state_check(): a lookup

    try:
        check(data)
        return data  # type: ignore[no-any-return]
    except JsonSchemaException:
        pass
    errors = sorted(_state_validator().iter_errors(data), key=lambda e: len(e.absolute_path))
    if errors:
        err = errors[0]
        field = format_path(tuple(err.absolute_path))
        if err.validator == "required":
            missing = [k for k in err.validator_value if k not in err.instance]
            field = format_path(tuple(err.absolute_path) + (missing[0],)) if missing else field
            raise AgentProtocolError(node, "a required field is missing", field)
        raise AgentProtocolError(node, err.message, field)
    raise AgentProtocolError(node, "the answer does not match schemas/agent-state.schema.json")


def _answer(node: NodeSpec, status: int, content: bytes, *, raw: bool = False, ok404: bool = False,
            request: tuple[str, str] = ("GET", "/v1/state")) -> Any:
    """The answer's value, or the error it means. An agent's errors are JSON ({"error": {"message"}});
    a 4xx without that, or a success that is not JSON, comes from something that is not an agent."""
    if status == 304 or (status == 404 and ok404):
        return None
    if status >= 400:
        message = _error_message(content)
        if message is None and status < 500:
            raise NotAnAgent(node, *request, status, "", content)
        if status == 401:
            raise NodeAuthRejected(node, message or "401 Unauthorized")
        # A 5xx without the agent's JSON may be a proxy in front of an agent that is down: retryable.
        err = AgentHTTPError(node, status, message or f"HTTP {status} (it sent {excerpt(content)})")
        err.agent_code = _error_code(content)
        raise err
    if raw:
        return content
    try:
        return bounded.loads(content)
    except bounded.NotJson:
        raise NotAnAgent(node, *request, status, " with a body that is not JSON", content) from None
    except bounded.Unbounded as exc:
        raise AgentProtocolError(node, exc.problem, exc.field) from None


def _error_code(content: bytes) -> str | None:
    """The stable code of an agent's error answer (model_not_held, server_exists, ...)."""
    try:
        code = bounded.loads(content)["error"]["code"]
        return code if isinstance(code, str) else None
    except (ValueError, KeyError, TypeError):  # bounded.Unbounded is a ValueError
        return None


def _error_message(content: bytes) -> str | None:
    """The message of an agent's error answer; None for anything else."""
    try:
        error = bounded.loads(content)["error"]
        return str(error["message"]) if isinstance(error, dict) else None
    except (ValueError, KeyError, TypeError):  # bounded.Unbounded is a ValueError
        return None
