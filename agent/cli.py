"""The `fleet-agent` command line: parses the arguments, runs one subcommand, and maps refusals to exit codes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from wire.command_line import Exit, Parser, UsageError, error_document, exit_codes_epilog, json_asked
from wire.windows import Window

from . import __version__, environment, identity, inventory

if TYPE_CHECKING:
    import ssl

    from .sealed import Key

DEFAULT_HOME = "/var/lib/fleet-agent"
DEFAULT_PORT = 7070
PEER_CA_ENV = "FLEET_PEER_CA_FILE"
EXIT_REFUSED = Exit.INVALID_CONFIG  # the environment or the flags make it pointless: said why, did nothing


class Refused(Exception):
    """A reason not to start, said in full."""


def _home(args: argparse.Namespace) -> Path:
    return Path(args.home or os.environ.get("FLEET_AGENT_HOME") or DEFAULT_HOME)


def cmd_enroll(args: argparse.Namespace) -> int:
    home = _home(args)
    name = args.name or socket.gethostname()
    try:
        ident, created = identity.enroll(home, name, __version__)
    except (OSError, identity.NotEnrolled) as exc:
        raise Refused(f"cannot enrol under {home}: {exc}") from None
    if created:
        print(f"enrolled node {ident.name!r} with identity {ident.id} under {home}")
        print(f"pin it in fleet.yaml:  nodes.<name>.identity: {ident.id}")
    else:
        print(f"already enrolled: node {ident.name!r}, identity {ident.id} (since {ident.enrolled_at}); "
              f"nothing changed under {home}")
    return 0


def _secret() -> bytes:
    from .auth import BadSecret, cluster_secret

    try:
        return cluster_secret(os.environ.get("FLEET_CLUSTER_SECRET"))
    except BadSecret as exc:
        raise Refused(str(exc)) from None


def _weights_key(args: argparse.Namespace, guard: bool = False) -> Key | None:
    """The node's weights key (--key-file or $FLEET_WEIGHTS_KEY_FILE; $FLEET_WEIGHTS_KEY is refused).
    Once one is held (or `guard`: the agent, whose environment holds the cluster secret for its life)
    the process is made undumpable (sealed.guard_process): no worker can read its memory, its
    descriptors (the decrypted models' memfds) or its environment through /proc."""
    from .sealed import KEY_ENV, KEY_FILE_ENV, KeyProblem, guard_process, load_key

    try:
        key = load_key(args.key_file, os.environ)
        if key is not None or guard:
            guard_process()
        return key
    except OSError as exc:
        raise Refused(f"cannot guard the process holding the weights key: {exc.strerror or exc}") from None
    except KeyProblem as exc:
        raise Refused(str(exc)) from None
    finally:  # no worker needs to know where the key is either
        os.environ.pop(KEY_ENV, None)
        os.environ.pop(KEY_FILE_ENV, None)


def _peer_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The CAs a peer's certificate is checked with when this agent fetches from it over TLS
    (--peer-ca-file or $FLEET_PEER_CA_FILE; else the system's), read now: a file that cannot be
    read stops the agent at start, not its first fetch."""
    import ssl

    path = args.peer_ca_file or os.environ.get(PEER_CA_ENV)
    if not path:
        return None
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise Refused(f"--peer-ca-file {path}: cannot read CA certificates from it: {reason}") from None


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise Refused(f"--listen {text!r}: expected ADDRESS:PORT, e.g. 127.0.0.2:{DEFAULT_PORT}")
    return host.strip("[]") or "0.0.0.0", int(port)


def cmd_serve(args: argparse.Namespace) -> int:
    home = _home(args)
    secret = _secret()
    try:
        ident = identity.load(home)
    except identity.NotEnrolled as exc:
        raise Refused(str(exc)) from None
    problems = [f for f in environment.directory_findings(home) if f.level == "error"]
    if problems:
        raise Refused("; ".join(f.message for f in problems) +
                      ". Fix the permissions (or point HF_HOME/TORCH_HOME/LLAMA_CACHE elsewhere) and start again.")
    try:
        wins = tuple(Window.parse(w) for w in args.available or ())
    except ValueError as exc:
        raise Refused(f"--available: {exc}") from None
    try:
        probe: inventory.GpuProbe = (inventory.SimulatedGpus(Path(args.simulate_gpus)) if args.simulate_gpus
                                     else inventory.default_probe())
    except ValueError as exc:
        raise Refused(str(exc)) from None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise Refused("--tls-cert and --tls-key go together")
    host, port = _listen(args.listen)
    peer_tls = _peer_tls(args)
    weights_key = _weights_key(args, guard=True)

    from .fetch import parse_size
    from .verify import parse_period

    try:
        verify_every = parse_period(args.verify_every)
    except ValueError as exc:
        raise Refused(f"--verify-every: {exc}") from None
    try:
        reserve = None if args.disk_reserve is None else parse_size(args.disk_reserve)
    except ValueError as exc:
        raise Refused(f"--disk-reserve: {exc}") from None

    from .app import assemble, create_app
    from .launch import ProcessLauncher
    from .server import serve

    ctx = assemble(home, ident, secret, __version__, probe, ProcessLauncher(), listen_host=host, windows=wins,
                   verify_every_s=verify_every, disk_reserve=reserve, weights_key=weights_key, peer_tls=peer_tls)
    return serve(create_app(ctx), host, port, ident, spawner=ctx.spawner, workers=ctx.workers,
                 tls_cert=args.tls_cert, tls_key=args.tls_key)


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


def _piece_size(text: str) -> int:
    from wire.pieces import MAX_PIECE, MIN_PIECE

    from .fetch import parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise Refused(f"--piece-size: {exc}") from None
    if not MIN_PIECE <= size <= MAX_PIECE:
        raise Refused(f"--piece-size must be from {MIN_PIECE:,} to {MAX_PIECE:,} bytes, not {size:,}")
    return size


def cmd_import(args: argparse.Namespace) -> int:
    from .store import Store, StoreError

    home = _home(args)
    try:
        identity.load(home)
    except identity.NotEnrolled as exc:
        raise Refused(str(exc)) from None
    src = Path(args.path)
    name = args.name or (src.stem if src.is_file() else src.resolve().name)
    key = _weights_key(args)
    if args.encrypt and key is None:
        raise Refused("--encrypt needs this node's weights key: --key-file PATH or $FLEET_WEIGHTS_KEY_FILE "
                      "(make one with: head -c 32 /dev/urandom > KEYFILE; chmod 600 KEYFILE)")
    if args.encrypt and args.link:
        raise Refused("--encrypt stores an encrypted copy; it cannot hard-link the original (--link)")
    piece_bytes = _piece_size(args.piece_size)
    try:
        digest, manifest = Store(home, key).import_model(src, name, link=args.link, encrypt=args.encrypt,
                                                         piece_bytes=piece_bytes)
    except (StoreError, OSError) as exc:
        raise Refused(f"cannot import {src}: {exc}") from None
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
    return 0


def cmd_make_test_model(args: argparse.Namespace) -> int:
    try:
        from . import testmodel
    except ImportError as exc:
        raise Refused(f"making test models needs numpy, safetensors, gguf and tokenizers "
                      f"(pip install 'fleet[testmodels]'): {exc}") from None
    shape = testmodel.Shape(layers=args.layers, hidden=args.hidden, intermediate=args.hidden * 2)
    out = Path(args.out)
    if args.format == "gguf":
        path = testmodel.make_gguf(out, shape)
    else:
        path = testmodel.make_safetensors(out, shape)
    print(path)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import ConvertError, convert

    try:
        out = convert(Path(args.gguf), Path(args.out), args.dtype)
    except ConvertError as exc:
        raise Refused(str(exc)) from None
    print(f"wrote {out} ({args.dtype} safetensors, tokenizer and chat template); serve it on PyTorch after "
          f"`fleet-agent import {out}`")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from . import simulate

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


def build_parser() -> Parser:
    parser = Parser(
        prog="fleet-agent",
        description="The fleet node agent: reports what this machine has and does what the control "
                    "plane asks. It never registers itself anywhere; add the node to fleet.yaml.",
        epilog=exit_codes_epilog("fleet-agent", full="fleet --help, or the README"))
    parser.add_argument("--version", action="version", version=f"fleet-agent {__version__}",
                        help="print fleet-agent's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    home_help = f"the agent's home: identity and weights (default: $FLEET_AGENT_HOME, else {DEFAULT_HOME})"
    key_help = ("the weights key for encrypted models: 32 bytes, raw or as 64 hex digits, in a file only its owner "
                "(the agent's user) reads (default: $FLEET_WEIGHTS_KEY_FILE)")

    p = sub.add_parser("enroll", help="write this node's identity, once",
                       description="Write this node's identity (a random id, its name, when, the agent "
                                   "version) under the home, readable only by its owner. Enrolling again "
                                   "changes nothing and prints the identity already held.")
    p.add_argument("--home", help=home_help)
    p.add_argument("--name", help="the node's name (default: the host name)")
    p.set_defaults(func=cmd_enroll)

    p = sub.add_parser("serve", help="run the agent's HTTP API",
                       description="Serve the agent API. Needs FLEET_CLUSTER_SECRET (16 bytes or more) "
                                   "and an enrolled home; refuses to start, saying why, otherwise.")
    p.add_argument("--home", help=home_help)
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", metavar="ADDR:PORT",
                   help="address and port to listen on")
    p.add_argument("--available", action="append", metavar="HH:MM-HH:MM",
                   help="a daily window (local time) in which the control plane may change this node; "
                        "repeatable; may cross midnight (19:00-07:00) (default: always)")
    p.add_argument("--simulate-gpus", metavar="FILE",
                   help="take the GPU list from a JSON file instead of NVML (tests, benchmarks); the "
                        "state then says simulated: true")
    p.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    p.add_argument("--peer-ca-file", metavar="FILE",
                   help="fetching from a peer over HTTPS, trust the CAs in this PEM file (e.g. the one that signed the "
                        "agents' certificates) and check the peer's certificate against its hostname in fleet.yaml "
                        f"(default: ${PEER_CA_ENV}, else the system's CAs)")
    p.add_argument("--verify-every", default="24h", metavar="PERIOD",
                   help="re-hash every model held at start and then every PERIOD (90s, 30m, 24h, 7d), "
                        "one at a time in the background; a model that fails is reported corrupt and no "
                        "server starts on it. off: only on demand (POST /v1/weights/DIGEST/verify)")
    p.add_argument("--key-file", metavar="FILE", help=key_help)
    p.add_argument("--disk-reserve", metavar="SIZE",
                   help="bytes of the home's disk a fetch never uses (e.g. 1GiB, 500MB, 0); a fetch that would "
                        "is refused (disk_full) (default: 1 GiB, or a tenth of a smaller disk)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("import", help="hash and store a local model; print its digest",
                       description="Import a model this node holds the original of (an HF directory with "
                                   "config.json and *.safetensors, or one .gguf file) into the store, "
                                   "and print the digest to pin in fleet.yaml. The original is copied "
                                   "(or hard-linked with --link) and never modified.")
    p.add_argument("path", help="an HF model directory or a .gguf file")
    p.add_argument("--home", help=home_help)
    p.add_argument("--name", help="a name for people (default: the directory or file name)")
    p.add_argument("--link", action="store_true",
                   help="hard-link instead of copying (same filesystem; editing the original in place "
                        "would then corrupt the stored copy)")
    p.add_argument("--encrypt", action="store_true",
                   help="store it encrypted at rest (AES-256-GCM) under this node's weights key; it is then "
                        "served only here, decrypted into memory, never to disk")
    p.add_argument("--key-file", metavar="FILE", help=key_help)
    p.add_argument("--piece-size", default="16MiB", metavar="SIZE",
                   help="size of the pieces a receiver verifies and forwards as they arrive; part of the "
                        "digest (default: 16MiB)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("make-test-model", help="write a tiny random Llama (safetensors dir or GGUF file)",
                       description="Write a tiny but real Llama with random weights and a tokenizer "
                                   "trained on the spot, without network: for tests and the demo.")
    p.add_argument("format", choices=["safetensors", "gguf"], help="safetensors (a directory) or gguf (one file)")
    p.add_argument("out", help="the directory (safetensors) or file (gguf) to write")
    p.add_argument("--layers", type=int, default=4, metavar="N", help="decoder layers")
    p.add_argument("--hidden", type=int, default=64, metavar="N",
                   help="hidden size (the MLP's is twice that)")
    p.set_defaults(func=cmd_make_test_model)

    p = sub.add_parser("convert", help="turn a GGUF file into a safetensors model directory for PyTorch",
                       description="Dequantise a GGUF file with transformers and write a safetensors model "
                                   "directory (config, tokenizer, chat template, weights) that the PyTorch "
                                   "engine serves. Local files only; OUT must be new or empty.")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="the directory to write (new or empty)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="the weights' dtype; float32 for exact comparisons")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("simulate", help="SIMULATION: many agents in one process, for benchmarks",
                       description="Host COUNT simulated agents in this process, on consecutive loopback "
                                   "addresses from FIRST, all on PORT. The HTTP API is the real agent's; "
                                   "GPUs, held weights and servers are simulated (no engine is started) "
                                   "and the state says so. For benchmarks and scale tests only.")
    p.add_argument("--dir", required=True, help="a directory for the simulated homes")
    p.add_argument("--first", default="127.1.0.1", metavar="ADDR", help="the first address")
    p.add_argument("--count", type=int, required=True, metavar="N", help="how many agents to host")
    p.add_argument("--port", type=int, required=True, help="the port every simulated agent listens on")
    p.add_argument("--gpus", required=True, help="a simulated GPU file (JSON), as for serve --simulate-gpus")
    p.add_argument("--hold", action="append", metavar="DIGEST:FORMAT:BYTES",
                   help="claim to hold this model (simulated; repeatable)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("doctor", help="check this machine: directories, GPUs, engine builds",
                       description="Print the start-up checks (writable home and engine caches) and the "
                                   "variant check (GPU present with a CPU-only build, or the reverse).")
    p.add_argument("--home", help=home_help)
    p.add_argument("--simulate-gpus", metavar="FILE", help="take the GPU list from a JSON file")
    p.add_argument("--json", action="store_true",
                   help="print the findings as one JSON document on stdout (a list of {level, check, message}), "
                        "and any failure as the error document (schemas/error.schema.json)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("completion", help="print the shell completion script (bash, zsh or fish)",
                       description="Print the script that teaches a shell to complete fleet-agent's commands, "
                                   "options and files.",
                       epilog='examples:\n  eval "$(fleet-agent completion bash)"\n'
                              "  fleet-agent completion fish > ~/.config/fish/completions/fleet-agent.fish")
    p.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to complete in")
    p.set_defaults(func=cmd_completion)
    for name, p in sub.choices.items():  # each command's exit codes under its help, as `fleet`'s
        p.epilog = "\n\n".join(filter(None, [p.epilog, exit_codes_epilog("fleet-agent", full="fleet-agent --help")]))
    return parser


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
    if getattr(args, "func", None) is None:  # bare `fleet-agent`: the help, and the usage code, as `fleet`
        parser.print_help(sys.stderr)
        return Exit.USAGE
    command = f"fleet-agent {args.command}"
    try:
        return int(args.func(args))
    except Refused as exc:
        message = f"refusing to start: {exc}" if args.command == "serve" else str(exc)
        return _fail(argv, command, EXIT_REFUSED, "refused", message)


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
