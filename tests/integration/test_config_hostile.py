"""A careless operator's fleet.yaml, as `fleet validate`, `fleet plan` and `fleet serve` meet it
(issue 31, item 9): each mistake is one clean diagnostic with its place and a stable code, and the
invalid-input exit code (3), never a traceback, a hang or a run out of memory. Before: a port of
5,001 digits was exit 1 `internal_error` in all three commands, `agent_ca_file: /dev/zero` read
3.7 GB and died of MemoryError, a FIFO hung validate, and `127.0.31.999`, `0x1B9E` and `0o21555`
validated."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from reconciler.cli.exitcodes import Exit
from tests.conftest import fleet_bin

# Starts real fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

FLEET = """\
version: 1
control_plane:
  node: cp
  listen: "{listen}"
{extra}nodes:
  cp:
    address: {address}
    agent_port: {port}
"""


def fleet_file(tmp_path: Path, *, port: str = "7070", address: str = "127.0.0.1",
               listen: str = "127.0.0.1:8080", extra: str = "") -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET.format(port=port, address=address, listen=listen, extra=extra))
    return path


def fleet(tmp_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLEET_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path)}
    env.pop("FLEET_DEBUG", None)
    return subprocess.run([fleet_bin(), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)


def validate_json(tmp_path: Path, path: Path) -> tuple[int, list[dict[str, Any]]]:
    done = fleet(tmp_path, "validate", "--json", "-f", str(path))
    assert "Traceback" not in done.stderr and "internal" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)["diagnostics"]


@pytest.mark.parametrize("command", ["validate", "plan", "serve"])
def test_a_port_of_5001_digits_is_refused_unconverted_by_every_command(tmp_path: Path, command: str) -> None:
    path = fleet_file(tmp_path, port="7" * 5001)
    done = fleet(tmp_path, command, "-f", str(path))
    assert done.returncode == Exit.INVALID_CONFIG, (done.returncode, done.stderr[-2000:])
    out = done.stdout + done.stderr
    assert "internal" not in out and "Traceback" not in out
    if command == "validate":
        assert "error[yaml_number_too_long]" in out and f"{path.name}:8:17" in out, out[-2000:]
        rc, diags = validate_json(tmp_path, path)
        assert rc == Exit.INVALID_CONFIG
        # One diagnostic for the place: the schema does not add that the shortened text is no integer.
        assert [(d["code"], d["address"], d["range"]["start"]["line"]) for d in diags] == \
            [("yaml_number_too_long", "nodes.cp.agent_port", 8)]


@pytest.mark.parametrize(("written", "value", "form"), [
    ("0x1B9E", 7070, "hexadecimal"), ("0o21555", 9069, "octal"), ("07070", 7070, "leading zero")])
def test_a_port_not_written_in_decimal_is_refused_with_the_decimal_to_write(
        tmp_path: Path, written: str, value: int, form: str) -> None:
    rc, diags = validate_json(tmp_path, fleet_file(tmp_path, port=written))
    assert rc == Exit.INVALID_CONFIG
    (diag,) = diags
    assert (diag["code"], diag["address"], diag["range"]["start"]["line"]) == \
        ("yaml_integer_form", "nodes.cp.agent_port", 8)
    assert form in diag["summary"] and str(value) in diag["detail"], diag


def test_a_decimal_port_and_a_quoted_hex_label_still_validate(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, port="+7070")
    path.write_text(path.read_text() + "    labels: {rack: '0x1B'}\n")
    rc, diags = validate_json(tmp_path, path)
    assert (rc, diags) == (Exit.OK, [])


@pytest.mark.parametrize(("where", "kwargs", "code", "address"), [
    ("node", {"address": "127.0.31.999"}, "schema_violation", "nodes.cp.address"),
    ("node", {"address": "010.0.0.1"}, "schema_violation", "nodes.cp.address"),
    ("node", {"address": "1::2::3"}, "invalid_address", "nodes.cp.address"),
    ("listen", {"listen": "127.0.31.999:8080"}, "invalid_address", "control_plane.listen"),
    ("listen", {"listen": "[fd00::1::2]:8080"}, "invalid_address", "control_plane.listen"),
    ("listen", {"listen": "a..b:8080"}, "invalid_address", "control_plane.listen"),
])
def test_an_address_that_is_neither_an_ip_address_nor_a_host_name_is_refused(
        tmp_path: Path, where: str, kwargs: dict[str, str], code: str, address: str) -> None:
    rc, diags = validate_json(tmp_path, fleet_file(tmp_path, **kwargs))
    assert rc == Exit.INVALID_CONFIG
    assert [(d["code"], d["address"]) for d in diags] == [(code, address)], diags
    assert diags[0]["range"]["start"]["line"] == (4 if where == "listen" else 7)


def test_real_addresses_and_host_names_validate(tmp_path: Path) -> None:
    for kwargs in ({"address": "fd00::2", "listen": "[::1]:8080"}, {"address": "gpu-a.lab", "listen": "cp.lab:8080"},
                   {"address": "10.0.0.255", "listen": "0.0.0.0:8080"}):
        rc, diags = validate_json(tmp_path, fleet_file(tmp_path, **kwargs))
        assert (rc, diags) == (Exit.OK, []), kwargs


def ca_file_diagnostic(tmp_path: Path, named: str) -> dict[str, Any]:
    rc, diags = validate_json(tmp_path, fleet_file(tmp_path, extra=f"  agent_ca_file: {named}\n"))
    assert rc == Exit.INVALID_CONFIG
    (diag,) = diags
    assert (diag["code"], diag["address"], diag["range"]["start"]["line"]) == \
        ("ca_file_unreadable", "control_plane.agent_ca_file", 5), diag
    return diag


def test_a_device_as_the_ca_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # Before: read whole, 3.7 GB of zeros, then MemoryError (the subprocess's timeout catches a read).
    assert "a device, not a regular file" in ca_file_diagnostic(tmp_path, "/dev/zero")["summary"]


def test_a_fifo_as_the_ca_file_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "ca.pem")  # nobody ever opens it for writing: before, validate hung here
    assert "a FIFO, not a regular file" in ca_file_diagnostic(tmp_path, "ca.pem")["summary"]


def test_a_directory_or_an_oversized_file_as_the_ca_file_is_refused(tmp_path: Path) -> None:
    assert "a directory" in ca_file_diagnostic(tmp_path, str(tmp_path))["summary"]
    big = tmp_path / "bundle.pem"
    big.write_bytes(b"-----BEGIN CERTIFICATE-----\n" + b"A" * (2 << 20))
    assert "at most 1,048,576 are read" in ca_file_diagnostic(tmp_path, "bundle.pem")["summary"]


def test_a_device_as_the_fleet_file_is_refused_after_its_limit(tmp_path: Path) -> None:
    done = fleet(tmp_path, "validate", "-f", "/dev/zero")
    assert done.returncode == Exit.INVALID_CONFIG and "error[config_too_large]" in done.stderr, done.stderr
