"""AgentClient: the control plane's side of the agent API, on trio. Every failure becomes one of
our errors naming the node; each says whether retrying later can help."""

from __future__ import annotations

import copy
import errno
import json
import socket
import ssl
from functools import cache
from typing import Any, Callable

import fastjsonschema
import httpx
import trio
from jsonschema import Draft202012Validator

from agent.peerhttp import parse_head

from . import sockio
from .diagnostics import format_path
from .model import NodeSpec
from .schema import load_schema

ANSWER_LIMIT = 64 << 20  # an agent's answer larger than this is refused, not buffered


class AgentError(Exception):
    """A failed call to one node's agent. `code` is the stable diagnostic code."""

    code = "agent_error"
    retryable = False

    def __init__(self, node: NodeSpec, message: str) -> None:
        super().__init__(message)
        self.node = node
        self.message = message


class NodeUnreachable(AgentError):
    code = "node_unreachable"
    retryable = True

    def __init__(self, node: NodeSpec, cause: str) -> None:
        super().__init__(node, f"node {node.name!r} at {node.address}:{node.agent_port} did not answer: {cause}")
        self.cause = cause


class NodeAuthRejected(AgentError):
    code = "node_auth_rejected"

    def __init__(self, node: NodeSpec, reason: str) -> None:
        super().__init__(node, f"node {node.name!r} at {node.address}:{node.agent_port} rejected the cluster "
                               f"secret: {reason}")


class AgentProtocolError(AgentError):
    code = "agent_protocol_error"

    def __init__(self, node: NodeSpec, problem: str, field: str = "") -> None:
        where = f" (field {field})" if field else ""
        super().__init__(node, f"node {node.name!r} at {node.address}:{node.agent_port} answered "
                               f"malformed state{where}: {problem}")
        self.field = field


class AgentHTTPError(AgentError):
    code = "agent_error"

    def __init__(self, node: NodeSpec, status: int, message: str) -> None:
        super().__init__(node, f"node {node.name!r} answered HTTP {status}: {message}")
        self.status = status
        self.retryable = status >= 500


@cache
def _state_validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema("agent-state.schema.json"))


@cache
def _state_check() -> Callable[[Any], Any]:
    """The same schema compiled to Python: about 17x faster than the generic validator, which
    matters at a thousand nodes per plan. It uses only keywords that mean the same in draft 7, the
    newest fastjsonschema compiles; on a failure the generic validator names the field."""
    return fastjsonschema.compile({**copy.deepcopy(load_schema("agent-state.schema.json")),
                                   "$schema": "http://json-schema.org/draft-07/schema#"})


_ERRNO_CAUSES = {
    errno.ECONNREFUSED: "connection refused (is fleet-agent running there?)",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network unreachable",
    errno.ETIMEDOUT: "connection timed out",
    errno.ECONNRESET: "connection reset by peer",
}


def _os_errors(exc: BaseException | None, seen: set[int] | None = None) -> list[OSError]:
    """Every OSError in an exception's chain and groups (trio reports a failed connect to each
    address as a group under one "all attempts failed" error)."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return []
    seen.add(id(exc))
    found = [exc] if isinstance(exc, OSError) else []
    for inner in getattr(exc, "exceptions", ()):
        found += _os_errors(inner, seen)
    return found + _os_errors(exc.__cause__, seen) + _os_errors(exc.__context__, seen)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    os_errors = _os_errors(exc)
    for os_error in os_errors:
        if isinstance(os_error, socket.gaierror):
            return f"the address does not resolve ({os_error.strerror or os_error})"
        if os_error.errno in _ERRNO_CAUSES:
            return _ERRNO_CAUSES[os_error.errno]
    # trio's BrokenResourceError says nothing itself: the TLS or socket error under it does.
    return str(exc) or (str(os_errors[0]) if os_errors else type(exc).__name__)


class AgentClient:
    """One client for all nodes. Each call is one request on a connection of its own, closed after
    the answer: an agent is asked rarely enough (a heartbeat every 30 s, a plan, an apply's few
    calls per action) that a kept connection would be closed by the agent in between, and through
    httpx each call cost about 1 ms of CPU, most of the heartbeat's budget at a thousand nodes.
    An injected httpx transport (httpx.ASGITransport or MockTransport, for in-process tests) takes
    the same calls instead; both paths give the same errors."""

    def __init__(self, secret: str, *, timeout: float = 10.0, transport: httpx.AsyncBaseTransport | None = None,
                 ca_file: str | None = None) -> None:
        # ca_file: trust agents' certificates signed by this CA (or self-signed ones given directly).
        self._secret, self._timeout = secret, timeout
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
        self._http = (httpx.AsyncClient(headers={"Authorization": f"Bearer {secret}"}, timeout=timeout,
                                        transport=transport) if transport is not None else None)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(self, node: NodeSpec, method: str, path: str, *, raw: bool = False, ok404: bool = False,
                      json_body: Any = None) -> Any:
        if self._http is not None:
            try:
                response = await self._http.request(method, node.agent_url + path, json=json_body)
            except httpx.TransportError as exc:
                raise NodeUnreachable(node, _cause(exc)) from None
            return _answer(node, response.status_code, response.content, raw=raw, ok404=ok404)
        body = json.dumps(json_body).encode() if json_body is not None else None
        status, content = await self._exchange(node, method, path, body)
        return _answer(node, status, content, raw=raw, ok404=ok404)

    async def _exchange(self, node: NodeSpec, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        host = f"[{node.address}]" if ":" in node.address else node.address
        head = (f"{method} {path} HTTP/1.1\r\nHost: {host}:{node.agent_port}\r\n"
                f"Authorization: Bearer {self._secret}\r\nConnection: close\r\n")
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        try:
            with trio.fail_after(self._timeout):
                sock = await sockio.connect(node.address, node.agent_port)
                stream: trio.abc.Stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
                try:
                    if node.tls:
                        stream = trio.SSLStream(stream, self._ssl, server_hostname=node.address,
                                                https_compatible=True)
                    await stream.send_all(head.encode() + b"\r\n" + (body or b""))
                    return await _read_answer(node, stream)
                finally:
                    await trio.aclose_forcefully(stream)
        except trio.TooSlowError:
            raise NodeUnreachable(node, f"timed out (no answer within {self._timeout:g}s)") from None
        except (OSError, trio.BrokenResourceError) as exc:
            raise NodeUnreachable(node, _cause(exc)) from None

    async def state(self, node: NodeSpec) -> dict[str, Any]:
        data = await self.request(node, "GET", "/v1/state")
        try:
            _state_check()(data)
            return data  # type: ignore[no-any-return]
        except fastjsonschema.JsonSchemaException:
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


def _answer(node: NodeSpec, status: int, content: bytes, *, raw: bool = False, ok404: bool = False) -> Any:
    if status == 401:
        raise NodeAuthRejected(node, _error_message(content) or "401 Unauthorized")
    if status == 404 and ok404:
        return None
    if status >= 400:
        raise AgentHTTPError(node, status, _error_message(content) or f"HTTP {status}")
    if raw:
        return content
    try:
        return json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AgentProtocolError(node, f"not JSON ({exc})") from None


async def _read_answer(node: NodeSpec, stream: trio.abc.Stream) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response (Content-Length, or up to the connection's end)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        more = await stream.receive_some(65536)
        if not more:
            raise NodeUnreachable(node, "the connection closed before an answer")
        buf += more
        if len(buf) > 65536 and b"\r\n\r\n" not in buf:
            raise AgentProtocolError(node, "an oversized response head")
    head, _, body = buf.partition(b"\r\n\r\n")
    parsed = parse_head(head)
    if parsed is None:
        raise AgentProtocolError(node, "a malformed HTTP status line")
    status, headers = parsed
    if "chunked" in headers.get("transfer-encoding", "").lower():
        # fleet-agent always sends a length; something else answered in its place.
        raise AgentProtocolError(node, "a chunked answer, which fleet-agent never sends (is a proxy in between?)")
    length = headers.get("content-length")
    if length is not None and not length.isdigit():
        raise AgentProtocolError(node, f"a malformed Content-Length {length[:20]!r}")
    want = int(length) if length is not None else None  # None: the body ends with the connection
    if (want or 0) > ANSWER_LIMIT:
        raise AgentProtocolError(node, f"an answer over {ANSWER_LIMIT >> 20} MiB")
    while want is None or len(body) < want:
        more = await stream.receive_some(65536)
        if not more:
            break
        body += more
        if len(body) > ANSWER_LIMIT:
            raise AgentProtocolError(node, f"an answer over {ANSWER_LIMIT >> 20} MiB")
    if want is not None and len(body) < want:
        raise NodeUnreachable(node, f"the connection closed after {len(body)} of {want} bytes")
    return status, body if want is None else body[:want]


def _error_message(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["message"])
    except Exception:
        return content[:200].decode("utf-8", "replace")
