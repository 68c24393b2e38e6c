"""The agent's HTTP API: one handler per route (`routes`), the ASGI lifespan answer (`asgi`),
the server with its connection cap (`server`)."""
