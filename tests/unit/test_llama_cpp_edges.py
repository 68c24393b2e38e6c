"""The OpenAI edges around llama-cpp-python's server: the usage tap at every cut, error bodies made
clean, and the ASGI layer in front of stand-in apps that answer the way the library's app does
(the real server is asked the same in tests/e2e/test_real_model.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from starlette.types import Receive, Scope, Send

from agent.backends.llama_cpp.worker import Edges, UsageTap, error_for, library_check, rewrite_error

CHUNK = {"id": "chatcmpl-1", "model": "m", "created": 7, "object": "chat.completion.chunk"}


def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {**CHUNK, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\r\n\r\n"


# As llama-cpp-python's server sends it (sse_starlette, separator "\r\n" here), a ping included.
STREAM = (event({"role": "assistant"}) + event({"content": "The"}) + b": ping - 2026-01-01\r\n\r\n"
          + event({"content": " capital"}) + event({"content": ""}) + event({"content": "."}) + event({}, "stop")
          + b"data: [DONE]\r\n\r\n")
USAGE = {**{k: CHUNK[k] for k in ("id", "object", "created", "model")}, "choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": 3, "total_tokens": 45}}
EXPECTED = STREAM.replace(b"data: [DONE]", b"data: " + json.dumps(USAGE, separators=(",", ":")).encode()
                          + b"\n\ndata: [DONE]")


def tapped(*parts: bytes) -> bytes:
    tap = UsageTap(42)
    return b"".join(tap.feed(p) for p in parts) + tap.flush()


def test_usage_chunk_before_done_counting_chunks_with_text() -> None:
    assert tapped(STREAM) == EXPECTED


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_usage_tap_at_every_cut(cut: int) -> None:
    assert tapped(STREAM[:cut], STREAM[cut:]) == EXPECTED


def test_usage_tap_byte_by_byte_and_completions() -> None:
    assert tapped(*(STREAM[i:i + 1] for i in range(len(STREAM)))) == EXPECTED
    text = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
    stream = b"".join(b"data: " + json.dumps({**text, "choices": [{"text": t, "index": 0}]}).encode() + b"\n\n"
                      for t in ("Paris", " is", "")) + b"data: [DONE]\n\n"
    out = tapped(stream).split(b"\n\n")
    assert json.loads(out[-3][6:]) == {**text, "choices": [],
                                       "usage": {"prompt_tokens": 42, "completion_tokens": 2, "total_tokens": 44}}


def test_a_stream_without_done_is_passed_through_untouched() -> None:
    cut = STREAM[: STREAM.index(b"data: [DONE]")] + b"data: {\"partial"
    assert tapped(cut) == cut


TRACE = ('1 validation error:\n  {"type": "list_type"}\n\n  File "/srv/venv/lib/python3.11/site-packages/'
         'llama_cpp/server/app.py", line 376, in create_chat_completion\n')


@pytest.mark.parametrize("status,body,code,message", [
    (500, json.dumps({"error": {"message": TRACE, "type": "internal_server_error", "param": None, "code": None}}),
     "engine_error", "1 validation error:"),
    (500, "Internal Server Error", "engine_error", "Internal Server Error"),
    (404, json.dumps({"detail": "Not Found"}), "not_found", "Not Found"),
    (405, json.dumps({"detail": "Method Not Allowed"}), "method_not_allowed", "Method Not Allowed"),
    (400, json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": "messages",
                                "code": "context_length_exceeded"}}), "context_length_exceeded", "bad"),
    (500, "failed to load /home/u/models/m.gguf: bad magic", "engine_error", "failed to load <path>: bad magic"),
], ids=["library-500-with-trace", "plain-text-500", "fastapi-404", "fastapi-405", "openai-400-kept", "path-removed"])
def test_error_bodies_become_openai_errors_without_paths(status: int, body: str, code: str, message: str) -> None:
    out = json.loads(rewrite_error(status, body.encode()))
    assert out["error"]["code"] == code and out["error"]["message"] == message
    assert out["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert "/" not in out["error"]["message"] and "\n" not in out["error"]["message"]


def test_exceptions_before_the_first_token() -> None:
    status, body = error_for(ExceptionGroup("g", [ValueError("Requested tokens (331) exceed context window of 256")]))
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
    assert "256" in json.loads(body)["error"]["message"] and "331" in json.loads(body)["error"]["message"]
    status, body = error_for(RuntimeError("state at /opt/x/y failed"))
    assert status == 500 and json.loads(body)["error"]["message"] == "internal error in the engine: RuntimeError"


# ---- the ASGI layer, in front of stand-ins for the library's app ----

class Library:
    """Answers as llama_cpp.server's app does in each case the edges handle."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path == "/v1/models":
            await self.json(send, 200, {"object": "list", "data": [{"id": "/s/m.gguf", "object": "model"}]})
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            await self.json(send, 404, {"detail": "Not Found"})
            return
        message = await receive()
        self.bodies.append(message["body"])
        body = json.loads(message["body"])
        if not body.get("stream"):
            await self.json(send, 200, {"choices": [{"message": {"content": "Paris"}}]})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        if body["messages"][0]["content"] == "long":
            # sse_starlette ends the emptied stream, then the task group raises the engine's error
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise ValueError("Requested tokens (300) exceed context window of 256")
        if body["messages"][0]["content"] == "crash":
            await send({"type": "http.response.body", "body": event({"content": "Par"}), "more_body": True})
            raise RuntimeError("the engine fell over at /opt/llama/lib.so")
        await send({"type": "http.response.body", "body": STREAM, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def json(send: Send, status: int, obj: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


class FixedCount:
    def count(self, body: dict[str, Any], chat: bool) -> int | None:
        return 42


def ask(method: str, path: str, body: Any = None, library: Library | None = None) -> httpx.Response:
    app = Edges(library or Library(), "/s/m.gguf", 1234, FixedCount())

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
            content = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
            return await client.request(method, path, content=content)

    return trio.run(go)


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def test_malformed_bodies_are_400_and_never_reach_the_library() -> None:
    library = Library()
    for body in (b"{\"model\":", {"model": "m", "messages": "hi"}, chat("hi", temperature="hot"), [1, 2]):
        r = ask("POST", "/v1/chat/completions", body, library)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "/" not in r.json()["error"]["message"] and "Traceback" not in r.text
    assert library.bodies == []
    assert ask("POST", "/v1/chat/completions", chat("hi")).json()["choices"][0]["message"]["content"] == "Paris"


def test_what_the_library_would_refuse_is_named_in_one_line() -> None:
    pytest.importorskip("llama_cpp.server.types")
    assert library_check(chat("hi", logit_bias=5), True) == "logit_bias: Input should be a valid dictionary"
    assert library_check(chat("hi"), True) is None
    assert library_check({"prompt": "x"}, False) is None


def test_an_over_long_streamed_prompt_is_a_400_not_an_empty_stream() -> None:
    r = ask("POST", "/v1/chat/completions", chat("long", stream=True))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_stream_cut_by_the_engine_says_so_before_done() -> None:
    r = ask("POST", "/v1/chat/completions", chat("crash", stream=True))
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"
    assert "/opt" not in r.text


def test_usage_chunk_only_when_asked() -> None:
    plain = ask("POST", "/v1/chat/completions", chat("hi", stream=True))
    assert plain.content == STREAM
    asked = ask("POST", "/v1/chat/completions", chat("hi", stream=True, stream_options={"include_usage": True}))
    assert asked.content == EXPECTED


def test_models_carry_created_and_answer_by_id_and_unknown_routes_are_openai_errors() -> None:
    assert ask("GET", "/v1/models").json()["data"][0]["created"] == 1234
    one = ask("GET", "/v1/models/s/m.gguf")
    assert one.status_code == 200 and one.json() == {"id": "/s/m.gguf", "object": "model", "created": 1234,
                                                     "owned_by": "fleet"}
    missing = ask("GET", "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    unknown = ask("GET", "/v1/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert unknown.headers["content-type"] == "application/json"
