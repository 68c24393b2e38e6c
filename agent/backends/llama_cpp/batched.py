"""fleet's own llama.cpp worker for GGUF models: OpenAI's API in front of the batched engine
(agent/backends/llama_cpp/engine.py), so that the requests of a GGUF cluster's users are decoded
together instead of one after the other (llama-cpp-python's server app holds one lock around its
one context: agent/backends/llama_cpp/worker.py, still selectable, see spec.py).

The edges are the PyTorch worker's (agent/backends/openai_wire.py): requests checked before they
reach the engine (400 invalid_request_error, with the parameter), 400 context_length_exceeded for
a prompt the context cannot hold, streams ending in the usage chunk when it is asked for, every
model entry with `created`, GET /v1/models/{id}, unknown routes and failures as OpenAI's JSON
errors that name no path and carry no trace, a slow reader's request paused (not its neighbours),
a client that leaves freeing its sequence. The prompt is the GGUF's own chat template, rendered as
llama-cpp-python renders it; GET /health gives the engine's counters.

    python -m agent.backends.llama_cpp.batched --model FILE --host H --port P [--model_alias NAME]
        [--n_ctx N] [--n_threads N] [--n_batch N] [--parallel N] [--n_gpu_layers N] [--main_gpu N]
        [--tensor_split A B] [--draft_model prompt-lookup-decoding --draft_model_num_pred_tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any, AsyncIterator

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agent.auth import worker_guard
from agent.backends import openai_wire as wire
from agent.backends.llama_cpp.engine import PREFILL_CHUNK, Engine, Job, Model
from agent.backends.outbox import End, Outbox, Params
from agent.backends.torch.text import Text
from agent.weights.sealed import guard_worker

STREAM_BUFFER = 64  # tokens a reader may fall behind before its request waits for it
MAX_BODY = 32 << 20
LOOKUP = "prompt-lookup-decoding"  # llama_cpp.server's --draft_model value for prompt lookup


class Served:
    """The model behind the worker: its vocabulary and chat template, limits, and the engine."""

    def __init__(self, model: Model, name: str, stream_buffer: int = STREAM_BUFFER) -> None:
        self.model, self.name, self.stream_buffer = model, name, stream_buffer
        self.created = int(time.time())
        self.engine = Engine(model)
        self.template: Any = None
        source = model.meta("tokenizer.chat_template")
        if source:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            # As llama-cpp-python's Llama sets up the GGUF's template (eos and bos by their text).
            self.template = Jinja2ChatFormatter(source, eos_token=model.token_text(model.eos),
                                                bos_token=model.token_text(model.bos))
        self.engine.start()

    def tokens(self, ask: wire.Ask) -> list[int]:
        if not ask.chat:
            ids = self.model.tokenize(ask.prompt, add_special=True)
            return ids or ([self.model.bos] if self.model.bos >= 0 else [])
        if self.template is None:
            raise wire.BadRequest("this model has no chat template; use /v1/completions with a prompt", "messages",
                                  "no_chat_template")
        try:
            prompt = self.template(messages=[{"role": role, "content": text} for role, text in ask.messages]).prompt
        except Exception as exc:  # the template's own checks (roles, order) raise
            raise wire.BadRequest(f"the model's chat template refused the messages: {exc}", "messages") from None
        return self.model.tokenize(prompt, add_special=False)  # the template wrote the special tokens

    def job(self, ask: wire.Ask, ids: list[int]) -> Job:
        room = self.model.context_length - len(ids)
        where = "messages" if ask.chat else "prompt"
        if not ids:
            raise wire.BadRequest("the prompt is empty", where)
        if room <= 0:
            raise wire.BadRequest(f"This model's maximum context length is {self.model.context_length} tokens; the "
                                  f"{where} came to {len(ids)} tokens. Shorten it.", where, "context_length_exceeded")
        s = ask.sampling
        params = Params(max_new=min(s.max_tokens or room, room), temperature=s.temperature, top_p=s.top_p,
                        seed=s.seed)
        token = trio.lowlevel.current_trio_token()
        return Job(ids, params, Outbox(self.stream_buffer, token.run_sync_soon, self.engine.kick))


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
        text = Text(served.model, ask.sampling.stop)
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
                job.cancel()  # the client left, or we are done: either way the engine frees the sequence

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _whole(request: Request, job: Job, text: Text, cid: str, created: int, chat: bool) -> Response:
        parts: list[str] = []
        ended: End | None = None
        async with trio.open_nursery() as nursery:
            async def watch() -> None:  # a client that hangs up frees the sequence even without a stream
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


def _flag(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{value!r} is not True or False")
    return value.lower() in ("true", "1")


def main() -> None:
    # The options llama_cpp.server takes for the same things (spec.py builds one command line for both).
    ap = argparse.ArgumentParser(prog="llama_cpp_batched", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model_alias", help="the model's name in answers and /v1/models (default: its path)")
    ap.add_argument("--n_ctx", type=int, help="tokens of context per request (default 2048)")
    ap.add_argument("--n_threads", type=int)
    ap.add_argument("--n_batch", type=int, default=PREFILL_CHUNK,
                    help="prompt tokens one step takes at most, beside the running rows' next tokens")
    ap.add_argument("--parallel", type=int,
                    help="requests decoded together (default: what a quarter of the free memory holds, at most 16)")
    ap.add_argument("--n_gpu_layers", type=int)
    ap.add_argument("--main_gpu", type=int)
    ap.add_argument("--tensor_split", type=float, nargs="+", help="each GPU's share of the layers")
    ap.add_argument("--draft_model", choices=(LOOKUP,), help=f"{LOOKUP}: prompt lookup for greedy requests")
    ap.add_argument("--draft_model_num_pred_tokens", type=int, default=10)
    ap.add_argument("--stream_buffer", type=int, default=STREAM_BUFFER,
                    help="tokens a slow reader may fall behind before its request pauses")
    ap.add_argument("--flash_attn", type=_flag, default=False, help="flash attention (default False, as llama_cpp.server)")
    ap.add_argument("--prefix_cache", type=_flag, default=False,
                    help="keep the latest prompt for the next to copy its opening from (default False: "
                         "greedy answers then follow the single-sequence path's less exactly)")
    ap.add_argument("--verbose", action="store_true", help="llama.cpp's own log on stderr")
    args = ap.parse_args()
    guard_worker()  # it will hold an encrypted model's plaintext: closed to the other workers
    model = Model(args.model, args.n_ctx, args.parallel, args.n_threads, args.n_batch, args.n_gpu_layers,
                  args.main_gpu, args.tensor_split, args.draft_model_num_pred_tokens if args.draft_model else 0,
                  args.flash_attn, args.prefix_cache, args.verbose)  # fails here, loudly
    served = Served(model, args.model_alias or args.model, args.stream_buffer)
    print(json.dumps({"event": "loaded", "engine": "llama_cpp_batched", "context_length": model.context_length,
                      "parallel": model.parallel, "prompt_lookup": model.lookup,
                      "prefix_cache": model.prefix_cache}), file=sys.stderr, flush=True)

    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = None
    trio.run(serve, worker_guard(create_app(served)), config)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
