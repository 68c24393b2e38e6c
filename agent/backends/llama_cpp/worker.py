"""llama-cpp-python's OpenAI server for GGUF models, with fleet's OpenAI edges around its app.

The server (`python -m llama_cpp.server`) serves the model well but its edges are not what clients
expect: a malformed body is a 500 whose message holds a traceback line and the library's install
path, a streamed prompt longer than the context is a 200 with an empty stream, `stream_options`
is ignored (no usage chunk), errors are FastAPI's `{"detail": ...}`, and models carry no `created`.
This module runs the same app (same settings, same command-line options) behind an ASGI layer
that fixes those, with the torch worker's request checks (agent/backends/openai_wire.py) so both
engines refuse a bad body with the same words:

- a generation request is checked first; a bad one is a 400 `invalid_request_error`;
- the response head is held until the first body bytes, so an engine failure before the first
  token (the context check runs there) is still a JSON error with its status: 400
  `context_length_exceeded`, or a 500 that names only the exception's type;
- every error body is OpenAI's shape, on one line, with filesystem paths removed;
- `stream_options.include_usage` adds the usage chunk before `data: [DONE]`: prompt tokens counted
  by the library's own chat formatting on a vocabulary-only copy of the model, completion tokens
  as the streamed chunks that carried text (llama-cpp-python sends one per token);
- `/v1/models` entries carry `created`, and `GET /v1/models/{id}` answers.

    python -m agent.backends.llama_cpp.worker --model FILE --host H --port P [llama_cpp.server options]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import traceback
from typing import Any, Callable, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.auth import worker_guard
from agent.weights.sealed import guard_worker
from agent.backends import openai_wire as wire

GENERATE = {"/v1/chat/completions": True, "/v1/completions": False}
MAX_BODY = 32 << 20
CONTEXT = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")
# An absolute path of two parts or more, as tracebacks and library messages carry them.
PATH = re.compile(r"(?<![\w.~-])/(?:[^\s/'\"(),:]+/)+[^\s/'\"(),:]*")
CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
         422: "invalid_value"}


def clean(text: str) -> str:
    """One line, no paths: what a client may read of an engine's message."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return PATH.sub("<path>", first)[:500]


def error_json(status: int, message: str, code: str | None, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps(wire.error(clean(message), kind, param, code)).encode()


def rewrite_error(status: int, body: bytes) -> bytes:
    """Any error body of the app (OpenAI's shape, FastAPI's `detail`, plain text) as OpenAI's, clean."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        e = parsed["error"]
        message = str(e.get("message") or "")
        if e.get("type") == "internal_server_error" or status >= 500:
            # The library puts str(exception) here: keep its first line, never its trace.
            return error_json(status, message or "the engine failed", e.get("code") or "engine_error")
        return error_json(status, message, e.get("code"), e.get("param"))
    if isinstance(parsed, dict) and "detail" in parsed:
        detail = parsed["detail"]
        message = detail if isinstance(detail, str) else "the request is not valid"
    else:
        message = body.decode(errors="replace") or f"HTTP {status}"
    return error_json(status, message, CODES.get(status, "engine_error" if status >= 500 else None))


def error_for(exc: BaseException) -> tuple[int, bytes]:
    """An exception the app raised before answering, as a status and an OpenAI error body."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    match = CONTEXT.search(str(exc))
    if match:
        return 400, error_json(400, f"This model's maximum context length is {match[2]} tokens; the prompt came "
                                    f"to {match[1]} tokens. Shorten it.", "context_length_exceeded", "messages")
    return 500, error_json(500, f"internal error in the engine: {type(exc).__name__}", "engine_error")


class UsageTap:
    """Passes an SSE stream through, line by line, counting the chunks that carry text, and puts the
    usage chunk before `data: [DONE]`. Pure: bytes in, bytes out, any split of the input."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.head: dict[str, Any] = {}
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        self.pending += data
        cut = self.pending.rfind(b"\n") + 1
        if not cut:
            return b""
        lines, self.pending = self.pending[:cut], self.pending[cut:]
        return b"".join(self._line(line) for line in lines.splitlines(keepends=True))

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return self._line(rest) if rest else b""

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:"):
            return line
        payload = line[5:].strip()
        if payload == b"[DONE]":
            usage = {**self.head, "choices": [], "usage": wire.usage(self.prompt_tokens, self.completion_tokens)}
            return wire.sse(usage) + line
        try:
            chunk = json.loads(payload)
            choice = chunk["choices"][0]
            text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return line
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        self.completion_tokens += 1 if text else 0
        return line


class Counts(Protocol):
    def count(self, body: dict[str, Any], chat: bool) -> int | None: ...


class PromptCounter:
    """Prompt tokens as the library counts them: its own chat formatting and tokenizer, on a copy of
    the model that holds only the vocabulary (no weights: a fraction of a second, on first use)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.vocab: Any = None
        self.counted: type[Exception] = Exception
        self.broken = False  # the vocabulary would not load: no usage chunk, the answer still goes
        self.lock = threading.Lock()

    def _load(self) -> Any:
        import llama_cpp

        class Counted(Exception):
            pass

        class Vocabulary(llama_cpp.Llama):
            def create_completion(self, prompt: Any, *args: Any, **kwargs: Any) -> Any:
                # Reached by create_chat_completion with the formatted prompt as tokens: stop here.
                raise Counted(len(prompt) if isinstance(prompt, list) else self.count_text(prompt))

            def count_text(self, prompt: str) -> int:
                return len(self.tokenize(prompt.encode("utf-8"), special=True)) if prompt else 1

        self.counted = Counted
        return Vocabulary(self.model_path, vocab_only=True, verbose=False)

    def count(self, body: dict[str, Any], chat: bool) -> int | None:
        """None when the library itself could not format the prompt (the request will say why)."""
        with self.lock:
            if self.broken:
                return None
            if self.vocab is None:
                try:
                    self.vocab = self._load()
                except Exception as exc:
                    self.broken = True
                    print(f"cannot count prompt tokens: {type(exc).__name__}: {exc}", file=sys.stderr)
                    return None
            if not chat:
                prompt = body.get("prompt")
                return int(self.vocab.count_text(str((prompt[0] if isinstance(prompt, list) else prompt) or "")))
            shape = {k: body[k] for k in ("messages", "functions", "function_call", "tools", "tool_choice") if k in body}
            try:
                self.vocab.create_chat_completion(**shape)
            except self.counted as counted:
                return int(counted.args[0])
            except Exception:
                return None
            return None


async def _read(receive: Receive) -> bytes | None:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > MAX_BODY:
            return None
        if not message.get("more_body"):
            return b"".join(parts)


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Reply:
    """The app's `send`, holding the response head until the first body bytes (an exception before
    them can still become a proper error), rewriting error and model-list bodies, tapping streams."""

    def __init__(self, send: Send, tap: UsageTap | None, edit: Any = None) -> None:
        self.send, self.tap, self.edit = send, tap, edit
        self.head: Message | None = None
        self.started = False
        self.kept: list[bytes] = []
        self.held_end = False

    async def finish(self) -> None:
        """The app returned: send what was held (an empty answer is still an answer)."""
        if not self.started and self.head is not None and self.held_end:
            self.started = True
            await self.send(self.head)
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    def _whole(self) -> bool:
        assert self.head is not None
        return int(self.head["status"]) >= 400 or self.edit is not None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.head = message
            return
        if message["type"] != "http.response.body" or self.head is None:
            await self.send(message)
            return
        status = int(self.head["status"])
        body, more = message.get("body", b""), bool(message.get("more_body"))
        if self._whole():
            self.kept.append(body)
            if not more:
                whole = b"".join(self.kept)
                self.started = True
                await _answer(self.send, status, rewrite_error(status, whole) if status >= 400 else self.edit(whole))
            return
        if not self.started:
            if not body:
                # An empty stream's end comes before the app raises what emptied it: hold on.
                self.held_end = self.held_end or not more
                return
            self.started = True
            await self.send(self.head)
        if self.tap is not None:
            body = self.tap.feed(body) + (b"" if more else self.tap.flush())
        await self.send({"type": "http.response.body", "body": body, "more_body": more})


Check = Callable[[dict[str, Any], bool], "str | None"]


def library_check(body: dict[str, Any], chat: bool) -> str | None:
    """What the library's own request model refuses (a 500 with its trace if it got that far)."""
    from pydantic import ValidationError

    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

    try:
        (CreateChatCompletionRequest if chat else CreateCompletionRequest).model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return None


class Edges:
    """The ASGI layer around llama_cpp.server's app (see the module's docstring)."""

    def __init__(self, app: ASGIApp, name: str, created: int, counter: Counts | None = None,
                 check: Check | None = None) -> None:
        self.app, self.name, self.created, self.counter, self.check = app, name, created, counter, check

    def models(self, body: bytes) -> bytes:
        listed = json.loads(body)
        for entry in listed.get("data", []):
            entry.setdefault("created", self.created)
        return json.dumps(listed).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path.startswith("/v1/models/"):
            wanted = path.removeprefix("/v1/models/")
            if wanted in (self.name, self.name.lstrip("/")):
                await _answer(send, 200, json.dumps(wire.model_entry(self.name, self.created)).encode())
            else:
                await _answer(send, 404, error_json(404, f"The model '{wanted}' does not exist", "model_not_found",
                                                    "model"))
            return
        tap = None
        if method == "POST" and path in GENERATE:
            raw = await _read(receive)
            if raw is None:
                await _answer(send, 413, error_json(413, f"the body is larger than {MAX_BODY} bytes",
                                                    "request_too_large"))
                return
            try:
                ask = wire.parse(raw, GENERATE[path])
            except wire.BadRequest as exc:
                await _answer(send, exc.status, json.dumps(exc.body()).encode())
                return
            refused = self.check(json.loads(raw), ask.chat) if self.check is not None else None
            if refused:
                await _answer(send, 400, error_json(400, refused, "invalid_value"))
                return
            if ask.include_usage and self.counter is not None:
                import anyio.to_thread

                prompt = await anyio.to_thread.run_sync(self.counter.count, json.loads(raw), ask.chat)
                tap = UsageTap(prompt) if prompt is not None else None
            # Answers name the served model, never what the client wrote nor (when it wrote none) a path.
            raw = json.dumps({**json.loads(raw), "model": self.name}).encode()
            receive = _replay(raw, receive)
        reply = Reply(send, tap, self.models if method == "GET" and path == "/v1/models" else None)
        try:
            await self.app(scope, receive, reply)
            await reply.finish()
        except Exception as exc:
            traceback.print_exception(exc, file=sys.stderr)  # the worker's log has it; the client does not
            if not reply.started:
                await _answer(send, *error_for(exc))
            elif tap is not None or ask_stream(reply):
                # A stream cut mid-way says so (an error event, then [DONE]), never silently.
                body = error_for(exc)[1]
                await send({"type": "http.response.body", "body": b"data: " + body + b"\n\n" + wire.DONE})


def ask_stream(reply: Reply) -> bool:
    headers = dict(reply.head["headers"]) if reply.head is not None else {}
    return bytes(headers.get(b"content-type", b"")).startswith(b"text/event-stream")


def _replay(raw: bytes, receive: Receive) -> Receive:
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()  # then the client's own messages: a disconnect stops the stream

    return again


def main() -> None:
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    parser = argparse.ArgumentParser(prog="llama_cpp_worker", description=__doc__.splitlines()[0])
    add_args_from_model(parser, Settings)
    args = parser.parse_args()
    guard_worker()  # it will hold an encrypted model's plaintext: closed to the other workers
    # The library annotates these as returning the class; they return an instance.
    server: Any = parse_model_from_args(ServerSettings, args)
    model: Any = parse_model_from_args(ModelSettings, args)
    # The library's default (interrupt_requests=True) ends a running stream early whenever another
    # request arrives: with 8 concurrent streams 37 of 40 answers came back cut. A request waits its
    # turn instead; concurrency for llama.cpp comes from more members (bench/engines.py).
    server.interrupt_requests = False
    app = create_app(server_settings=server, model_settings=[model])  # loads the model: fails here, loudly
    edges = Edges(app, model.model_alias or model.model, int(time.time()), PromptCounter(model.model), library_check)
    uvicorn.run(worker_guard(edges), host=server.host, port=server.port, ssl_keyfile=server.ssl_keyfile,
                ssl_certfile=server.ssl_certfile)


if __name__ == "__main__":
    main()
