"""--timeout (fleet observe, plan, apply, serve): seconds above 0 or inf, which waits as long as the
agents take; anything else is a usage error, not a failure deep in the fan-out."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reconciler.cli.arguments import build_parser
from wire.command_line import UsageError


@pytest.mark.parametrize("command", ["observe", "plan", "apply", "serve"])
def test_a_timeout_is_seconds_above_zero_or_inf(command: str) -> None:
    parser = build_parser()
    assert parser.parse_args([command, "--timeout", "inf"]).timeout == math.inf
    assert parser.parse_args([command, "--timeout", "2.5"]).timeout == 2.5
    for bad in ("nan", "-1", "0", "soon"):
        with pytest.raises(UsageError):
            parser.parse_args([command, "--timeout", bad])


@pytest.mark.e2e  # a real fleet process
def test_observe_with_no_timeout_waits_for_an_agent_that_never_answers(tmp_path: Path) -> None:
    """A real `fleet observe --timeout inf` against a listener that accepts and never answers: it
    waits (it used to fail at once: epoll cannot wait an infinite time in one call)."""
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(4)
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text("version: 1\ncontrol_plane: {node: a}\nnodes:\n"
                         f"  a: {{address: 127.0.0.1, agent_port: {lst.getsockname()[1]}}}\n")
        env = {**os.environ, "FLEET_CLUSTER_SECRET": "s" * 16, "FLEET_OBSERVE_CACHE": "off"}
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from reconciler.cli.main import main; sys.exit(main())",
                                 "observe", "-f", str(fleet), "--timeout", "inf"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=Path(__file__).parents[2])
        try:
            lst.settimeout(30)
            conn, _ = lst.accept()  # it asked
            time.sleep(1.0)
            assert proc.poll() is None, proc.communicate()
            conn.close()
        finally:
            proc.kill()
            proc.communicate()
