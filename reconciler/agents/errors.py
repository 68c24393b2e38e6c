"""The errors of a call to an agent: each names the node, has a stable code, and says whether
asking again later can help (`retryable`, which the executor acts on)."""

from __future__ import annotations

import errno
import json
import socket

from reconciler.core.desired import NodeSpec


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


class NodeTlsFailed(NodeUnreachable):
    """The agent's certificate was not accepted (not valid for the node's hostname, signed by no CA
    fleet trusts, expired) or TLS itself failed: asking again will not change the certificate."""

    code = "node_tls_failed"
    retryable = False

    def __init__(self, node: NodeSpec, cause: str) -> None:
        AgentError.__init__(self, node, f"node {node.name!r} at {node.address}:{node.agent_port}: TLS failed, "
                                        f"its certificate checked as {node.hostname or node.address!r}: {cause}")
        self.cause = cause


class AgentProtocolError(AgentError):
    code = "agent_protocol_error"

    def __init__(self, node: NodeSpec, problem: str, field: str = "") -> None:
        where = f" (field {field})" if field else ""
        super().__init__(node, f"node {node.name!r} at {node.address}:{node.agent_port} answered "
                               f"malformed state{where}: {problem}")
        self.field = field


class NotAnAgent(AgentProtocolError):
    """Something answers at the node's address, and it is not a fleet agent (a web server's 404
    page, a proxy's HTML): said so, with at most a short excerpt of what it sent."""

    code = "not_a_fleet_agent"

    def __init__(self, node: NodeSpec, method: str, path: str, status: int, problem: str, body: bytes) -> None:
        AgentError.__init__(self, node, f"node {node.name!r} at {node.address}:{node.agent_port} is not a fleet "
                                        f"agent: {method} {path} answered {status}{problem} "
                                        f"(it sent {excerpt(body)})")
        self.field = ""
        self.status = status


def excerpt(body: bytes, limit: int = 60) -> str:
    """The start of an answer, safe to print in a terminal or a log: whitespace runs made one space,
    at most `limit` characters, quoted and escaped as a JSON string in ASCII (a foreign server's
    bytes may hold terminal control sequences)."""
    text = " ".join(body[:limit * 4].decode("utf-8", "replace").split())
    if not text:
        return "an empty body"
    return json.dumps(text[:limit]) + ("…" if len(text) > limit else "")


class AgentHTTPError(AgentError):
    code = "agent_error"
    agent_code: str | None = None  # the agent's own code for its refusal, when it gave one

    def __init__(self, node: NodeSpec, status: int, message: str) -> None:
        super().__init__(node, f"node {node.name!r} answered HTTP {status}: {message}")
        self.status = status
        self.retryable = status >= 500


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


def cause(exc: BaseException) -> str:
    """Why a connection failed, in words: the errno's meaning where we know it."""
    os_errors = _os_errors(exc)
    for os_error in os_errors:
        if isinstance(os_error, socket.gaierror):
            return f"the address does not resolve ({os_error.strerror or os_error})"
        if os_error.errno in _ERRNO_CAUSES:
            return _ERRNO_CAUSES[os_error.errno]
    # trio's BrokenResourceError says nothing itself: the TLS or socket error under it does.
    return str(exc) or (str(os_errors[0]) if os_errors else type(exc).__name__)
