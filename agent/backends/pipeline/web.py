"""A pipeline stage's HTTP side and its way out: 503 while the group forms, stage 0's OpenAI routes
(or a later stage's /health) once it has, 503 with the group's reason once it failed; and the
failure itself, recorded once for the whole group, then the exit."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import trio
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from agent.backends.asgi import answer_lifespan
from agent.auth import worker_guard
from agent.backends import openai_wire as wire
from agent.backends.pipeline.group import Fault, Group, GroupSpec

EXIT_FAILED = 3  # the reason is the last line of stderr and in --reason-file


class Status:
    """What the HTTP side shows; written by the stage's thread, read by the server's."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.app: ASGIApp | None = None  # stage 0's OpenAI routes, once the group formed
        self.ready = False
        self.reason: str | None = None
        self.stats: Callable[[], dict[str, int]] = dict


def _error(status: int, message: str, code: str) -> Response:
    return JSONResponse(wire.error(message, "server_error", None, code), status_code=status)


class Guard:
    """The ASGI app the stage serves: the state of the group decides who answers."""

    def __init__(self, status: Status) -> None:
        self.status = status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await answer_lifespan(receive, send)
        if scope["type"] != "http":
            return
        st, spec = self.status, self.status.spec
        if st.reason is not None:
            response = _error(503, st.reason, "pipeline_failed")
        elif not st.ready:
            response = _error(503, f"{spec.me} is starting: the pipeline group is forming", "pipeline_starting")
        elif st.app is not None:
            await st.app(scope, receive, send)
            return
        elif scope["path"] == "/health":
            response = JSONResponse({"status": "ok", "pipeline": {"group": spec.group, "rank": spec.rank,
                                                                  "world_size": spec.world_size},
                                     "stage": st.stats()})
        else:
            first = spec.stages[0]
            response = _error(404, f"{spec.me} serves /health only; requests go to stage 0 at "
                                   f"{first.address}:{first.port}", "not_found")
        await response(scope, receive, send)


class Failure:
    """Called once with the reason the stage cannot go on (later calls are ignored): the group's
    first recorded reason wins, stage 0's requests end with it, and the process exits after
    `grace_s` (long enough for the streams' error events to leave)."""

    def __init__(self, status: Status, reason_file: Path | None, grace_s: float) -> None:
        self.status, self.reason_file, self.grace_s = status, reason_file, grace_s
        self.group: Group | None = None
        self.callbacks: list[Callable[[str], None]] = []
        self.code = 0
        self._lock = threading.Lock()
        self._done = False

    def __call__(self, fault: Fault, detail: str = "") -> None:
        """`fault` ends the stage (the group's own if one was posted first); `detail`, what this
        stage saw, goes to its log only: the reason is the fault's sentence, nothing relayed."""
        with self._lock:
            if self._done:
                return
            self._done = True
        if self.group is not None:
            posted = self.group.post(fault)
            detail, fault = (detail if posted == fault else ""), posted
        reason = fault.render(self.status.spec)
        if detail:
            print(f"{reason}: {detail}", file=sys.stderr, flush=True)
        self.status.reason = reason
        self.code = EXIT_FAILED
        for callback in self.callbacks:
            callback(reason)
        if self.reason_file is not None:
            try:
                self.reason_file.write_text(reason + "\n")
            except OSError:
                pass
        print(reason, file=sys.stderr, flush=True)
        threading.Thread(target=self._exit, name="pipeline-exit", daemon=True).start()

    def _exit(self) -> None:
        time.sleep(self.grace_s)
        os._exit(EXIT_FAILED)


def serve(status: Status, host: str, port: int) -> None:
    """Serve until the process ends (a signal, or the failure's exit)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    trio.run(hypercorn_serve, worker_guard(Guard(status)), config)  # type: ignore[arg-type]
