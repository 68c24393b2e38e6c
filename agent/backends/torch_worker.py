"""Our own thin OpenAI-compatible worker for safetensors models on PyTorch/transformers.

`transformers serve` fits the plain case but takes no draft model (assisted generation), no
context length and no thread count, and will not serve a layer slice; this worker does, in one
process per server, with the same wire format (SSE chunks ending in `data: [DONE]`).

    python -m agent.backends.torch_worker --model DIR --host H --port P [--threads N]
        [--context-length N] [--draft DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, AsyncIterator

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import openai_wire as wire


class Engine:
    def __init__(self, model_dir: str, threads: int | None, context_length: int | None, draft: str | None,
                 prompt_lookup: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.name = model_dir  # like llama.cpp, the engine names the model by its path
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, output_loading_info=True)
        model, info = loaded
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            # transformers would fill these with random values and serve garbage without a word.
            raise SystemExit(f"{model_dir}: the weights lack {len(missing)} tensor(s) the model needs: "
                             + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
        self.model = model.to(self.device).eval()
        draft_model: Any = AutoModelForCausalLM.from_pretrained(draft, local_files_only=True) if draft else None
        self.draft = draft_model.to(self.device).eval() if draft_model is not None else None
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.context_length = min(context_length or limit or 2048, limit or context_length or 2048)
        self.prompt_lookup = prompt_lookup
        self.lock = trio.Lock()  # one generation at a time per worker: a CPU runs one well

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        ids: Any = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, toks: list[int]) -> str:
        return str(self.tokenizer.decode(toks, skip_special_tokens=True))

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def generate(self, ids: list[int], max_tokens: int, temperature: float, on_token: Any) -> tuple[int, str]:
        """Blocking: run generate, calling on_token(token_id) for each new token. Returns
        (tokens made, finish reason)."""
        from transformers.generation.streamers import BaseStreamer

        room = self.context_length - len(ids)
        if room <= 0:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {self.context_length}")
        max_new = max(1, min(max_tokens, room))
        made = 0

        class Push(BaseStreamer):
            first = True

            def put(self, value: Any) -> None:
                nonlocal made
                if self.first:  # generate() first echoes the prompt
                    self.first = False
                    return
                for tok in value.reshape(-1).tolist():
                    made += 1
                    on_token(int(tok))

            def end(self) -> None:
                pass

        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "streamer": Push(),
                                  "pad_token_id": self.tokenizer.eos_token_id}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature)
        else:
            kwargs.update(do_sample=False)
        if self.draft is not None:
            kwargs["assistant_model"] = self.draft
        elif self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        input_ids = self.torch.tensor([ids], device=self.device)
        with self.torch.no_grad():
            self.model.generate(input_ids, attention_mask=self.torch.ones_like(input_ids), **kwargs)
        return made, "length" if made >= max_new else "stop"


def create_app(engine: Engine) -> Starlette:
    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": engine.name, "object": "model",
                                                          "created": int(time.time()), "owned_by": "fleet"}]})

    async def run(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
            ids = engine.encode_chat(body["messages"]) if chat else engine.encode(str(body["prompt"]))
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": {"message": f"bad request: {exc}", "type": "invalid_request_error"}},
                                status_code=400)
        cid = wire.new_id("chatcmpl" if chat else "cmpl")
        send, receive = trio.open_memory_channel[Any](1024)

        def on_token(tok: int) -> None:
            trio.from_thread.run_sync(send.send_nowait, tok)

        async def produce() -> tuple[int, str]:
            async with engine.lock:
                try:
                    return await trio.to_thread.run_sync(engine.generate, ids, max_tokens, temperature, on_token)
                finally:
                    send.close()

        async def deltas() -> AsyncIterator[str]:
            # Decode the whole so far and emit the new suffix: byte-level BPE can split a character.
            toks: list[int] = []
            shown = ""
            async for tok in receive:
                toks.append(tok)
                text = engine.decode(toks)
                if text.endswith("\ufffd"):
                    continue
                if len(text) > len(shown):
                    yield text[len(shown):]
                    shown = text
            final = engine.decode(toks)
            if len(final) > len(shown):  # an incomplete character at the very end: send it as it is
                yield final[len(shown):]

        if not body.get("stream"):
            async with trio.open_nursery() as nursery:
                result: dict[str, Any] = {}

                async def go() -> None:
                    result["r"] = await produce()
                nursery.start_soon(go)
                text = "".join([d async for d in deltas()])
            made, finish = result["r"]
            build = wire.chat_completion if chat else wire.completion
            return JSONResponse(build(cid, engine.name, text, finish, len(ids), made))

        async def stream() -> AsyncIterator[bytes]:
            async with trio.open_nursery() as nursery:
                result: dict[str, Any] = {}

                async def go() -> None:
                    result["r"] = await produce()
                nursery.start_soon(go)
                if chat:
                    yield wire.sse(wire.chat_chunk(cid, engine.name, {"role": "assistant", "content": ""}))
                async for piece in deltas():
                    yield wire.sse(wire.chat_chunk(cid, engine.name, {"content": piece}) if chat
                                   else wire.text_chunk(cid, engine.name, piece))
            _, finish = result["r"]
            yield wire.sse(wire.chat_chunk(cid, engine.name, {}, finish) if chat
                           else wire.text_chunk(cid, engine.name, "", finish))
            yield wire.DONE

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def chat(request: Request) -> Response:
        return await run(request, True)

    async def completions(request: Request) -> Response:
        return await run(request, False)

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"])])


def main() -> None:
    ap = argparse.ArgumentParser(prog="torch_worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--draft")
    ap.add_argument("--prompt-lookup", type=int)
    args = ap.parse_args()
    engine = Engine(args.model, args.threads, args.context_length, args.draft, args.prompt_lookup)  # fails here, loudly
    print(json.dumps({"event": "loaded", "model": args.model, "device": engine.device,
                      "context_length": engine.context_length}), file=sys.stderr, flush=True)

    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = None
    trio.run(serve, create_app(engine), config)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
