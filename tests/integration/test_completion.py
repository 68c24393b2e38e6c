"""Shell completion as a shell asks for it: the scripts `fleet completion SHELL` prints, and the
real `fleet` process answering argcomplete's protocol (plan addresses for --target from the fleet
file, -f or the default), once through a real bash."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import BIN, fleet_bin

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

FLEET = """version: 1
control_plane: {node: cp}
nodes:
  cp: {address: 127.0.0.2}
  a: {address: 127.0.0.3}
  b: {address: 127.0.0.4}
models:
  tiny: {format: safetensors, digest: "sha256:%s", source: cp}
replicas:
  tiny: [cp, a, {node: b, layers: "0-1"}]
clusters:
  chat: {model: tiny, members: [a], port: 9001}
""" % ("ab" * 32)


def complete(line: str, tmp_path: Path, program: str = "fleet", cwd: Path | None = None) -> list[str]:
    """What `program` offers for the command line `line`, cursor at its end (argcomplete's protocol,
    as its shell functions speak it)."""
    out = tmp_path / "completions"
    env = {"_ARGCOMPLETE": "1", "COMP_LINE": line, "COMP_POINT": str(len(line)), "_ARGCOMPLETE_SHELL": "bash",
           "_ARGCOMPLETE_STDOUT_FILENAME": str(out), "PATH": f"{BIN}:/usr/bin:/bin"}
    proc = subprocess.run([fleet_bin(program)], env=env, cwd=cwd or tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [c.strip() for c in out.read_text().split("\v") if c.strip()]


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    return path


def test_target_completes_the_plan_addresses_of_the_file_given_with_f(fleet_file: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    got = complete(f"fleet plan -f {fleet_file} --target ", tmp_path, cwd=elsewhere)
    assert got[-1] == "replica.tiny\\[0-1\\]@b"  # escaped for the shell, which inserts it unescaped
    assert [c.replace("\\", "") for c in got] == ["server.chat", "server.chat@a", "replica.tiny", "replica.tiny@cp", "replica.tiny@a",
                   "replica.tiny[0-1]@b"]
    assert complete(f"fleet apply -f {fleet_file} --target server.", tmp_path) == ["server.chat", "server.chat@a"]


def test_target_reads_the_default_file_and_a_broken_one_offers_nothing(fleet_file: Path, tmp_path: Path) -> None:
    assert "replica.tiny@a" in complete("fleet plan --target rep", tmp_path)  # ./fleet.yaml
    fleet_file.write_text("version: 1\nnodes: [\n")
    assert complete("fleet plan --target ", tmp_path) == []


def test_commands_options_and_choices_complete(tmp_path: Path) -> None:
    assert complete("fleet pl", tmp_path) == ["plan"]
    assert "--detailed-exitcode" in complete("fleet plan --d", tmp_path)
    assert complete("fleet completion f", tmp_path) == ["fish"]
    offered = complete("fleet-agent make-test-model ", tmp_path, program="fleet-agent")
    assert {"safetensors", "gguf", "--layers"} <= set(offered)


@pytest.mark.parametrize("shell, words", [("bash", "complete -o nospace -o default -o bashdefault -F"),
                                          ("zsh", "compdef _python_argcomplete fleet"),
                                          ("fish", "complete --command fleet")])
def test_each_shell_gets_its_script(shell: str, words: str) -> None:
    proc = subprocess.run([fleet_bin(), "completion", shell], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and words in proc.stdout, proc.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_a_real_bash_completes_target_addresses(fleet_file: Path, tmp_path: Path) -> None:
    script = ('source <(fleet completion bash)\n'
              'COMP_LINE="fleet apply --target server."; COMP_POINT=${#COMP_LINE}\n'
              'COMP_WORDS=(fleet apply --target server.); COMP_CWORD=3\n'
              '_python_argcomplete fleet; printf "%s\\n" "${COMPREPLY[@]}"\n')
    proc = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.stdout.split() == ["server.chat", "server.chat@a"], proc.stderr
