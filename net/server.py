"""An HTTP/1.1 server for an ASGI app: one trio task per connection, parsed by httptools.

Written for the control plane's router (reconciler/serve/front.py), whose bench (bench/relay)
showed hypercorn spending 0.8-1 ms of CPU on every request even for a three-message ASGI app and
tens of microseconds on every relayed chunk. It does what fleet's servers need and no more:
HTTP/1.1 with keep-alive and pipelining, parsed by httptools (llhttp, the parser uvicorn uses);
the app called in the connection's own task; the response head held back until the first body
bytes so that head and first chunk leave in one write; chunks framed without a per-chunk event
object; `http.disconnect` delivered the moment the client goes away; TLS when given a
certificate. No HTTP/2, websockets or lifespan.

What a client can make it hold is bounded: one request being read, at most Limits.read_ahead
bytes of the next while a response is in flight, and `cap` connections at once (the caller
derives it from the process's descriptor limit), beyond which the connection waiting longest for
a request gives its place, and when none waits the newest is answered 503 and closed.
"""

from __future__ import annotations

import logging
import math
import socket
from typing import Any, Callable
from urllib.parse import unquote

import trio
from starlette.types import ASGIApp, Message

from net import sockio
from net.http1 import SLICE, Admit, Limits, Parser, Refused, Request, error_response, response_head
from net.streams import ByteStream, PlainStream, ServerTls

__all__ = ["Server", "Limits", "connection_cap"]

READ = 64 * 1024
ACCEPT_ROW = 64  # connections accepted in a row before the accepting task yields
LINGER_MAX = 32  # busy refusals lingering at once (connection_cap keeps their descriptors)
WARN_EVERY_S = 10.0  # a refusal or an eviction is logged at most this often
# The ASGI scope extension that hands an app the connection's own socket (the agent's blob
# answers send their bodies by sendfile on it): {"socket": socket.socket}. The server owns it: an
# app may write on it, set its options or shut it down, never close it. An app that writes a body
# on it itself sends its head with `connection: close` and an empty, unfinished body message
# first (which sends the head), and ends with an empty last one.
SOCKET_EXTENSION = "fleet.socket"
LINGER_S = 1.0  # a refused client's bytes are read (and dropped) this long, so the 503 is not reset
# After a refusal on a connection (a 401 before the body, a 413), at most this much more of what
# the client sends is read and dropped (within LINGER_S) before closing: enough for the refusal
# to reach a client that is still sending, not enough to take in the body it refused.
REFUSED_LINGER_BYTES = 64 * 1024


def connection_cap(nofile: int, reserved: int, per_connection: int = 2) -> int:
    """Connections a server of this package holds at once, from the process's soft RLIMIT_NOFILE:
    what is left after `reserved` (the process's own descriptors, which the caller counts) and the
    busy refusals still lingering (LINGER_MAX), divided by the descriptors a connection may hold
    (its socket and one more: a relayed stream's upstream, a blob answer's file); never under 16."""
    return max(16, (nofile - reserved - LINGER_MAX) // per_connection)


class ClientGone(Exception):
    """The client closed its side; nothing more can be sent."""


class Server:
    """`cap` connections at once. When all places are held, the connection waiting longest for a
    request (idle, or a request still arriving) gives its place to the newest: first one never
    trusted, then a trusted one. Only when every place has a request in flight is one more
    answered 503 `too_many_connections` (`busy`, or a message naming `name` and the cap) and
    closed after lingering (over TLS, closed: a 503 would cost a handshake first); refusals and
    evictions are logged at most every WARN_EVERY_S.

    `trusts(scope)`, asked of each request before the app sees it, says whether it proves its
    client (the agent: the cluster secret); a connection that has is kept alive between requests
    for Limits.keep_alive, and evicted only after every untrusted one; one that has not must send
    its next request's first byte within Limits.stranger_idle. `privileged(address)` says
    whether a client address is trusted from its first byte (the agent's control plane); the last
    `reserve` places are theirs alone.

    `on_drop(reason)` is told of every connection dropped to stay within the cap: "evicted" or
    "refused". `admit` sees each request's head before its body is read (http1.Parser): the
    router's API key check. `name` is the server's in its refusals ("fleet serve"), `cap_hint`
    what its busy warning says sets the cap, `log` where it logs."""

    def __init__(self, app: ASGIApp, limits: Limits | None = None, *, cap: int, tls: ServerTls | None = None,
                 on_drop: Callable[[str], None] | None = None, admit: Admit | None = None,
                 name: str = "the server", cap_hint: str = "", log: logging.Logger | None = None,
                 busy: str = "", trusts: Callable[[dict[str, Any]], bool] | None = None,
                 privileged: Callable[[str], bool] | None = None, reserve: int = 0) -> None:
        self.app = app
        self.admit = admit
        self.limits = limits or Limits()
        self.cap = cap
        self.name, self.cap_hint = name, cap_hint
        self.busy = busy or f"{name} is at its limit of {cap} connections, all busy; retry shortly"
        self.log = log or logging.getLogger("fleet")
        self.tls = tls
        self.trusts, self.privileged = trusts, privileged
        self.reserve = reserve if privileged is not None else 0
        self.on_drop = on_drop or (lambda reason: None)
        self.live = 0  # connections counted against the cap
        self.unstarted = 0  # of those, accepted and not yet run (_accept)
        # Connections waiting for a request (idle, or a request still arriving), the one waiting
        # longest first: the first to go when a new connection needs a place; never trusted, then trusted.
        self.waiting: dict[Connection, trio.CancelScope] = {}
        self.known: dict[Connection, trio.CancelScope] = {}
        self.lingering = 0
        self.refused = self.evicted = 0
        self.warned_at = self.evict_warned_at = -math.inf
        self.closing = False

    def wait(self, conn: Connection, scope: trio.CancelScope) -> None:
        """`conn` waits for a request under `scope` (cancelled to evict it), the newest to wait."""
        (self.known if conn.trusted else self.waiting)[conn] = scope

    def unwait(self, conn: Connection) -> None:
        self.waiting.pop(conn, None)
        self.known.pop(conn, None)

    @staticmethod
    def listen(host: str, port: int) -> list[socket.socket]:
        """Bind first, outside any nursery, so that a port in use is a plain OSError for the caller."""
        return sockio.listen(host, port)

    async def serve(self, listeners: list[socket.socket], stop: trio.Event) -> None:
        """Serve until `stop` is set; then stop accepting, close idle connections, let in-flight
        requests finish within the grace period, and cut what is left."""
        try:
            async with trio.open_nursery() as connections:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept, listener, connections)
                    await stop.wait()
                    accepting.cancel_scope.cancel()
                for listener in listeners:
                    sockio.close(listener)
                self.closing = True
                for conn, scope in list(self.waiting.items()) + list(self.known.items()):
                    if conn.idle:
                        scope.cancel()
                connections.cancel_scope.deadline = trio.current_time() + self.limits.grace
        finally:
            for listener in listeners:
                sockio.close(listener)

    async def _accept(self, listener: socket.socket, connections: trio.Nursery) -> None:
        # A listener bound to one address is every connection's own address (the simulated agents:
        # one listener per agent); on a wildcard each connection is asked its own.
        local = sockio.bound_address(listener)
        in_a_row = 0
        while True:
            # Accept first and wait only once the backlog is empty: connections arriving together
            # (a fan-out's) are taken in a row, without a trip through trio's epoll each; every
            # ACCEPT_ROW of them the loop yields, so a flood of connections cannot hold the thread.
            try:
                sock, peer = listener.accept()
            except BlockingIOError:
                in_a_row = 0
                await trio.lowlevel.wait_readable(listener)
                continue
            except OSError as exc:  # EMFILE and the like: say so, back off, keep serving
                self.log.warning("accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            in_a_row += 1
            if in_a_row >= ACCEPT_ROW:
                in_a_row = 0
                await trio.lowlevel.checkpoint()
            sockio.prepare(sock)
            peer = peer[:2]
            privileged = self.privileged is not None and self.privileged(peer[0])
            limit = self.cap if privileged else self.cap - self.reserve
            # Connections of this row whose tasks have not run yet have not read their requests
            # (so are in no table): with no stranger waiting to give its place, let them run
            # before a trusted idle connection is evicted or this one refused for want of room.
            while self.live >= limit and not self.waiting and self.unstarted:
                await trio.lowlevel.cancel_shielded_checkpoint()
            while self.live >= limit and self.evict():
                pass
            if self.live >= limit:
                self.refuse_busy(sock, connections)
                continue
            self.live += 1
            self.unstarted += 1
            connections.start_soon(self.connection, sock, privileged, peer, local)

    def evict(self) -> bool:
        """Close the connection waiting longest for a request to make room (one never trusted
        first); False if none waits."""
        table = self.waiting or self.known
        if not table:
            return False
        conn = next(iter(table))
        table.pop(conn).cancel()
        conn.counted = False
        self.live -= 1
        self.evicted += 1
        self.on_drop("evicted")
        now = trio.current_time()
        if now - self.evict_warned_at >= WARN_EVERY_S:
            self.evict_warned_at = now
            self.log.warning("[connections_evicted] all %d places were held: the oldest idle connection gives its "
                             "place to the newest (untrusted ones first); %d evicted so far", self.cap, self.evicted)
        return True

    def refuse_busy(self, sock: socket.socket, connections: trio.Nursery) -> None:
        self.refused += 1
        self.on_drop("refused")
        now = trio.current_time()
        if now - self.warned_at >= WARN_EVERY_S:
            self.warned_at = now
            self.log.warning("[too_many_connections] refusing connections: all %d allowed are held, each with a "
                             "request in flight%s; %d refused so far", self.cap, self.cap_hint, self.refused)
        if self.tls is not None or self.lingering >= LINGER_MAX:
            sockio.close(sock)  # a 503 over TLS would cost a handshake first
            return
        connections.start_soon(self._refuse_busy, sock)

    async def _refuse_busy(self, sock: socket.socket) -> None:
        self.lingering += 1
        try:
            with trio.move_on_after(LINGER_S):
                await sockio.send(sock, error_response(503, self.busy, "too_many_connections", b"retry-after: 1\r\n"))
                sock.shutdown(socket.SHUT_WR)
                # Take what the client sent: closing with unread bytes would reset the
                # connection and could destroy the answer before it is read.
                while await sockio.receive(sock, READ):
                    pass
        except OSError:
            pass
        finally:
            self.lingering -= 1
            sockio.close(sock)

    async def connection(self, sock: socket.socket, privileged: bool = False, peer: tuple[str, int] | None = None,
                         local: tuple[str, int] | None = None) -> None:
        self.unstarted -= 1
        conn = Connection(self, self.tls.wrap(sock) if self.tls is not None else PlainStream(sock, peer, local))
        conn.trusted = privileged
        try:
            await conn.run()
        finally:
            conn.stream.close()
            conn.parser.release()
            self.unwait(conn)
            if conn.counted:
                self.live -= 1


class Connection:
    """One client connection: its stream, its parser, and the bytes read ahead but not parsed."""

    def __init__(self, front: Server, stream: ByteStream) -> None:
        self.front, self.stream = front, stream
        self.parser = Parser(front.limits, front.admit)
        self.pending = bytearray()  # read, not yet parsed: at most Limits.read_ahead while a response runs
        self.counted = True  # against the front's cap (until evicted)
        self.trusted = False  # a request proved its client (Server.trusts), or its address did
        self.fresh = True  # no request read yet

    def judge(self, request: Request, scope: dict[str, Any] | None = None) -> bool:
        """Whether this connection is trusted, asking Server.trusts of `request` (its head) once."""
        if not self.trusted and not request.judged and self.front.trusts is not None:
            self.trusted = self.front.trusts(scope if scope is not None else asgi_scope(request, self.stream))
        request.judged = True
        return self.trusted

    @property
    def idle(self) -> bool:
        return self.parser.current is None and not self.parser.ready and not self.pending

    async def run(self) -> None:
        limits = self.front.limits
        try:
            if self.stream.handshakes:
                with trio.CancelScope() as handshake:  # a TLS handshake in progress can make room too
                    self.front.wait(self, handshake)
                    try:
                        await self.stream.start(limits.read_timeout)
                    finally:
                        self.front.unwait(self)
                if handshake.cancelled_caught:
                    return
            while not self.front.closing:
                request = await self.next_request()
                if request is None:
                    return
                exchange = Exchange(self, request)
                await exchange.run()
                if not exchange.keep_alive:
                    return
        except Refused as exc:
            await self.refuse(exc.status, str(exc), exc.code)
        except trio.TooSlowError:
            await self.refuse(408, f"the request did not arrive within {limits.read_timeout:g}s", "request_timeout")
        except (OSError, trio.ClosedResourceError, ClientGone):
            return

    async def next_request(self) -> Request | None:
        """The next whole request; None when the client closes, stays idle past keep_alive, or
        the connection is closed to make room (evicted) or for shutdown."""
        if self.fresh:
            # A connection's first request is most often in its socket by the time it is
            # accepted (every connection of a fan-out, and all but a few of a scale bench's):
            # read and parsed here it takes no trip through trio's epoll, no deadline and no
            # place among the connections waiting. Only the first: a client pipelining without
            # end still meets a checkpoint at each of its later requests.
            self.fresh = False
            data = self.stream.receive_now(READ)
            if data is not None:
                if not data:
                    return None
                if len(data) <= SLICE:
                    self.parser.feed(data)
                else:
                    self.pending += data
                    self.parser.feed_some(self.pending)
                if self.parser.ready:
                    return self.parser.ready.popleft()
        elif self.parser.ready or self.pending:
            # Read already, behind the last request: served without this checkpoint, every request
            # of a 64 KiB read of small pipelined ones would be answered in one step, and a few
            # such strangers would hold the thread (and the control plane's requests) for seconds.
            await trio.lowlevel.checkpoint()
        return await self.wait_request()

    async def wait_request(self) -> Request | None:
        parser, limits = self.parser, self.front.limits
        head_deadline = math.inf
        idle_s = limits.keep_alive if self.trusted or limits.stranger_idle is None else limits.stranger_idle
        with trio.CancelScope() as waiting:
            self.front.wait(self, waiting)
            try:
                while True:
                    parser.feed_some(self.pending)
                    current = parser.current
                    if current is not None and current.head_done and not current.judged and self.judge(current):
                        # A trusted request whose head is whole is in flight while its body arrives: its
                        # place is no longer one to give (the agent's authenticated POSTs).
                        self.front.unwait(self)
                    if current is not None and current.head_done and not current.continued:
                        current.continued = True
                        await self.stream.send(b"HTTP/1.1 100 Continue\r\n\r\n", limits.write_timeout)
                    if parser.ready:
                        return parser.ready.popleft()
                    if parser.refused is not None:  # met behind requests now answered
                        raise parser.refused
                    if current is not None:
                        # The head must be whole within read_timeout of its first byte (a client
                        # that sends a byte now and then cannot hold a connection forever); a body
                        # must keep arriving, a read at least every read_timeout.
                        if not current.head_done and head_deadline == math.inf:
                            head_deadline = trio.current_time() + limits.read_timeout
                        deadline = head_deadline if not current.head_done else trio.current_time() + limits.read_timeout
                        with trio.fail_at(deadline):
                            data = await self.stream.receive(READ)
                    else:
                        # Idle past idle_s ends the connection as an eviction does: by this scope.
                        waiting.deadline = trio.current_time() + idle_s
                        data = await self.stream.receive(READ)
                        waiting.deadline = math.inf
                    if not data:
                        return None
                    if len(data) <= SLICE:
                        parser.feed(data)  # the usual case: one request in one read, parsed as it is
                    else:
                        self.pending += data
            finally:
                self.front.unwait(self)
        return None

    async def refuse(self, status: int, message: str, code: str) -> None:
        """Answer with a JSON error and `connection: close` (the caller closes). What the client
        is still sending (the body of a request refused by its head) is not taken in: at most
        REFUSED_LINGER_BYTES more are read and dropped, so that closing with them unread does
        not reset the connection before the answer is delivered; then the caller closes."""
        try:
            await self.stream.send(error_response(status, message, code), self.front.limits.write_timeout)
            self.stream.end_send()
            with trio.move_on_after(LINGER_S):
                dropped = 0
                while dropped < REFUSED_LINGER_BYTES:
                    data = await self.stream.receive(min(READ, REFUSED_LINGER_BYTES - dropped))
                    if not data:
                        break
                    dropped += len(data)
        except (OSError, trio.ClosedResourceError, trio.TooSlowError):
            pass


def asgi_scope(request: Request, stream: ByteStream) -> dict[str, Any]:
    path, _, query = request.target.partition(b"?")
    client, server = stream.addresses()
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.version, "method": request.method.decode("latin-1"),
            "scheme": stream.scheme, "path": unquote(path.decode("latin-1")), "raw_path": path,
            "query_string": query, "root_path": "", "headers": request.headers,
            "client": client, "server": server, "state": {},
            "extensions": {SOCKET_EXTENSION: {"socket": stream.sock}}}


class Exchange:
    """One request and its response: the ASGI scope, receive and send of a single call of the app."""

    def __init__(self, conn: Connection, request: Request) -> None:
        self.front, self.conn, self.stream, self.request = conn.front, conn, conn.stream, request
        self.keep_alive = request.keep_alive
        self.head: bytes | None = None
        self.started = False      # bytes of the response went out
        self.body_sent = False
        self.finished = False
        self.gone = False
        self.ended: trio.Event | None = None  # made when a receive() has to wait for the end
        self.chunked = False
        self.no_body = request.method == b"HEAD"

    def scope(self) -> dict[str, Any]:
        return asgi_scope(self.request, self.stream)

    async def run(self) -> None:
        scope = self.scope()
        self.conn.judge(self.request, scope)
        try:
            await self.front.app(scope, self.receive, self.send)
        except ClientGone:
            raise
        except Exception:
            self.front.log.exception("error while answering %s %s", self.request.method.decode("latin-1"),
                          self.request.target.decode("latin-1"))
            if not self.started:
                self.keep_alive = False
                await self.conn.refuse(500, f"internal error in {self.front.name} (see its log)", "internal_error")
                return
        if not self.started:
            self.keep_alive = False
            await self.conn.refuse(500, f"{self.front.name} sent no response", "internal_error")
        elif not self.finished:
            raise ClientGone()  # a response cut short cannot be completed on this connection

    async def receive(self) -> Message:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": b"".join(self.request.body), "more_body": False}
        # After the body, receive() waits for the client to go away (ASGI apps use it to stop
        # work nobody will read). What the client sends meanwhile is kept unparsed, up to
        # read_ahead bytes; then the socket is left alone until the response ends (TCP holds the
        # client back), and a client that leaves is noticed by the next send instead.
        conn, limit = self.conn, self.front.limits.read_ahead
        while not (self.gone or self.finished):
            room = limit - len(conn.pending)
            if room <= 0:
                self.ended = self.ended or trio.Event()
                await self.ended.wait()
                break
            try:
                data = await self.stream.receive(min(READ, room))
            except (OSError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.gone = True
                break
            conn.pending += data
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.gone:
            raise ClientGone()
        kind = message["type"]
        if kind == "http.response.start" and self.head is None:
            framing = response_head(message["status"], message.get("headers", []), self.request.version,
                                    keep_alive=self.keep_alive, no_body=self.no_body)
            self.head, self.chunked, self.keep_alive, self.no_body = framing
            return
        if kind != "http.response.body" or self.head is None or self.finished:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        out = b"" if self.started else self.head  # the head leaves with the first body bytes
        data = message.get("body", b"")
        if data and not self.no_body:
            out += b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data
        if not message.get("more_body", False):
            self.finished = True
            if self.chunked:
                out += b"0\r\n\r\n"
        if out:
            self.started = True
            try:
                await self.stream.send(out, self.front.limits.write_timeout)
            except (OSError, trio.ClosedResourceError, trio.TooSlowError):
                self.gone = True
                self._ended()
                raise ClientGone() from None
        if self.finished:
            self._ended()

    def _ended(self) -> None:
        if self.ended is not None:
            self.ended.set()
