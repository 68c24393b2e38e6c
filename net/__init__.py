"""fleet's one network layer: the HTTP/1.1 codec (httptools, net/http1.py), byte streams over
plain or TLS sockets (net/streams.py, net/sockio.py), the server loop that serves an ASGI app
within a connection cap (net/server.py) and the client (net/client.py). Imported by `reconciler`
and `agent` alike, importing neither; it imports `wire` alone (tests/unit/test_boundaries.py)."""
