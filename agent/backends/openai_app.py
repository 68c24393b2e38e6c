"""OpenAI's API in front of a batched engine, one app for every worker fleet writes: the PyTorch
worker (agent/backends/torch/worker.py), a pipeline's first stage (agent/backends/pipeline/stage.py)
and the batched llama.cpp worker (agent/backends/llama_cpp/batched.py). What a worker brings is a
`Served`: its name, how a request becomes prompt tokens and a Job, what decodes tokens into text,
and the engine (`Scheduler`) that runs the jobs.

The edges (agent/backends/openai_wire.py): requests checked before they reach the engine (400
invalid_request_error, with the parameter), a body past MAX_BODY refused with 413 before it is
read further, streams ending in the usage chunk when it is asked for, GET /v1/models/{id}, unknown
routes and failures as OpenAI's JSON errors that name no path and carry no trace, and a client
that leaves (streaming or not) cancelling its job, so that the engine frees its row.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any, AsyncIterator, Mapping, Protocol

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agent.backends import openai_wire as wire
from agent.backends.outbox import End, Outbox
from agent.backends.torch.text import Text

MAX_BODY = 32 << 20


class Job(Protocol):
    """A request inside an engine, as the HTTP side sees it."""

    prompt: list[int]
    outbox: Outbox

    def cancel(self) -> None: ...


class Scheduler(Protocol):
    """What the HTTP side asks of the engine behind it: a worker's batched engine, or the scheduler of
    a pipeline's first stage (agent/backends/pipeline/engine.py)."""

    def submit(self, job: Any) -> None: ...

    def coming(self, n: int) -> None: ...

    def kick(self) -> None: ...

    def stats(self) -> Mapping[str, float]: ...


class Served(Protocol):
    """The model behind a worker."""

    name: str
    created: int

    @property
    def engine(self) -> Scheduler: ...

    @property
    def tokenizer(self) -> Any: ...  # what Text decodes with: a transformers tokenizer, or the GGUF's vocabulary

    def tokens(self, ask: wire.Ask) -> list[int]: ...

    def job(self, ask: wire.Ask, ids: list[int]) -> Job: ...


async def _pieces(job: Job, text: Text) -> AsyncIterator[tuple[str, End | None]]:
    """The request's text as it comes, then its end (a stop string ends it early: the engine is told)."""
    while True:
        tokens, end = await job.outbox.get()
        piece, stopped = text.add(tokens)
        if stopped:
            job.cancel()
            yield piece, End("stop", text.count)
            return
        if end is not None:
            yield piece + text.flush(), End(end.reason, max(end.completion_tokens, text.count), end.error, end.code)
            return
        if piece:
            yield piece, None


def _error(status: int, message: str, code: str | None, type: str = "invalid_request_error",
           param: str | None = None) -> JSONResponse:
    return JSONResponse(wire.error(message, type, param, code), status_code=status)


async def _body(request: Request) -> bytes | None:
    """The request's body, None past MAX_BODY."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY:
            return None
        parts.append(part)
    return b"".join(parts)


def create_app(served: Served) -> Starlette:
    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "engine": served.engine.stats()})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [wire.model_entry(served.name, served.created)]})

    async def model(request: Request) -> Response:
        wanted = request.path_params["model_id"]
        if wanted not in (served.name, served.name.lstrip("/")):
            return _error(404, f"The model '{wanted}' does not exist", "model_not_found", param="model")
        return JSONResponse(wire.model_entry(served.name, served.created))

    async def run(request: Request, chat: bool) -> Response:
        served.engine.coming(1)  # an idle engine waits for a request on its way: a burst prefills together
        try:
            raw = await _body(request)
            if raw is None:
                return _error(413, f"the body is larger than {MAX_BODY} bytes", "request_too_large")
            ask = wire.parse(raw, chat)
            job = served.job(ask, served.tokens(ask))
            served.engine.submit(job)
        except wire.BadRequest as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        finally:
            served.engine.coming(-1)
        cid, created = wire.new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        text = Text(served.tokenizer, ask.sampling.stop)
        if not ask.stream:
            return await _whole(request, job, text, cid, created, chat)
        chunks = wire.Chunks(cid, created, served.name, chat, ask.include_usage)

        async def events() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield wire.sse(chunks.role())
                async for piece, end in _pieces(job, text):
                    if end is not None and end.reason == "error":
                        yield wire.sse(wire.error(end.error or "the engine failed", "server_error", None, end.code))
                        yield wire.DONE
                        return
                    if piece:
                        yield wire.sse(chunks.delta(piece))
                    if end is not None:
                        yield wire.sse(chunks.delta("", end.reason))
                        if ask.include_usage:
                            yield wire.sse(chunks.usage(len(job.prompt), end.completion_tokens))
                yield wire.DONE
            finally:
                job.cancel()  # the client left, or we are done: either way the engine frees the row

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _whole(request: Request, job: Job, text: Text, cid: str, created: int, chat: bool) -> Response:
        parts: list[str] = []
        ended: End | None = None
        async with trio.open_nursery() as nursery:
            async def watch() -> None:  # a client that hangs up frees the row even without a stream
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                job.cancel()
            nursery.start_soon(watch)
            async for piece, end in _pieces(job, text):
                parts.append(piece)
                ended = end
            nursery.cancel_scope.cancel()
        assert ended is not None
        if ended.reason == "error":
            return _error(500, ended.error or "the engine failed", ended.code, "server_error")
        return JSONResponse(wire.whole(cid, created, served.name, chat, "".join(parts), ended.reason,
                                       len(job.prompt), ended.completion_tokens))

    async def chat(request: Request) -> Response:
        return await run(request, True)

    async def completions(request: Request) -> Response:
        return await run(request, False)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            return _error(405, f"{where} is not supported; see GET /v1/models, POST /v1/chat/completions "
                               "and POST /v1/completions", "method_not_allowed")
        if exc.status_code == 404:
            return _error(404, f"Invalid URL ({where}): this worker serves /v1/models, /v1/chat/completions "
                               "and /v1/completions", "not_found")
        return _error(exc.status_code, str(exc.detail), None)

    async def crash(_: Request, exc: Exception) -> Response:
        traceback.print_exception(exc, file=sys.stderr)  # the worker's log has it; the client does not
        return _error(500, f"internal error in the worker: {type(exc).__name__}", "internal_error", "server_error")

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/models/{model_id:path}", model),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"])],
                     exception_handlers={HTTPException: http_error, Exception: crash})
