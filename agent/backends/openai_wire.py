"""OpenAI wire format of our own workers: request parsing, chunks, completions, errors, SSE framing."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

MAX_STOP = 4  # as OpenAI: up to four stop sequences


class ErrorBody(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorJSON(TypedDict):
    error: ErrorBody


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelEntry(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class BadRequest(Exception):
    """A request the worker refuses, with the status and the OpenAI error fields to answer with."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> ErrorJSON:
        return error(self.message, self.type, self.param, self.code)


def error(message: str, type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> ErrorJSON:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int | None  # None: up to the context length
    temperature: float  # 0: greedy
    top_p: float
    seed: int | None
    stop: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ask:
    """One parsed completion request: chat messages (role, text) or a plain prompt."""

    chat: bool
    messages: tuple[tuple[str, str], ...]
    prompt: str
    sampling: Sampling
    stream: bool
    include_usage: bool


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{key} must be a number", key)
    if not low <= value <= high:
        raise BadRequest(f"{key} must be between {low:g} and {high:g}; got {value:g}", key)
    return float(value)


def _integer(body: dict[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer", key)
    if value < low:
        raise BadRequest(f"{key} must be at least {low}; got {value}", key)
    return value


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}: only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}.content must be a string or a list of text parts", "messages")


def _messages(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for n, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{n}] must be an object with a string role", "messages")
        out.append((m["role"], _text(m.get("content"), f"messages[{n}]")))
    return tuple(out)


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise BadRequest("prompt must be a string (one prompt per request)", "prompt")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > MAX_STOP:
        raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    return tuple(items)


def parse(raw: bytes, chat: bool) -> Ask:
    """The request body as the worker needs it; BadRequest (400, with the parameter) otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", code="invalid_json")
    if body.get("n") not in (None, 1):
        raise BadRequest("only n=1 is supported", "n", "unsupported_value")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise BadRequest("stream must be a boolean", "stream")
    max_tokens = _integer(body, "max_completion_tokens", 1) if chat else None
    max_tokens = _integer(body, "max_tokens", 1) or max_tokens
    if max_tokens is None and not chat:
        max_tokens = 16  # the completions endpoint's documented default
    sampling = Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                        top_p=_number(body, "top_p", 1.0, 0.0, 1.0), seed=_integer(body, "seed", -2**63),
                        stop=_stop(body.get("stop")))
    return Ask(chat=chat, messages=_messages(body.get("messages")) if chat else (),
               prompt="" if chat else _prompt(body.get("prompt")), sampling=sampling, stream=bool(stream),
               include_usage=bool(stream and options and options.get("include_usage")))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def model_entry(name: str, created: int) -> ModelEntry:
    return {"id": name, "object": "model", "created": created, "owned_by": "fleet"}


def usage(prompt: int, completion: int) -> Usage:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True, slots=True)
class Chunks:
    """The chunks of one streamed completion: same id, created and model on each (as OpenAI sends)."""

    cid: str
    created: int
    model: str
    chat: bool
    include_usage: bool

    def _base(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.cid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = None  # every chunk but the last carries usage: null when it was asked for
        return out

    def role(self) -> dict[str, Any]:
        return self.delta("", role=True)

    def delta(self, text: str, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
                {"content": text} if text or finish is None else {})
            return self._base([{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}])
        return self._base([{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}])

    def usage(self, prompt: int, completion: int) -> dict[str, Any]:
        out = self._base([])
        out["usage"] = usage(prompt, completion)
        return out


def whole(cid: str, created: int, model: str, chat: bool, text: str, finish: str, prompt: int,
          completion: int) -> dict[str, Any]:
    """A non-streamed chat.completion or text_completion."""
    choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                              else {"index": 0, "text": text})
    choice.update(finish_reason=finish, logprobs=None)
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(prompt, completion)}
