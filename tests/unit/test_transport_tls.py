"""The agent transport closes its socket when a TLS node's CA file cannot be loaded at call time
(gone since the fleet file was read), rather than leaving it to the garbage collector."""

from __future__ import annotations

import gc
import socket
import warnings
from pathlib import Path

import pytest
import trio

from reconciler.core.desired import NodeSpec
from reconciler.agents.transport import AgentRequest, SocketTransport


def test_a_ca_file_gone_at_call_time_leaves_no_socket_open(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)  # connects complete in its backlog
    node = NodeSpec("node-a", "127.0.0.1", listener.getsockname()[1], tls=True, ca_file=str(tmp_path / "gone.pem"))

    async def call() -> None:
        with pytest.raises(OSError):  # FileNotFoundError from the ssl module, for the client to name
            await SocketTransport().exchange(AgentRequest("GET", node, "/v1/state", secret="s"))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        trio.run(call)
        gc.collect()  # a socket nobody closed is closed here, with a ResourceWarning
    listener.close()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
