"""A peer fetch's TLS handshake that fails (agent/transfer/peerhttp.py): final only when asking again meets
the same answer (the certificate, a peer that does not speak TLS); a peer that reads the hello and
closes (restarting, overloaded) leaves the fetch resumable. Real peers on loopback."""

from __future__ import annotations

import socket
from typing import Callable

import pytest
import trio

from agent.transfer.peerhttp import PeerError, get_bytes


def hangs_up(conn: socket.socket) -> None:
    conn.recv(65536)  # the ClientHello


def answers_plain_http(conn: socket.socket) -> None:
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")


@pytest.mark.parametrize("peer, code, resumable", [
    (hangs_up, "fetch_failed", True),
    (answers_plain_http, "peer_tls_failed", False),
], ids=["closes-mid-handshake", "not-tls"])
def test_a_handshake_fails_for_good_only_when_asking_again_meets_the_same(
        peer: Callable[[socket.socket], None], code: str, resumable: bool) -> None:
    async def main() -> None:
        with socket.socket() as lst:
            lst.bind(("127.0.0.1", 0))
            lst.listen(4)

            def serve() -> None:
                conn, _ = lst.accept()
                with conn:
                    peer(conn)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, serve)
                with pytest.raises(PeerError) as caught, trio.fail_after(20):
                    await get_bytes(f"https://127.0.0.1:{lst.getsockname()[1]}", "/v1/manifests/x", "s" * 16)
            assert (caught.value.code, caught.value.resumable) == (code, resumable), caught.value

    trio.run(main)
