"""Small network helpers shared by the demo and the tests."""

from __future__ import annotations

import socket


def free_port(*addresses: str) -> int:
    """A TCP port free on every one of `addresses` (so cluster members can share it)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = int(s.getsockname()[1])
        try:
            for addr in addresses:
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((addr, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on all of " + ", ".join(addresses))
