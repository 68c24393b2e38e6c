"""The `fleet-agent` command line: parses the arguments, runs one subcommand, and maps refusals to exit codes."""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from wire.command_line import Exit, UsageError, error_document, json_asked
from wire.windows import Window

from agent import __version__
from agent.machine import environment, identity, inventory
from agent.arguments import DEFAULT_HOME, DEFAULT_PORT, PEER_CA_ENV, build_parser

if TYPE_CHECKING:
    import ssl

    from agent.weights.sealed import Key

EXIT_REFUSED = Exit.INVALID_CONFIG  # the environment or the flags make it pointless: said why, did nothing


class CannotStart(Exception):
    """A reason not to start, said in full; `code` the error document's (a stable name)."""

    def __init__(self, message: str, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


def _home(args: argparse.Namespace) -> Path:
    # Absolute from the start: a relative home (`--home .`) would be reported as "." in the agent's
    # state, its store's paths relative too, and would change meaning with the working directory.
    return Path(os.path.abspath(args.home or os.environ.get("FLEET_AGENT_HOME") or DEFAULT_HOME))


def cmd_enroll(args: argparse.Namespace) -> int:
    home = _home(args)
    name = args.name or socket.gethostname()
    try:
        ident, created = identity.enroll(home, name, __version__)
    except (OSError, identity.NotEnrolled) as exc:
        raise CannotStart(f"cannot enrol under {home}: {exc}") from None
    if created:
        print(f"enrolled node {ident.name!r} with identity {ident.id} under {home}")
        print(f"pin it in fleet.yaml:  nodes.<name>.identity: {ident.id}")
    else:
        print(f"already enrolled: node {ident.name!r}, identity {ident.id} (since {ident.enrolled_at}); "
              f"nothing changed under {home}")
    return 0


def _secret() -> bytes:
    from agent.auth import BadSecret, cluster_secret

    try:
        return cluster_secret(os.environ.get("FLEET_CLUSTER_SECRET"))
    except BadSecret as exc:
        raise CannotStart(str(exc)) from None


def _weights_key(args: argparse.Namespace, guard: bool = False) -> Key | None:
    """The node's weights key (--key-file or $FLEET_WEIGHTS_KEY_FILE; $FLEET_WEIGHTS_KEY is refused).
    Once one is held (or `guard`: the agent, whose environment holds the cluster secret for its life)
    the process is made undumpable (sealed.guard_process): no worker can read its memory, its
    descriptors (the decrypted models' memfds) or its environment through /proc."""
    from agent.weights.sealed import KEY_ENV, KEY_FILE_ENV, KeyProblem, guard_process, load_key

    try:
        key = load_key(args.key_file, os.environ)
        if key is not None or guard:
            guard_process()
        return key
    except OSError as exc:
        raise CannotStart(f"cannot guard the process holding the weights key: {exc.strerror or exc}") from None
    except KeyProblem as exc:
        raise CannotStart(str(exc)) from None
    finally:  # no worker needs to know where the key is either
        os.environ.pop(KEY_ENV, None)
        os.environ.pop(KEY_FILE_ENV, None)


def _check_tls_pair(cert: str, key: str) -> None:
    """The certificate and key the agent will serve HTTPS with, loaded now: a file missing, unreadable
    or not the certificate's key stops the agent saying so (it was reported as a failure to listen,
    after the line saying it listened)."""
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=lambda: "")
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CannotStart(f"--tls-cert {cert} --tls-key {key}: cannot load the certificate with its key: "
                          f"{reason}", "tls_cert_unusable") from None


def _peer_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The CAs a peer's certificate is checked with when this agent fetches from it over TLS
    (--peer-ca-file or $FLEET_PEER_CA_FILE; else the system's), read now: a file that cannot be
    read stops the agent at start, not its first fetch."""
    import ssl

    from net.tls import client_context

    path = args.peer_ca_file or os.environ.get(PEER_CA_ENV)
    if not path:
        return None
    try:
        return client_context(path)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CannotStart(f"--peer-ca-file {path}: cannot read CA certificates from it: {reason}") from None


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise CannotStart(f"--listen {text!r}: expected ADDRESS:PORT, e.g. 127.0.0.2:{DEFAULT_PORT}")
    return host.strip("[]") or "0.0.0.0", int(port)


def cmd_serve(args: argparse.Namespace) -> int:
    home = _home(args)
    secret = _secret()
    try:
        ident = identity.load(home)
    except identity.NotEnrolled as exc:
        raise CannotStart(str(exc)) from None
    problems = [f for f in environment.directory_findings(home) if f.level == "error"]
    if problems:
        raise CannotStart("; ".join(f.message for f in problems) +
                      ". Fix the permissions (or point HF_HOME/TORCH_HOME/LLAMA_CACHE elsewhere) and start again.")
    try:
        wins = tuple(Window.parse(w) for w in args.available or ())
    except ValueError as exc:
        raise CannotStart(f"--available: {exc}") from None
    try:
        probe: inventory.GpuProbe = (inventory.SimulatedGpus(Path(args.simulate_gpus)) if args.simulate_gpus
                                     else inventory.default_probe())
    except ValueError as exc:
        raise CannotStart(str(exc)) from None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CannotStart("--tls-cert and --tls-key go together")
    if args.tls_cert:
        _check_tls_pair(args.tls_cert, args.tls_key)
    host, port = _listen(args.listen)
    peer_tls = _peer_tls(args)
    weights_key = _weights_key(args, guard=True)

    from agent.transfer.fetch import parse_size
    from agent.weights.verify import parse_period

    try:
        verify_every = parse_period(args.verify_every)
    except ValueError as exc:
        raise CannotStart(f"--verify-every: {exc}") from None
    try:
        reserve = None if args.disk_reserve is None else parse_size(args.disk_reserve)
    except ValueError as exc:
        raise CannotStart(f"--disk-reserve: {exc}") from None

    if args.max_connections is not None and args.max_connections < 1:
        raise CannotStart(f"--max-connections {args.max_connections}: expected 1 or more")
    try:
        control_plane = frozenset(str(ipaddress.ip_address(a)) for a in args.control_plane or ())
    except ValueError as exc:
        raise CannotStart(f"--control-plane: {exc} (an IP address the control plane connects from)") from None

    from agent.app import assemble, create_app
    from agent.backends.launch import ProcessLauncher, fork_server
    from agent.api.server import serve
    from agent.serving.registry import BACKENDS

    forks = None if args.no_fork_server else fork_server(BACKENDS.values(), home / "servers" / "forkserver.log")
    launcher = ProcessLauncher(forks)
    ctx = assemble(home, ident, secret, __version__, probe, launcher, listen_host=host, windows=wins,
                   verify_every_s=verify_every, disk_reserve=reserve, weights_key=weights_key, peer_tls=peer_tls)
    if isinstance(probe, inventory.SimulatedGpus):  # as NVML shows a loaded server's memory as used
        probe.loaded = ctx.workers.reserved
    app = create_app(ctx)
    return serve(app, host, port, ident, spawner=ctx.spawner, workers=ctx.workers,
                 max_connections=args.max_connections, tls_cert=args.tls_cert, tls_key=args.tls_key,
                 control_plane=control_plane, admits=app.admits)


def cmd_doctor(args: argparse.Namespace) -> int:
    home = _home(args)
    probe = inventory.SimulatedGpus(Path(args.simulate_gpus)) if args.simulate_gpus else inventory.default_probe()
    gpus = probe.gpus()
    eng = environment.engines()
    findings = environment.directory_findings(home)
    findings += environment.variant_findings(len(gpus), probe.note, eng,
                                             environment.llama_gpu_offload() if eng["llama_cpp"] else None)
    try:
        ident = identity.load(home)
        findings.insert(0, environment.Finding("ok", "identity", f"enrolled as {ident.name!r} ({ident.id})"))
    except identity.NotEnrolled as exc:
        findings.insert(0, environment.Finding("warning", "identity", str(exc)))
    gpu_line = ", ".join(f"{g.name} ({g.memory_free_bytes / 2**30:.1f} of {g.memory_total_bytes / 2**30:.1f} GiB free)"
                         for g in gpus) or f"none ({probe.note})"
    findings.insert(1, environment.Finding("ok", "gpus", f"GPUs via {probe.source}: {gpu_line}"))
    if args.json:
        print(json.dumps([{"level": f.level, "check": f.check, "message": f.message} for f in findings], indent=2))
    else:
        marks = {"ok": "ok  ", "warning": "warn", "error": "FAIL"}
        for f in findings:
            print(f"[{marks[f.level]}] {f.message}")
    # A failed check is the machine's configuration, as `fleet validate` finding an error is the file's.
    return Exit.INVALID_CONFIG if any(f.level == "error" for f in findings) else Exit.OK


def _piece_size(text: str) -> int | None:
    """The --piece-size given, or None for `auto` (wire.pieces.sized, file by file)."""
    from wire.pieces import MAX_PIECE, MIN_PIECE

    from agent.transfer.fetch import parse_size

    if text.strip().lower() == "auto":
        return None
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise CannotStart(f"--piece-size: {exc}, or auto") from None
    if not MIN_PIECE <= size <= MAX_PIECE:
        raise CannotStart(f"--piece-size must be from {MIN_PIECE:,} to {MAX_PIECE:,} bytes, not {size:,}")
    return size


def cmd_import(args: argparse.Namespace) -> int:
    from agent.weights.importing import default_name
    from agent.weights.store import Store, StoreError

    home = _home(args)
    try:
        identity.load(home)
    except identity.NotEnrolled as exc:
        raise CannotStart(str(exc)) from None
    src = Path(args.path)
    name = args.name or default_name(src)
    key = _weights_key(args)
    if args.encrypt and key is None:
        raise CannotStart("--encrypt needs this node's weights key: --key-file PATH or $FLEET_WEIGHTS_KEY_FILE "
                      "(make one with: head -c 32 /dev/urandom > KEYFILE; chmod 600 KEYFILE)")
    if args.encrypt and args.link:
        raise CannotStart("--encrypt stores an encrypted copy; it cannot hard-link the original (--link)")
    piece_bytes = _piece_size(args.piece_size)
    try:
        digest, manifest = Store(home, key).import_model(src, name, link=args.link, encrypt=args.encrypt,
                                                         piece_bytes=piece_bytes)
    except (StoreError, OSError) as exc:
        raise CannotStart(f"cannot import {src}: {exc}", getattr(exc, "code", "refused")) from None
    size = sum(f["size"] for f in manifest["files"])
    if args.json:
        print(json.dumps({"digest": digest, "name": name, "format": manifest["format"], "bytes": size,
                          "layers": manifest["layers"], "encryption": manifest.get("encryption")}))
    else:
        print(f"imported {name!r} ({manifest['format']}, {len(manifest['files'])} files, {size:,} bytes)")
        print(f"digest: {digest}")
        if args.encrypt:
            print(f"encrypted at rest (aes-256-gcm) under key {manifest['encryption']['key_id']}; nothing of it is "
                  "stored in plaintext")
        sealed = ", encrypted: true" if args.encrypt else ""
        print(f"in fleet.yaml:  models.{name}: {{format: {manifest['format']}, digest: \"{digest}\", "
              f"source: <this node>{sealed}}}")
        if manifest["format"] == "peft":  # a LoRA adapter: what it says of itself, and where it goes
            a = manifest["adapter"]
            print(f"a LoRA adapter (rank {a['rank']}, alpha {a['alpha']}, on {', '.join(a['target_modules'])}) made on "
                  f"{a['base_model'] or 'a base it does not name'}; merged by a cluster naming it: "
                  f"clusters.NAME.adapter: {name}")
    return 0


def cmd_make_test_model(args: argparse.Namespace) -> int:
    try:
        from agent.simulation import testmodel
    except ImportError as exc:
        raise CannotStart(f"making test models needs numpy, safetensors, gguf and tokenizers "
                      f"(pip install 'inference-fleet[testmodels]'): {exc}") from None
    shape = testmodel.Shape(layers=args.layers, hidden=args.hidden, intermediate=args.hidden * 2)
    out = Path(args.out)
    if args.format == "gguf":
        path = testmodel.make_gguf(out, shape)
    else:
        path = testmodel.make_safetensors(out, shape)
    print(path)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from agent.weights.convert import ConvertError, convert

    try:
        out = convert(Path(args.gguf), Path(args.out), args.dtype)
    except ConvertError as exc:
        raise CannotStart(str(exc)) from None
    print(f"wrote {out} ({args.dtype} safetensors, tokenizer and chat template); serve it on PyTorch after "
          f"`fleet-agent import {out}`")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from agent.simulation import simulate

    held = []
    for spec in args.hold or ():
        digest, fmt, size = spec.rsplit(":", 2) if spec.count(":") >= 3 else (spec, "safetensors", "1000")
        held.append({"digest": digest, "format": fmt, "bytes": int(size)})
    simulate.serve(Path(args.dir), args.first, args.count, args.port, _secret(), Path(args.gpus), held)
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    from argcomplete.shell_integration import shellcode

    sys.stdout.write(shellcode(["fleet-agent"], shell=args.shell))
    return Exit.OK


# Each command of the parser (agent/arguments.py), by its name.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "enroll": cmd_enroll, "serve": cmd_serve, "import": cmd_import, "make-test-model": cmd_make_test_model,
    "convert": cmd_convert, "simulate": cmd_simulate, "doctor": cmd_doctor, "completion": cmd_completion}


def _fail(argv: Sequence[str], command: str, exit: Exit, code: str, message: str, hint: str = "") -> int:
    """Say why on stderr and, to a caller that asked for JSON, in the error document on stdout."""
    print(f"{command}: {message}" + (f"\n  hint: {hint}" if hint else ""), file=sys.stderr)
    if json_asked(argv):
        print(json.dumps(error_document(command, exit, code, message, hint), indent=2), flush=True)
    return exit


def run(argv: Sequence[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        if json_asked(argv):
            print(json.dumps(error_document(exc.prog, Exit.USAGE, "usage", exc.message, exc.hint), indent=2))
        sys.stderr.write(exc.text())
        return Exit.USAGE
    if args.command is None:  # bare `fleet-agent`: the help, and the usage code, as `fleet`
        parser.print_help(sys.stderr)
        return Exit.USAGE
    command = f"fleet-agent {args.command}"
    try:
        return int(COMMANDS[args.command](args))
    except CannotStart as exc:
        message = f"refusing to start: {exc}" if args.command == "serve" else str(exc)
        return _fail(argv, command, EXIT_REFUSED, exc.code, message)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions: answer them and exit
        import argcomplete

        argcomplete.autocomplete(build_parser())
    logging.basicConfig(level=logging.INFO, format="fleet-agent: %(message)s", stream=sys.stderr)
    try:
        code = run(args)
    except KeyboardInterrupt:
        code = _fail(args, "fleet-agent", Exit.INTERRUPTED, "interrupted", "interrupted (Ctrl-C)")
    except Exception as exc:  # a bug: say so plainly; the traceback only when asked for
        if os.environ.get("FLEET_DEBUG"):
            raise
        code = _fail(args, "fleet-agent", Exit.FAILURE, "internal_error",
                     f"internal error: {type(exc).__name__}: {exc}",
                     "This is a bug in fleet. Run again with FLEET_DEBUG=1 for the traceback and report it.")
    sys.exit(code)
