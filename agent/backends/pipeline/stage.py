"""A pipeline stage worker: one process per stage of a pipeline cluster, serving the layers of the
slice it holds. Stage 0 takes the OpenAI requests (torch_worker's HTTP layer over the scheduler of
pipeline_engine.py), tokenises, embeds and runs its layers; each later stage runs its layers on the
hidden states it receives and passes them on; the last applies the norm and the head, samples and
sends the tokens back to stage 0. Stages other than 0 serve /health only.

A stage is healthy (200) once the group formed and one empty step went round. When any stage
fails, every stage ends: stage 0 ends the streams in flight with an error naming the stage and
answers 503 for a moment; each writes the group's one-line reason (to stderr and --reason-file)
and exits with EXIT_FAILED.

    python -m agent.backends.pipeline.stage --model DIR --host H --port P --pipeline JSON
        [--threads N] [--context-length N] [--adapter DIR] [--dtype D] [--max-batch N] [--micro-batches N]
        [--join-timeout S] [--recv-timeout S] [--silence-timeout S] [--reason-file PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from agent.backends.pipeline.group import Fault, Group, GroupSpec, PipelineFailed
from agent.backends.pipeline.link import CLOSED, SILENT, Link, LinkError
from agent.backends.pipeline.model import LoadError, SliceModel, load_slice
from agent.backends.pipeline.rows import Ledger, Sampler
from agent.backends.pipeline.spec import PIPELINE_KEY_ENV
from agent.backends.pipeline.web import Failure, Status, serve
from agent.backends.torch.worker import DTYPES, STREAM_BUFFER, Served

JOIN_TIMEOUT_S = 120.0
RECV_TIMEOUT_S = 120.0  # a step's compute upstream (a long prompt's prefill on a CPU) must fit in it
SILENCE_TIMEOUT_S = 30.0  # a stage whose heartbeat stops this long is named (a dead one is seen at once)


def _ids(value: Any) -> list[int]:
    values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values]


class StageServed(Served):
    """Stage 0's side of torch_worker's HTTP layer: the slice's tokenizer and limits; its engine is
    the pipeline's scheduler, set once made."""

    def __init__(self, model_dir: str, model: SliceModel, context_length: int | None, stream_buffer: int) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        if not any(Path(model_dir).glob("tokenizer*")):
            raise LoadError(f"{model_dir} holds no tokenizer, which the first stage needs (the first slice has it)")
        self.name, self.created, self.stream_buffer = model_dir, int(time.time()), stream_buffer
        self.device = model.stack.device
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        limit = getattr(model.config, "max_position_embeddings", None)
        self.context_length = min(context_length or limit or 2048, limit or context_length or 2048,
                                  model.stack.window or sys.maxsize)
        try:
            generation: Any = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        except OSError:
            generation = GenerationConfig.from_model_config(model.config)
        self.eos = set(_ids(generation.eos_token_id)) | set(_ids(self.tokenizer.eos_token_id))


def relay(spec: GroupSpec, model: SliceModel, ledger: Ledger, link: Link, status: Status) -> None:
    """A later stage, until the pipeline fails: each step's row operations, its layers, and on to
    the next stage (or, from the last, the sampled tokens back to stage 0)."""
    sampler = Sampler(model.stack.device) if spec.last else None
    steps = 0
    status.stats = lambda: {"steps": steps, "rows": ledger.rows(), "batches": len(ledger.caches),
                            "compute_us": ledger.busy_ns // 1000, **link.stats()}
    while True:
        step = link.recv_step()
        header = step.header
        with torch.inference_mode():
            ledger.apply(header["ops"])
            run = header.get("run")
            out = None
            if run is not None:
                if step.hidden is None:
                    raise LinkError(link.prev, "sent a step without its hidden states")
                out = ledger.run(run, step.hidden)
            if sampler is None:
                link.send_step(step.seq, step.raw, out)
            else:
                tokens: list[int] = []
                if run is not None and out is not None:
                    if run["k"] == "p":
                        sampler.join(run["rows"], run["s"])
                    sampler.forget(ledger.present())
                    t0 = time.perf_counter_ns()
                    tokens = sampler.pick(model.stack.head(out), ledger.members[int(run["b"])])
                    ledger.busy_ns += time.perf_counter_ns() - t0
                elif header["ops"]:
                    sampler.forget(ledger.present())
                link.send_tokens(step.seq, tokens)
        steps += 1
        if not status.ready:  # the warm-up step went through
            status.ready = True
            _loaded(spec, model, link)


def _loaded(spec: GroupSpec, model: SliceModel, link: Link) -> None:
    print(json.dumps({"event": "loaded", "stage": spec.rank, "layers": str(spec.me.layers),
                      "device": str(model.stack.device), "dtype": str(model.stack.dtype).removeprefix("torch."),
                      "transport": "nccl" if link.device_transport else "gloo",
                      "wire_dtype": str(link.wire_dtype).removeprefix("torch.")}),
          file=sys.stderr, flush=True)


def stage(args: argparse.Namespace, spec: GroupSpec, status: Status, failure: Failure, key: str) -> None:
    from agent.backends.pipeline.engine import PipelineEngine
    from agent.backends.openai_app import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    group = Group.form(spec, args.join_timeout, args.recv_timeout, key)
    failure.group = group
    group.watch(failure, args.silence_timeout, lambda: status.ready)
    model = load_slice(Path(args.model), spec.me.layers, device, args.dtype,
                       Path(args.adapter) if args.adapter else None)
    end = spec.stages[-1].layers.last
    if end != model.total_layers - 1:
        raise LoadError(f"the pipeline's stages end at layer {end}, but the model has {model.total_layers} layers")
    # Hidden states cross in the dtype every stage computes in; float32 when they differ.
    dtypes = group.agree("dtype", str(model.stack.dtype).removeprefix("torch."), args.join_timeout)
    wire_dtype = model.stack.dtype if len(set(dtypes)) == 1 else torch.float32
    link = Link(spec.rank, spec.world_size, device, model.stack.dtype, wire_dtype, model.hidden_size,
                args.recv_timeout, device_transport=group.backend != "gloo" and device.type == "cuda")
    ledger = Ledger(model.stack)
    if spec.rank > 0:
        relay(spec, model, ledger, link, status)
        return
    served = StageServed(args.model, model, args.context_length, args.stream_buffer)
    served.name = args.served_name or served.name
    engine = PipelineEngine(ledger, link, served.eos, args.max_batch, args.micro_batches or spec.world_size,
                            threads=args.threads)
    served.engine = engine
    failure.callbacks.append(engine.fail)
    engine.warm_up()
    status.app = create_app(served)
    status.ready = True
    _loaded(spec, model, link)
    engine.run()


def guarded(fn: Callable[[], None], spec: GroupSpec, failure: Failure) -> None:
    """Run the stage; whatever ends it becomes the group's one-line reason."""
    try:
        fn()
        failure(Fault("stopped", (spec.rank,)))
    except PipelineFailed as exc:
        failure(exc.fault, exc.detail)
    except LinkError as exc:
        if exc.detail == SILENT:
            failure(Fault("no_answer", (exc.peer,), exc.timeout_s))
        else:
            failure(Fault("closed" if exc.detail == CLOSED else "link_failed", (exc.peer,)), exc.detail)
    except LoadError as exc:
        failure(Fault("load_failed", (spec.rank,)), str(exc))
    except BaseException as exc:  # a bug or the device failing: the log has the trace, the group the code
        traceback.print_exc(file=sys.stderr)
        text = str(exc).strip().splitlines()
        failure(Fault("failed", (spec.rank,)), f"{type(exc).__name__}: {text[0] if text else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="pipeline_stage")
    ap.add_argument("--model", required=True, help="the slice's directory (config, safetensors; tokenizer on stage 0)")
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pipeline", required=True, help="the plan's pipeline details, as JSON")
    ap.add_argument("--served-name", help="the model's name in answers and /v1/models (default: its path)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--adapter", help="the slice of a LoRA adapter for this stage's layers (PEFT's format), merged "
                                      "at load")
    ap.add_argument("--dtype", choices=DTYPES, default="auto")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, help="decode lanes in flight at once (default: one per stage)")
    ap.add_argument("--stream-buffer", type=int, default=STREAM_BUFFER)
    ap.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_S)
    ap.add_argument("--recv-timeout", type=float, default=RECV_TIMEOUT_S)
    ap.add_argument("--silence-timeout", type=float, default=SILENCE_TIMEOUT_S)
    ap.add_argument("--reason-file", help="where the one-line reason goes when the stage fails")
    args = ap.parse_args()
    try:
        spec = GroupSpec.parse(json.loads(args.pipeline), args.port)
    except ValueError as exc:  # not JSON, or BadSettings
        print(f"pipeline_stage: bad --pipeline: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.threads:
        torch.set_num_threads(args.threads)
    key = os.environ.pop(PIPELINE_KEY_ENV, "")  # out of the environment: nothing the stage starts inherits it
    if not key:
        print(f"warning: {PIPELINE_KEY_ENV} is not set: this stage's rendezvous keys are named by the group id "
              "alone, which anyone who can reach the rendezvous port may read and write", file=sys.stderr, flush=True)
    status = Status(spec)
    failure = Failure(status, Path(args.reason_file) if args.reason_file else None, grace_s=2.0 if spec.rank == 0 else 0.5)
    threading.Thread(target=guarded, args=(lambda: stage(args, spec, status, failure, key), spec, failure),
                     name="pipeline-stage", daemon=True).start()
    serve(status, args.host, args.port)
    os._exit(failure.code)


if __name__ == "__main__":
    main()
