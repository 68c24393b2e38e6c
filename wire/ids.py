"""Names both sides agree on: a server's id "CLUSTER@NODE" and the plan's addresses built from it."""

from __future__ import annotations


def server_id(cluster: str, node: str) -> str:
    """The id of cluster `cluster`'s server on `node`, as the agent reports it."""
    return f"{cluster}@{node}"


def split_server_id(sid: str) -> tuple[str, str | None]:
    """(cluster, node) of a server id; node None for an id fleet did not make (no '@')."""
    cluster, at, node = sid.partition("@")
    return (cluster, node) if at else (sid, None)


def server_address(cluster: str, node: str) -> str:
    """The plan address of a server: "server.CLUSTER@NODE"."""
    return f"server.{server_id(cluster, node)}"


def replica_address(model: str, node: str) -> str:
    """The plan address of weights on a node: "replica.MODEL@NODE" (MODEL may be "name[FIRST-LAST]")."""
    return f"replica.{model}@{node}"
