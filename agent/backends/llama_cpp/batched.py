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
from typing import Any

import trio

from agent.auth import worker_guard
from agent.backends import openai_wire as wire
from agent.backends.openai_app import create_app
from agent.backends.llama_cpp.engine import PREFILL_CHUNK, Engine, Job, Model
from agent.backends.outbox import Outbox, Params
from agent.weights.sealed import guard_worker

STREAM_BUFFER = 64  # tokens a reader may fall behind before its request waits for it
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

    @property
    def tokenizer(self) -> Model:
        return self.model  # what Text decodes with: the GGUF's vocabulary

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
