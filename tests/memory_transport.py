"""Agents in memory, for unit tests: reconciler/agents/transport.py's Transport seam answered by a
handler or by an ASGI app (the agent's), the request parsed and the answer's head written by
net/http1.py (the codec the agent's own server runs), and the answer read back by the agent
client's reader (transport.read_answer), a piece at a time as from a socket."""

from __future__ import annotations

from typing import Awaitable, Callable

import trio
from starlette.types import ASGIApp, Message

from net.http1 import Limits, Parser, response_head
from net.server import asgi_scope
from reconciler.agents.transport import READ, AgentRequest, read_answer

__all__ = ["Answer", "MemoryTransport", "asgi"]

Answer = Callable[[bytes], Awaitable[bytes]]  # a request's bytes → the raw bytes of the response


class MemoryTransport:
    """The request's bytes go to `answer` (an ASGI app through `asgi`, or a handler that writes
    raw bytes) and its response is read by `read_answer`, `piece` bytes at a time, as a socket's
    is. A handler raising OSError is a connection that failed."""

    def __init__(self, answer: Answer, *, piece: int = READ) -> None:
        self.answer, self.piece = answer, piece

    async def exchange(self, request: AgentRequest) -> tuple[int, bytes]:
        raw = await self.answer(request.encode())
        at = 0

        async def receive(n: int) -> bytes:
            nonlocal at
            await trio.lowlevel.checkpoint()
            out = raw[at:at + min(n, self.piece)]
            at += len(out)
            return out
        return await read_answer(request.node, receive)


class _Loopback:
    """What net/server.py's asgi_scope asks of a connection, for one that is not a socket."""

    scheme = "http"
    sock = None

    @staticmethod
    def addresses() -> tuple[tuple[str, int], tuple[str, int]]:
        return ("127.0.0.1", 1), ("127.0.0.1", 80)


def asgi(app: ASGIApp) -> Answer:
    """An ASGI app (the agent's) as an Answer: the request parsed by net's Parser into the scope
    net's server gives an app (without the socket extension: there is no socket), the response's
    head written by net's response_head, its body framed as that head says (chunked when the app
    gives no length)."""

    async def answer(request: bytes) -> bytes:
        parser = Parser(Limits())
        parser.feed(request)
        assert len(parser.ready) == 1, f"not one whole request: {request[:200]!r}"
        req = parser.ready.popleft()
        scope = asgi_scope(req, _Loopback())  # type: ignore[arg-type]
        del scope["extensions"]
        pending = [{"type": "http.request", "body": b"".join(req.body), "more_body": False}]
        complete = trio.Event()
        status, headers, parts = 500, [], []

        async def receive() -> Message:
            if pending:
                return pending.pop()
            await complete.wait()  # a streaming response listens for the client going away meanwhile
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status, headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    complete.set()

        await app(scope, receive, send)
        head, chunked, _, no_body = response_head(status, headers, req.version, keep_alive=req.keep_alive,
                                                  no_body=req.method == b"HEAD")
        content = b"" if no_body else b"".join(parts)
        if chunked:
            content = (b"%x\r\n%s\r\n" % (len(content), content) if content else b"") + b"0\r\n\r\n"
        return head + content

    return answer
