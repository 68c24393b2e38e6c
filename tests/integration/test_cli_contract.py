"""The command-line contract, as CI and a person at a terminal meet it: each command of `fleet` and
`fleet-agent` run as a real process with a typo, an invalid file, an unreachable node, something
that is not an agent, a plan error, a lock held, a stale plan, a failed action and a cancelled prompt
(through a pseudo-terminal: 'no', Ctrl-D, Ctrl-C), with and without --json. Each row asserts the
exit code of the README's table and, under --json, that stdout is one JSON document valid against
its schema in schemas/ whose exit_code (where it has one) is the process's."""

from __future__ import annotations

import http.server
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from reconciler.cli.exitcodes import Exit
from reconciler.state.store import StateStore
from tests.agents import Agent, agent_env, free_port
from tests.conftest import ROOT, fleet_bin
from tests.fleets import import_model
from tests.models import random_gguf

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

FLEET_COMMANDS = ("validate", "observe", "plan", "apply", "serve", "nodes", "alerts", "demo", "unlock", "completion")
AGENT_COMMANDS = ("enroll", "serve", "import", "make-test-model", "convert", "simulate", "doctor", "completion")
FLEET_JSON = ("validate", "plan", "apply", "nodes", "alerts")
AGENT_JSON = ("import", "doctor")


def validator(name: str) -> Draft202012Validator:
    """A schema of schemas/, with the others it refers to (diagnostic, plan, alerts) by $id."""
    schemas = [json.loads(p.read_text()) for p in sorted((ROOT / "schemas").glob("*.schema.json"))]
    registry: Registry[Any] = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in schemas)
    return Draft202012Validator(json.loads((ROOT / "schemas" / f"{name}.schema.json").read_text()), registry=registry)


@dataclass(frozen=True)
class Case:
    """One row: argv ({name} replaced by the world's paths), the exit code, and under --json the
    schema stdout must match (None: no --json)."""

    id: str
    argv: tuple[str, ...]
    exit: int | tuple[int, ...]
    schema: str | None = None
    stderr: str = ""  # must appear on stderr
    program: str = "fleet"


def rows() -> list[Case]:
    out: list[Case] = []
    for cmd in FLEET_COMMANDS:  # a typo: the usage code, never 2 (which means "changes present")
        out.append(Case(f"typo-{cmd}", (cmd, "--no-such-option"), Exit.USAGE, stderr=f"usage: fleet {cmd}"))
        if cmd in FLEET_JSON:
            out.append(Case(f"typo-{cmd}-json", (cmd, "--json", "--no-such-option"), Exit.USAGE, "error"))
    for cmd in AGENT_COMMANDS:
        out.append(Case(f"agent-typo-{cmd}", (cmd, "--no-such-option"), Exit.USAGE,
                        stderr=f"usage: fleet-agent {cmd}", program="fleet-agent"))
        if cmd in AGENT_JSON:
            out.append(Case(f"agent-typo-{cmd}-json", (cmd, "--json", "--no-such-option"), Exit.USAGE, "error",
                            program="fleet-agent"))
    out += [
        Case("bare-fleet", (), Exit.USAGE, stderr="usage: fleet"),
        Case("bare-fleet-agent", (), Exit.USAGE, stderr="usage: fleet-agent", program="fleet-agent"),
        Case("unknown-command", ("plna",), Exit.USAGE, stderr="did you mean 'plan'?"),
        Case("terraform-spelling", ("plan", "-f", "{changes}", "-detailed-exitcode"), Exit.USAGE,
             stderr="long options take two dashes: --detailed-exitcode"),
        Case("issue-typo", ("plan", "-f", "{changes}", "--detailed-exitcode", "--targett", "x"), Exit.USAGE,
             stderr="usage: fleet plan"),
        Case("issue-typo-json", ("plan", "-f", "{changes}", "--json", "--detailed-exitcode", "--targett", "x"),
             Exit.USAGE, "error", stderr="did you mean --target?"),
        Case("bad-value-json", ("plan", "--json", "--timeout", "soon"), Exit.USAGE, "error"),
    ]
    for cmd, json_schema in (("validate", "validate"), ("plan", "error"), ("apply", "error"), ("observe", None),
                             ("serve", None)):
        out.append(Case(f"invalid-file-{cmd}", (cmd, "-f", "{invalid}"), Exit.INVALID_CONFIG, stderr="unknown_node"))
        if json_schema:
            out.append(Case(f"invalid-file-{cmd}-json", (cmd, "-f", "{invalid}", "--json"), Exit.INVALID_CONFIG,
                            json_schema))
    for situation, file, words in (("unreachable", "{unreachable}", "connection refused"),
                                   ("not-an-agent", "{not_agent}", "not a fleet agent: GET /v1/state answered 404"),
                                   ("plan-error", "{gguf_remote}", "llamacpp_remote_unsupported")):
        out += [Case(f"{situation}-plan", ("plan", "-f", file), Exit.PLAN_REFUSED, stderr=words),
                Case(f"{situation}-plan-json", ("plan", "-f", file, "--json"), Exit.PLAN_REFUSED, "plan"),
                Case(f"{situation}-apply", ("apply", "-f", file, "--auto-approve"), Exit.PLAN_REFUSED, stderr=words),
                Case(f"{situation}-apply-json", ("apply", "-f", file, "--auto-approve", "--json"),
                     Exit.PLAN_REFUSED, "apply")]
    out += [
        Case("unreachable-validate", ("validate", "-f", "{unreachable}"), Exit.OK),  # offline: not its business
        Case("unreachable-observe", ("observe", "-f", "{unreachable}"), Exit.OK),  # records the error
        Case("lock-held", ("apply", "-f", "{changes}", "--auto-approve", "--state-dir", "{locked}"), Exit.LOCKED,
             stderr="fleet unlock"),
        Case("lock-held-json", ("apply", "-f", "{changes}", "--auto-approve", "--state-dir", "{locked}", "--json"),
             Exit.LOCKED, "error"),
        Case("unlock-other-id", ("unlock", "not-the-id", "--state-dir", "{locked}"), Exit.LOCKED),
        Case("stale-plan", ("apply", "-f", "{stale}", "{planfile}"), Exit.STALE_PLAN, stderr="changed since the plan"),
        Case("stale-plan-json", ("apply", "-f", "{stale}", "{planfile}", "--json"), Exit.STALE_PLAN, "error"),
        Case("unreadable-plan-json", ("apply", "-f", "{changes}", "{invalid}", "--json"), Exit.INVALID_CONFIG,
             "error"),
        Case("no-terminal", ("apply", "-f", "{changes}"), Exit.USAGE, stderr="--auto-approve"),
        Case("no-terminal-json", ("apply", "-f", "{changes}", "--json"), Exit.USAGE, "error"),
        Case("no-secret-json", ("plan", "-f", "{changes}", "--json"), Exit.INVALID_CONFIG, "error"),
        Case("changes-plan", ("plan", "-f", "{changes}", "--detailed-exitcode"), Exit.CHANGES),
        Case("changes-plan-json", ("plan", "-f", "{changes}", "--detailed-exitcode", "--json"), Exit.CHANGES, "plan"),
        Case("no-changes-plan-json", ("plan", "-f", "{nothing}", "--detailed-exitcode", "--json"), Exit.OK, "plan"),
        Case("valid-json", ("validate", "-f", "{changes}", "--json"), Exit.OK, "validate"),
        Case("nodes-json", ("nodes", "--state-dir", "{empty_state}", "--json"), Exit.OK, "nodes"),
        Case("alerts-json", ("alerts", "--state-dir", "{empty_state}", "--json"), Exit.OK, "alerts"),
        Case("agent-import-refused-json", ("import", "{invalid}", "--home", "{nohome}", "--json"),
             Exit.INVALID_CONFIG, "error", program="fleet-agent"),
        Case("agent-doctor-json", ("doctor", "--home", "{nohome}", "--json"), (Exit.OK, Exit.INVALID_CONFIG),
             "agent-doctor", program="fleet-agent"),
    ]
    return out


CASES = rows()


class NotAnAgent(http.server.SimpleHTTPRequestHandler):
    """`python3 -m http.server`'s handler: a 404 HTML page for /v1/state."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class World:
    base: Path
    paths: dict[str, str]
    agents: dict[str, Agent]
    model: str  # the fake GGUF the control plane holds, as fleet.yaml declares it

    def argv(self, case: Case) -> list[str]:
        return [a.format(**self.paths) for a in case.argv]

    def env(self, case: Case) -> dict[str, str]:
        # Each case its own state directory: applies running side by side must not meet on one lock.
        env = agent_env(FLEET_STATE_DIR=str(self.base / "state" / case.id), COLUMNS="120")
        if case.id.startswith("no-secret"):
            del env["FLEET_CLUSTER_SECRET"]
        return env


def fleet_file(path: Path, nodes: dict[str, tuple[str, int]], models: str = "", replicas: str = "",
               clusters: str = "") -> str:
    lines = "\n".join(f"  {n}: {{address: {a}, agent_port: {p}}}" for n, (a, p) in nodes.items())
    path.write_text(f"version: 1\ncontrol_plane: {{node: cp}}\nnodes:\n{lines}\n"
                    f"models: {{{models}}}\nreplicas: {{{replicas}}}\nclusters: {{{clusters}}}\n")
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("contract")
    port = free_port("127.0.0.2", "127.0.0.3")
    agents = {n: Agent(n, addr, port, base / n) for n, addr in (("cp", "127.0.0.2"), ("a", "127.0.0.3"))}
    closed = socket.socket()  # bound and never listening: a connection is refused, and the port stays ours
    closed.bind(("127.0.0.5", 0))
    web = http.server.ThreadingHTTPServer(("127.0.0.6", 0), NotAnAgent)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda a: a.start(), agents.values()))
        fake = base / "q.gguf"
        fake.write_bytes(random_gguf(4100))  # a valid GGUF of random bytes: enough to plan with
        digest = import_model(agents["cp"], fake)
        real = {n: (a.address, a.port) for n, a in agents.items()}
        model = f'q: {{format: gguf, digest: "{digest}", source: cp}}'
        paths = {
            "changes": fleet_file(base / "changes.yaml", real, model, "q: [cp, a]"),
            "nothing": fleet_file(base / "nothing.yaml", {"cp": real["cp"]}, model, "q: [cp]"),
            "stale": fleet_file(base / "stale.yaml", real, model, "q: [cp, a]"),
            "gguf_remote": fleet_file(base / "gguf-remote.yaml", real, model, "q: [cp, a]",
                                      f"q: {{model: q, members: [a], port: {free_port('127.0.0.3')}}}"),
            "unreachable": fleet_file(base / "unreachable.yaml", {"cp": ("127.0.0.5", closed.getsockname()[1])}),
            "not_agent": fleet_file(base / "not-agent.yaml", {"cp": ("127.0.0.6", web.server_address[1])}),
            "invalid": fleet_file(base / "invalid.yaml", real, model, "q: [cp, gpu-z]"),
            "planfile": str(base / "plan.json"), "locked": str(base / "locked"),
            "empty_state": str(base / "empty-state"), "nohome": str(base / "no-home"),
        }
        w = World(base, paths, agents, model)
        saved = subprocess.run([fleet_bin(), "plan", "-f", paths["stale"], "-o", paths["planfile"]],
                               capture_output=True, text=True, env=agent_env(), timeout=60)
        assert saved.returncode == 0, saved.stderr
        Path(paths["stale"]).write_text(Path(paths["stale"]).read_text().replace("q: [cp, a]", "q: [cp]"))
        yield w
    finally:
        web.shutdown()
        closed.close()
        for a in agents.values():
            a.stop()


@pytest.fixture(scope="module")
def results(world: World) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every row run once, four at a time (each is its own process; the table stays fast)."""
    with StateStore(Path(world.paths["locked"])) as store:
        store.applies.acquire("fleet apply (held by the test)")  # this process lives: never taken over

        def run(case: Case) -> subprocess.CompletedProcess[str]:
            return subprocess.run([fleet_bin(case.program), *world.argv(case)], capture_output=True, text=True,
                                  env=world.env(case), stdin=subprocess.DEVNULL, timeout=120, cwd=world.base)

        with ThreadPoolExecutor(4) as pool:
            return dict(zip((c.id for c in CASES), pool.map(run, CASES)))


def check_json(stdout: str, schema: str, code: int) -> dict[str, Any] | list[Any]:
    document = json.loads(stdout)  # one document, nothing else
    errors = list(validator(schema).iter_errors(document))
    assert not errors, f"{schema}: {errors[0].message} at {list(errors[0].absolute_path)}"
    if isinstance(document, dict) and "exit_code" in document:
        assert document["exit_code"] == code
    return document  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_each_command_ends_with_the_contracts_code_and_json(case: Case,
                                                           results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = results[case.id]
    expected = case.exit if isinstance(case.exit, tuple) else (case.exit,)
    assert proc.returncode in expected, f"exit {proc.returncode}, not {case.exit}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert case.stderr in proc.stderr, proc.stderr
    if case.schema is not None:
        check_json(proc.stdout, case.schema, proc.returncode)


def test_a_refused_plan_never_says_no_changes(results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    for situation in ("unreachable", "not-an-agent", "plan-error"):
        for command in ("plan", "apply"):
            proc = results[f"{situation}-{command}"]
            assert "No changes" not in proc.stdout + proc.stderr and "plan refused" in proc.stderr, situation


def test_something_that_is_not_an_agent_is_named_with_a_short_escaped_excerpt(
        results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    plan = json.loads(results["not-an-agent-plan-json"].stdout)
    [diag] = [d for d in plan["diagnostics"] if d["severity"] == "error"]
    assert diag["code"] == "not_a_fleet_agent" and diag["address"] == "node.cp"
    assert "is not a fleet agent: GET /v1/state answered 404 (it sent \"<!DOCTYPE HTML" in diag["summary"]
    assert len(diag["summary"]) < 250 and "\n" not in diag["summary"]
    text = results["not-an-agent-plan"].stderr
    assert "not a fleet agent: GET /v1/state answered 404 (it sent " in text
    for later in ("Error response", "Nothing matches the given URI", "</html>"):  # the rest of the page
        assert later not in diag["summary"] and later not in text


def test_usage_errors_say_which_subcommand_and_how_to_fix_it(
        results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    typo = results["issue-typo"].stderr
    assert typo.startswith("usage: fleet plan ") and "fleet plan: error: unrecognized arguments: --targett x" in typo
    assert "did you mean --target?" in typo
    document = json.loads(results["issue-typo-json"].stdout)
    assert document["command"] == "fleet plan" and document["error"]["code"] == "usage"
    assert document["error"]["hint"] == "did you mean --target?"


def test_stale_and_locked_documents_carry_their_reasons(results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    stale = json.loads(results["stale-plan-json"].stdout)
    assert stale["error"]["code"] == "stale_plan" and stale["diagnostics"][0]["code"] == "stale_plan"
    assert "changed since the plan was made" in stale["diagnostics"][0]["summary"]
    locked = json.loads(results["lock-held-json"].stdout)
    assert locked["error"]["code"] == "lock_held" and "held by the test" in locked["error"]["message"]
    assert locked["error"]["hint"].startswith("if that process is gone for good: fleet unlock ")


def test_a_failed_action_exits_7_with_each_result(world: World) -> None:
    """A server of the fake GGUF on the control plane: the plan is fine, the engine cannot load it."""
    cp = world.agents["cp"]
    path = fleet_file(world.base / "fails.yaml", {"cp": (cp.address, cp.port)}, world.model, "q: [cp]",
                      f"q: {{model: q, members: [cp], port: {free_port(cp.address)}, settings: {{startup_timeout_s: 60}}}}")
    proc = subprocess.run([fleet_bin(), "apply", "-f", path, "--auto-approve", "--json"], capture_output=True,
                          text=True, env=agent_env(FLEET_STATE_DIR=str(world.base / "state" / "fails")), timeout=180)
    assert proc.returncode == Exit.APPLY_FAILED, proc.stdout + proc.stderr
    document = check_json(proc.stdout, "apply", proc.returncode)
    assert isinstance(document, dict) and document["outcome"] == "failed"
    assert [(r["address"], r["status"]) for r in document["results"]] == [("server.q@cp", "failed")]
    assert document["results"][0]["code"]


def at_terminal(world: World, argv: list[str], answer: bytes) -> tuple[int, str, str]:
    """Run fleet with a pseudo-terminal as its controlling terminal, stdin and stderr (stdout a pipe,
    as `fleet apply --json > out.json` typed at a terminal), answer the prompt, and return the exit
    code, stdout and what the terminal showed."""
    master, slave = os.openpty()
    # A session of its own with the terminal as its controlling one, so that Ctrl-C is a SIGINT
    # from the terminal, as at a shell; set up by a trampoline rather than preexec_fn (threads here).
    # SIGINT back to its default as an interactive shell sets it: a suite run as a background job
    # inherits it ignored, and fleet would rightly keep ignoring it.
    trampoline = ("import fcntl, os, signal, sys, termios; os.setsid(); fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                  "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", trampoline, fleet_bin(), *argv], stdin=slave,
                            stdout=subprocess.PIPE, stderr=slave, env=agent_env(
                                FLEET_STATE_DIR=str(world.base / "state" / "tty")))
    os.close(slave)
    assert proc.stdout is not None
    out, shown, answered = b"", b"", False
    deadline = time.monotonic() + 90
    open_fds = {master, proc.stdout.fileno()}
    while open_fds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_fds), [], [], 0.5)
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's other side closed
                chunk = b""
            if not chunk:
                open_fds.discard(fd)
            elif fd == master:
                shown += chunk
            else:
                out += chunk
        if not answered and b"Only 'yes' is accepted" in shown:
            os.write(master, answer)
            answered = True
    os.close(master)
    proc.stdout.close()
    code = proc.wait(timeout=30)
    assert answered, shown.decode(errors="replace")
    return code, out.decode(), shown.decode(errors="replace")


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("answer, exit, words", [
    (b"no\r", Exit.CANCELLED, "Apply cancelled: the answer was 'no', not 'yes'; nothing changed."),
    (b"\x04", Exit.CANCELLED, "Apply cancelled: the input ended (Ctrl-D) before an answer; nothing changed."),
    (b"\x03", Exit.INTERRUPTED, "fleet: interrupted"),
], ids=["no", "ctrl-d", "ctrl-c"])
def test_the_prompt_cancelled_is_not_success(world: World, answer: bytes, exit: int, words: str,
                                             as_json: bool) -> None:
    before = world.agents["a"].get("/v1/state").json()["weights"]
    argv = ["apply", "-f", world.paths["changes"]] + (["--json"] if as_json else [])
    code, out, shown = at_terminal(world, argv, answer)
    assert code == exit, shown
    assert words in shown and "internal error" not in shown and "Traceback" not in shown
    if as_json:
        document = check_json(out, "apply" if exit == Exit.CANCELLED else "error", code)
        assert isinstance(document, dict)
        assert document.get("outcome", document.get("error", {}).get("code")) in ("cancelled", "interrupted")
    else:
        assert "+ replicate replica.q@a" in out  # the plan the question was about, on stdout
    assert world.agents["a"].get("/v1/state").json()["weights"] == before  # nothing changed
