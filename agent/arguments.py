"""`fleet-agent`'s command line: every command and option, described (the commands themselves are
agent/cli.py's)."""

from __future__ import annotations

from wire.command_line import Parser, exit_codes_epilog

from agent import __version__

DEFAULT_HOME = "/var/lib/fleet-agent"
DEFAULT_PORT = 7070
PEER_CA_ENV = "FLEET_PEER_CA_FILE"


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
    p.add_argument("--no-fork-server", action="store_true",
                   help="start every PyTorch worker as a new process, importing PyTorch itself (seconds each), "
                        "instead of forking it from the agent's fork server, which imported PyTorch once "
                        "(workers given GPUs start as new processes either way)")
    p.add_argument("--disk-reserve", metavar="SIZE",
                   help="bytes of the home's disk a fetch never uses (e.g. 1GiB, 500MB, 0); a fetch that would "
                        "is refused (disk_full) (default: 1 GiB, or a tenth of a smaller disk)")
    p.add_argument("--max-connections", type=int, metavar="N",
                   help="connections held at once; one more is answered 503 too_many_connections and closed, "
                        "so clients never take the descriptors the agent's own work needs (default: from the "
                        "descriptor limit, which the agent raises to 65,536 where the hard limit allows: 21,802)")
    p.add_argument("--control-plane", action="append", metavar="ADDRESS",
                   help="an address the control plane connects from (repeatable): its connections count as "
                        "authenticated from the start and the last 16 places under the cap are kept for them "
                        "(connections that never show the cluster secret are closed first when all are held)")

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
    p.add_argument("--piece-size", default="auto", metavar="SIZE",
                   help="size of the pieces a receiver verifies and forwards as they arrive; part of the "
                        "digest; auto sizes them by each file: 1/256 of it rounded up to a power of two, "
                        "from 4MiB to 64MiB (default: auto)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("make-test-model", help="write a tiny random Llama (safetensors dir or GGUF file)",
                       description="Write a tiny but real Llama with random weights and a tokenizer "
                                   "trained on the spot, without network: for tests and the demo.")
    p.add_argument("format", choices=["safetensors", "gguf"], help="safetensors (a directory) or gguf (one file)")
    p.add_argument("out", help="the directory (safetensors) or file (gguf) to write")
    p.add_argument("--layers", type=int, default=4, metavar="N", help="decoder layers")
    p.add_argument("--hidden", type=int, default=64, metavar="N",
                   help="hidden size (the MLP's is twice that)")

    p = sub.add_parser("convert", help="turn a GGUF file into a safetensors model directory for PyTorch",
                       description="Dequantise a GGUF file with transformers and write a safetensors model "
                                   "directory (config, tokenizer, chat template, weights) that the PyTorch "
                                   "engine serves. Local files only; OUT must be new or empty.")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="the directory to write (new or empty)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="the weights' dtype; float32 for exact comparisons")

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

    p = sub.add_parser("doctor", help="check this machine: directories, GPUs, engine builds",
                       description="Print the start-up checks (writable home and engine caches) and the "
                                   "variant check (GPU present with a CPU-only build, or the reverse).")
    p.add_argument("--home", help=home_help)
    p.add_argument("--simulate-gpus", metavar="FILE", help="take the GPU list from a JSON file")
    p.add_argument("--json", action="store_true",
                   help="print the findings as one JSON document on stdout (a list of {level, check, message}), "
                        "and any failure as the error document (schemas/error.schema.json)")

    p = sub.add_parser("completion", help="print the shell completion script (bash, zsh or fish)",
                       description="Print the script that teaches a shell to complete fleet-agent's commands, "
                                   "options and files.",
                       epilog='examples:\n  eval "$(fleet-agent completion bash)"\n'
                              "  fleet-agent completion fish > ~/.config/fish/completions/fleet-agent.fish")
    p.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to complete in")
    for name, p in sub.choices.items():  # each command's exit codes under its help, as `fleet`'s
        p.epilog = "\n\n".join(filter(None, [p.epilog, exit_codes_epilog("fleet-agent", full="fleet-agent --help")]))
    return parser
