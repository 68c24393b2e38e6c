"""Server processes: start (returning at once), supervise to `running` or `failed` with the full
reason, stop (SIGTERM, then SIGKILL), and never restart on their own. Processes come from an
injected Launcher; how each engine is launched comes from its spec in agent/backends/. A slice is
served only as a stage of a pipeline, whose details the start carries."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import trio

from wire.ids import split_server_id
from wire.layers import LayerRange
from wire.plan_details import GpuShare, PipelineDetails
from wire.state import GpuJson, Integrity, PipelineInfo, ServerEntry, ServerExit, WeightsEntry

from agent.serving import registry
from agent.auth import WORKER_CREDENTIAL_ENV, new_worker_credential
from agent.backends.pipeline.spec import PIPELINE_KEY_ENV, check_details, group_key
from agent.backends.launch import BadSettings, Launcher, LaunchSpec, Process, gpu_environment
from agent.weights.store import Store, WeightStore
from agent.weights.unseal import Unsealer

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}\Z")  # \Z: `$` passes a final newline
DEFAULT_STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
TAIL_LINES = 40
HEALTH_EVERY_S = 0.25
GIB = 1 << 30
# The states in which a server's process may hold GPU memory: what it reserved counts as fleet's
# on its GPUs (the over-commit check, the simulated GPUs' free memory, the planner's ledger) until
# its process has exited.
HOLDING = ("starting", "running", "stopping")


class RequestRefused(Exception):
    """A request the agent will not carry out: the HTTP status, a stable code and the reason."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    # Progress bars redraw with \r; keep what a person would have seen last on each line.
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(kept[-lines:])


@dataclass
class Server:
    """One server this agent was asked to run: mutable, as its supervisor moves it along."""

    id: str
    digest: str
    backend: str
    host: str
    port: int
    settings: dict[str, Any]
    speculative: dict[str, Any] | None
    argv: list[str]
    log: Path
    state: str = "starting"
    pid: int | None = None
    reason: str | None = None
    exit: ServerExit | None = None
    started: float = field(default_factory=time.time)
    proc: Process | None = None
    pipeline: PipelineInfo | None = None  # a pipeline stage's place in its group
    reason_file: Path | None = None  # where the worker writes why it failed, in one line
    # What the worker asks of every request (agent/auth.py WorkerAuth), reported in the state so
    # that the router can send it: as private as the agent's API, which needs the cluster secret.
    credential: str = field(default="", repr=False)
    gpus: list[GpuShare] = field(default_factory=list)  # the GPUs it was given, and what it reserved on each
    env: dict[str, str] = field(default_factory=dict)  # added to its environment (CUDA_VISIBLE_DEVICES)

    def to_json(self) -> ServerEntry:
        out: ServerEntry = {"id": self.id, "state": self.state, "model": self.digest, "backend": self.backend,
                            "host": self.host, "port": self.port, "pid": self.pid, "settings": self.settings,
                            "speculative": self.speculative, "uptime_s": round(time.time() - self.started, 1),
                            "reason": self.reason, "exit": self.exit, "credential": self.credential}
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        if self.gpus:
            out["gpus"] = [{**g} for g in self.gpus]
        return out


def _describe_exit(code: int) -> tuple[str, ServerExit]:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"was killed by signal {-code} ({name})", {"code": None, "signal": -code}
    return f"exited with code {code}", {"code": code, "signal": None}




def _told(path: Path | None) -> str | None:
    """The one line a worker wrote about why it failed, if it wrote one."""
    if path is None:
        return None
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return None
    return text.splitlines()[0][:2000] if text else None


def _also_loaded(server: Server) -> tuple[Any, ...]:
    """The digests a server loads besides its model: its draft model, its LoRA adapter."""
    return ((server.speculative or {}).get("draft_digest"), (server.settings.get("adapter") or {}).get("digest"))


def _refuse_corrupt(entry: WeightsEntry) -> None:
    integrity = entry.get("integrity")
    if integrity is not None and integrity["state"] == "corrupt":
        raise RequestRefused(409, "model_corrupt", f"model {entry['digest']} is corrupt on this node: {integrity['file']}: "
                                            f"{integrity['reason']} (found {integrity['checked_at']}); no server "
                                            "starts on it until it is fetched again from a good copy (fleet apply)")


# What a start's `settings` may hold: schemas/plan.schema.json's $defs/settings (the planner's
# ServerSettings, wire/plan_details.py), checked here as the plan file is checked there
# (tests/unit/test_start_checks.py holds the two to the same verdicts).
_POSITIVE_INTS = ("context_length", "threads", "batch_size", "parallel", "tensor_parallel")
SETTINGS_KEYS = (*_POSITIVE_INTS, "speculative", "adapter", "startup_timeout_s")
_SPECULATIVE_KEYS = ("mode", "draft", "draft_digest", "tokens")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad_settings(where: str, what: str) -> RequestRefused:
    return RequestRefused(400, "bad_settings", f"{where}: {what}")


def check_settings(value: Any) -> dict[str, Any]:
    """A start's settings (absent or null: none), or RequestRefused 400 `bad_settings` naming the place."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad_settings("settings", f"must be an object, not {type(value).__name__} {json_repr(value)}")
    for key, item in value.items():
        where = f"settings.{key}"
        if key not in SETTINGS_KEYS:
            raise _bad_settings(where, f"is not a setting (known: {', '.join(SETTINGS_KEYS)})")
        if key in _POSITIVE_INTS and not (_is_int(item) and item >= 1):
            raise _bad_settings(where, f"must be an integer of at least 1, not {json_repr(item)}")
        if key == "startup_timeout_s" and not (isinstance(item, (int, float)) and not isinstance(item, bool)
                                               and item > 0):
            raise _bad_settings(where, f"must be a number above 0, not {json_repr(item)}")
        if key == "adapter" and not (isinstance(item, dict) and set(item) == {"name", "digest"}
                                     and isinstance(item["name"], str) and item["name"]
                                     and isinstance(item["digest"], str) and _DIGEST.match(item["digest"])):
            raise _bad_settings(where, f"must be an object of exactly name and digest (sha256:<64 hex>), not "
                                       f"{json_repr(item)}")
        if key == "speculative":
            if not isinstance(item, dict):
                raise _bad_settings(where, f"must be an object, not {json_repr(item)}")
            for k in item:
                if k not in _SPECULATIVE_KEYS:
                    raise _bad_settings(f"{where}.{k}", f"is not a speculative setting (known: "
                                                        f"{', '.join(_SPECULATIVE_KEYS)})")
            if item.get("mode") not in ("draft", "prompt_lookup"):
                raise _bad_settings(f"{where}.mode", f'must be "draft" or "prompt_lookup", not '
                                                     f"{json_repr(item.get('mode'))}")
            if "draft" in item and not (isinstance(item["draft"], str) and item["draft"]):
                raise _bad_settings(f"{where}.draft", "must be a model name")
            if "draft_digest" in item and not (isinstance(item["draft_digest"], str)
                                               and _DIGEST.match(item["draft_digest"])):
                raise _bad_settings(f"{where}.draft_digest", "must be a digest sha256:<64 hex>")
            if "tokens" in item and not (_is_int(item["tokens"]) and item["tokens"] >= 1):
                raise _bad_settings(f"{where}.tokens", f"must be an integer of at least 1, not "
                                                       f"{json_repr(item['tokens'])}")
    return value


def json_repr(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_gpus(value: Any, present: Sequence[GpuJson]) -> list[GpuShare]:
    """The GPUs a start names, as wire.plan_details.GpuShare: each an index this node's inventory
    has now, with the uuid it has there (400 bad_gpus for a malformed list, 409 gpu_not_found for
    a GPU the node does not have as named: the plan was made against another inventory)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestRefused(400, "bad_gpus", f"gpus must be a list of {{index, uuid, bytes}}, not {json_repr(value)}")
    by_index = {g["index"]: g for g in present}
    out: list[GpuShare] = []
    for i, item in enumerate(value):
        where = f"gpus[{i}]"
        if not isinstance(item, dict) or set(item) != {"index", "uuid", "bytes"}:
            raise RequestRefused(400, "bad_gpus", f"{where} must be an object of exactly index, uuid and bytes, not "
                                           f"{json_repr(item)}")
        index, uuid, nbytes = item["index"], item["uuid"], item["bytes"]
        if not (_is_int(index) and index >= 0) or not isinstance(uuid, str) or not (_is_int(nbytes) and nbytes >= 0):
            raise RequestRefused(400, "bad_gpus", f"{where}: index must be an integer of at least 0, uuid a string and "
                                           f"bytes an integer of at least 0, not {json_repr(item)}")
        if any(g["index"] == index or g["uuid"] == uuid for g in out):
            raise RequestRefused(400, "bad_gpus", f"{where}: GPU {index} ({uuid}) is named twice")
        gpu = by_index.get(index)
        if gpu is None:
            have = ", ".join(f"{g['index']} ({g['uuid']})" for g in present) or "none"
            raise RequestRefused(409, "gpu_not_found", f"{where}: this node has no GPU {index} now (its GPUs: {have}); "
                                                "plan again")
        if gpu["uuid"] != uuid:
            raise RequestRefused(409, "gpu_not_found", f"{where}: GPU {index} of this node is {gpu['uuid']}, not {uuid} "
                                                "(the GPUs were renumbered or replaced since the plan); plan again")
        out.append({"index": index, "uuid": uuid, "bytes": nbytes})
    return out


class Workers:
    """The agent's table of servers, and the supervision of each one's process."""

    def __init__(self, home: Path, store: WeightStore, spawn: Callable[..., None], launcher: Launcher,
                 default_host: str, specs: Mapping[str, LaunchSpec] = registry.BACKENDS, secret: bytes = b"") -> None:
        self.store = store
        self.secret = secret  # the cluster secret: a pipeline stage's rendezvous secret is derived from it
        self.spawn = spawn
        self.launcher = launcher
        self.specs = specs  # the engines this agent can start, by backend name
        self.default_host = default_host
        self.logs = home / "servers"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.servers: dict[str, Server] = {}
        # Encrypted models are served from memory (agent/weights/unseal.py); a simulation's store holds none.
        self.unsealer = Unsealer(store, self.logs) if isinstance(store, Store) else None

    def reserved(self) -> dict[str, int]:
        """What this agent's servers reserve on each GPU, by uuid: those whose process may hold memory."""
        out: dict[str, int] = {}
        for s in self.servers.values():
            if s.state in HOLDING:
                for g in s.gpus:
                    out[g["uuid"]] = out.get(g["uuid"], 0) + g["bytes"]
        return out

    def _refuse_overcommit(self, sid: str, shares: Sequence[GpuShare], present: Sequence[GpuJson]) -> None:
        """A start whose reservation on a GPU, with what this agent's other servers reserve there,
        exceeds what processes that are not fleet's leave of it (NVML's used memory less fleet's
        reservations, never below 0): the sum the planner's ledger makes (reconciler/planning)."""
        by_uuid = {g["uuid"]: g for g in present}
        for share in shares:
            gpu = by_uuid[share["uuid"]]
            holders = [(s.id, g["bytes"]) for s in self.servers.values() if s.state in HOLDING and s.id != sid
                       for g in s.gpus if g["uuid"] == share["uuid"]]
            fleet = sum(b for _, b in holders)
            total = gpu["memory_total_bytes"]
            others = max(0, total - gpu["memory_free_bytes"] - fleet)
            room = total - others - fleet
            if share["bytes"] > room:
                held = ", ".join(f"{h} {b / GIB:.2f} GiB" for h, b in holders) or "none"
                raise RequestRefused(409, "gpu_overcommitted",
                              f"GPU {gpu['index']} ({gpu['uuid']}, {gpu['name']}) cannot take "
                              f"{share['bytes'] / GIB:.2f} GiB for {sid}: of its {total / GIB:.2f} GiB, fleet's servers reserve "
                              f"{fleet / GIB:.2f} GiB ({held}) and processes that are not fleet's hold "
                              f"{others / GIB:.2f} GiB, leaving {max(0, room) / GIB:.2f} GiB; plan again")

    async def model_corrupt(self, digest: str, found: Integrity) -> None:
        """A held model was found corrupt (agent/weights/verify.py): every server on it (served, or
        as its draft) is failed at once, with the reason, and its process killed, not stopped with
        a grace: an engine that maps the store's file (llama.cpp) answers from the corrupt bytes
        from the moment they changed. The state shows them failed, so the router sends them
        nothing more; a plan starts them again once the model is fetched again (a new file,
        renamed into the store: nothing rewrites a mapped file in place)."""
        reason = (f"model {digest} was found corrupt on this node ({found['file']}: {found['reason']}, at "
                  f"{found['checked_at']}); its server was killed so that nothing more is answered from the "
                  "corrupt copy, and starts again once the model is fetched again (fleet apply)")
        for server in list(self.servers.values()):
            if server.state in ("starting", "running") and (
                    server.digest == digest or digest in _also_loaded(server)):
                server.state, server.reason = "failed", reason
                if server.proc is not None and server.proc.poll() is None:
                    server.proc.kill()  # its supervisor reaps it and keeps the reason (and adds the log's tail)

    def using(self, digest: str) -> str | None:
        for s in self.servers.values():
            if s.state in ("starting", "running", "stopping") and (
                    s.digest == digest or digest in _also_loaded(s)):
                return s.id
        return None

    def _model_path(self, digest: str, what: str) -> str:
        entry = self._model(digest, what)
        if "encryption" in entry:  # its path holds ciphertext: only the served model is decrypted
            raise RequestRefused(409, "encrypted_draft_unsupported", f"{what} {digest} is encrypted; a {what} is "
                                                              "loaded from its stored files, so it must be a plain one")
        return str(entry["path"])

    def _model(self, digest: str, what: str) -> WeightsEntry:
        if not self.store.is_present(digest):
            raise RequestRefused(409, "model_not_held", f"{what} {digest} is not held on this node; replicate it first")
        entry = self.store.entry(digest)
        _refuse_corrupt(entry)
        if entry["slice"]:
            raise RequestRefused(409, "model_is_slice", f"{what} {digest} is held only as a slice (layers "
                                                 f"{entry['slice']['layers']}); a slice is served only as a "
                                                 "pipeline stage (a start with pipeline details)")
        return entry

    def _stage_model(self, digest: str, details: PipelineDetails) -> WeightsEntry:
        """The slice a pipeline stage serves: held, and of the layers its place in the group says."""
        return self._stage_slice(digest, details, "model", "serves")

    def _stage_adapter(self, digest: str, details: PipelineDetails) -> WeightsEntry:
        """The slice of a LoRA adapter a pipeline stage merges: held, an adapter, of the stage's layers."""
        return self._stage_slice(digest, details, "adapter", "merges")

    def _stage_slice(self, digest: str, details: PipelineDetails, kind: str, verb: str) -> WeightsEntry:
        """A stage's slice of a model (kind "model") or of a PEFT adapter ("adapter"): held here, not
        corrupt, of the right format, and of exactly the layers the stage's place in the group says."""
        if not self.store.is_present(digest):
            raise RequestRefused(409, "model_not_held", f"{kind} {digest} is not held on this node; replicate it first")
        entry = self.store.entry(digest)
        _refuse_corrupt(entry)
        if kind == "adapter" and entry["format"] != "peft":
            raise RequestRefused(409, "not_an_adapter", f"adapter {digest} is held here, but as a model, not a PEFT "
                                                        "adapter")
        rank = details["rank"]
        wanted = LayerRange.parse(details["stages"][rank]["layers"])
        held = entry["slice"]
        if held is None or LayerRange.parse(held["layers"]) != wanted:
            what = f"layers {held['layers']}" if held else f"the whole {kind}"
            raise RequestRefused(409, "pipeline_slice_mismatch", f"{kind} {digest} holds {what}, but stage {rank} of "
                                                                 f"pipeline {details['group']} {verb} layers {wanted}")
        return entry

    def start(self, body: dict[str, Any], present: Sequence[GpuJson] = ()) -> Server:
        """Start the server `body` describes (POST /v1/servers); `present`: the node's GPUs measured
        now, against which the GPUs it names are checked and reserved."""
        sid = body.get("id")
        if not isinstance(sid, str) or not ID_RE.match(sid):
            raise RequestRefused(400, "bad_request", "id must be 1-128 letters, digits, '.', '_', '@' or '-'")
        old = self.servers.get(sid)
        if old is not None and old.state in ("starting", "running", "stopping"):
            raise RequestRefused(409, "server_exists", f"server {sid} is already {old.state}; stop it first")
        digest, port = body.get("model"), body.get("port")
        if not isinstance(digest, str):
            raise RequestRefused(400, "bad_request", "model must be a model digest")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise RequestRefused(400, "bad_request", "port must be an integer 1-65535")
        host = body.get("host") or self.default_host
        settings = body.get("settings")
        settings = {} if settings is None else settings
        if not isinstance(settings, dict):  # POST /v1/servers checks them whole first (check_settings)
            raise RequestRefused(400, "bad_settings", f"settings must be an object, not {json_repr(settings)}")
        shares = check_gpus(body.get("gpus"), present)
        tensor_parallel = settings.get("tensor_parallel")
        if shares and tensor_parallel is not None and tensor_parallel != len(shares):
            raise RequestRefused(400, "bad_gpus", f"settings.tensor_parallel is {tensor_parallel} but gpus names "
                                           f"{len(shares)} GPU(s): a server is split over exactly its GPUs")
        self._refuse_overcommit(sid, shares, present)
        details = None
        if body.get("pipeline") is not None:
            try:
                details = check_details(body["pipeline"])
            except BadSettings as exc:
                raise RequestRefused(400, "bad_request", str(exc)) from None
            entry = self._stage_model(digest, details)
            spec = self.specs.get(registry.PIPELINE)
            if spec is None or spec.format != entry["format"]:
                raise RequestRefused(409, "format_not_served", f"model {digest} is a slice of a {entry['format']} model, "
                                                        "which this agent does not serve as a pipeline stage")
        else:
            entry = self._model(digest, "model")
            found = registry.for_format(entry["format"], self.specs)
            if found is None:
                raise RequestRefused(409, "format_not_served", f"model {digest} is stored as {entry['format']}, which no "
                                                        "backend of this agent serves")
            spec = found
        adapter = settings.get("adapter")
        adapter_dir = None
        if isinstance(adapter, dict) and details is not None:  # a stage merges the slice of it for its layers
            adapter_dir = self._stage_adapter(str(adapter["digest"]), details)["path"]
        elif isinstance(adapter, dict):  # a LoRA adapter, merged at load: PyTorch's servers only
            if spec.format != "safetensors":
                raise RequestRefused(409, "adapter_unsupported", f"model {digest} is served by the {spec.name} "
                                                                 "backend, which merges no LoRA adapter (only "
                                                                 "safetensors models do)")
            if self._model(str(adapter["digest"]), "adapter")["format"] != "peft":
                raise RequestRefused(409, "not_an_adapter", f"adapter {adapter['digest']} is held here, but as a model, "
                                                     "not a PEFT adapter")
        missing = self.launcher.missing(spec.modules)
        if missing:
            raise RequestRefused(409, "backend_not_installed",
                          f"the {spec.name} backend needs {', '.join(missing)}, not installed on this node: "
                          f"pip install 'inference-fleet[{spec.extra}]'")
        problem = self.launcher.port_problem(host, port)
        if problem:
            raise RequestRefused(409, "port_unavailable", f"port {port} on {host} is {problem}; another server or "
                                                    "process holds it")
        reason_file = self.logs / f"{sid}.reason"
        # The engine names its model by the cluster (the id's first part), never by a store path, so
        # neither /v1/models nor a chunk's `model` shows a path, even to someone on the worker's port.
        launch_settings = {**settings, "served_name": split_server_id(sid)[0]}
        if shares:  # the engine's own options for its GPUs: each one's free memory now, in the given order
            free = {g["uuid"]: g["memory_free_bytes"] for g in present}
            launch_settings["gpus"] = [{**g, "free_bytes": free[g["uuid"]]} for g in shares]
        if details is not None:
            rdv = details["rendezvous"]
            problem = self.launcher.port_problem(rdv["address"], rdv["port"]) if details["rank"] == 0 else None
            if problem:
                raise RequestRefused(409, "port_unavailable", f"the pipeline's rendezvous port {rdv['port']} on "
                                                        f"{rdv['address']} is {problem}; another server or process "
                                                        "holds it")
            launch_settings = {**launch_settings, "pipeline": details, "reason_file": str(reason_file)}
            if adapter_dir is not None:
                launch_settings["adapter_dir"] = adapter_dir
        unsealer = self.unsealer if "encryption" in entry else None
        opened = unsealer.prepare(sid, entry) if unsealer is not None else None  # its own links per start
        model_path = opened.path if opened is not None else entry["path"]
        try:
            command = spec.command(model_path, host, port, launch_settings, self._model_path)
        except BadSettings as exc:
            raise RequestRefused(400, "bad_request", str(exc)) from None
        log = self.logs / f"{sid}.log"
        log.write_bytes(b"")
        reason_file.unlink(missing_ok=True)
        server = Server(sid, digest, spec.name, host, port, settings, command.speculative, list(command.argv), log,
                        credential=new_worker_credential(), gpus=shares,
                        env=gpu_environment(shares, tensor_parallel is not None))
        if details is not None:
            server.pipeline = {"group": details["group"], "rank": details["rank"], "world_size": details["world_size"]}
            server.reason_file = reason_file
        self.servers[sid] = server
        if unsealer is not None and opened is not None:  # decrypted into memory first; a wrong key or
            # tampered weights fail it
            self.spawn(unsealer.run, server, opened, entry, functools.partial(self._supervise, server, spec))
        else:
            self.spawn(self._supervise, server, spec)
        return server

    def _stage_env(self, server: Server) -> dict[str, str]:
        """A pipeline stage's rendezvous secret, which its group's stages prove at the rendezvous
        (agent/backends/pipeline/group.py): derived from the cluster secret, in no plan."""
        if server.pipeline is None or not self.secret:
            return {}
        return {PIPELINE_KEY_ENV: group_key(self.secret, server.pipeline["group"])}

    async def _supervise(self, server: Server, spec: LaunchSpec, keep_fds: Sequence[int] = ()) -> None:
        if server.state != "starting":  # failed before its process began (its model found corrupt meanwhile)
            return
        timeout = float(server.settings.get("startup_timeout_s") or DEFAULT_STARTUP_TIMEOUT_S)
        try:
            proc = await self.launcher.launch(server.argv, server.log, {**server.env, **self._stage_env(server),
                                                                  WORKER_CREDENTIAL_ENV: server.credential}, keep_fds)
        except OSError as exc:
            server.state, server.reason = "failed", f"could not start {server.argv[0]}: {exc}"
            return
        if server.state != "starting":  # stopped while its launch waited (on the fork server's imports)
            proc.kill()
            await proc.wait()
            return
        server.proc, server.pid = proc, proc.pid
        timed_out: list[str] = []
        async with trio.open_nursery() as nursery:
            async def watch_health() -> None:
                url = f"http://{server.host}:{server.port}{spec.health}"
                deadline = trio.current_time() + timeout
                while server.state == "starting":
                    if await self.launcher.answers(url, server.credential):
                        server.state = "running"
                        return
                    if trio.current_time() > deadline:
                        # failed only once reaped below, so no one sees a failed server without its exit
                        timed_out.append(f"did not answer its health check ({spec.health}) within {timeout:g}s "
                                         f"(startup_timeout_s); killed")
                        proc.kill()
                        return
                    await trio.sleep(HEALTH_EVERY_S)

            nursery.start_soon(watch_health)
            code = await proc.wait()
            nursery.cancel_scope.cancel()
        how, server.exit = _describe_exit(code)
        if timed_out:
            server.state, server.reason = "failed", timed_out[0]
        if server.state == "stopping":
            server.state = "stopped"
            return
        stderr = tail(server.log)
        first = server.reason if server.state == "failed" and server.reason else f"the worker {how}"
        told = _told(server.reason_file)
        if told and not (server.state == "failed" and server.reason):
            first = f"{told}; the worker {how}"  # the worker's own account of why first
        server.state = "failed"
        server.reason = f"{first}\n--- last lines of its output ({server.log}) ---\n{stderr}" if stderr else first

    async def stop(self, sid: str, grace: float = STOP_GRACE_S) -> Server:
        server = self.servers.get(sid)
        if server is None:
            raise RequestRefused(404, "server_not_found", f"no server {sid} on this node")
        proc = server.proc
        if proc is not None and proc.poll() is None:
            server.state = "stopping"
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace):
                while proc.poll() is None:
                    await trio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                await proc.wait()
            while server.state == "stopping":  # let the supervisor record the exit
                await trio.sleep(0.01)
        self.servers.pop(sid, None)
        server.state = "stopped"
        return server

    async def stop_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for sid in list(self.servers):
                nursery.start_soon(self.stop, sid)
