"""What fleet's hand-written ASGI apps (a pipeline stage's guard, the simulator's dispatcher) share."""

from __future__ import annotations

from starlette.types import Receive, Send


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Answer an ASGI server's lifespan messages until shut-down: these apps need nothing at either."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
