"""examples/systemd/ as systemd reads them: `systemd-analyze verify` finds nothing wrong (with the
ExecStart binaries pointed at this checkout's, as an install under /opt/fleet would have them), and
`systemd-analyze security --offline` rates each unit's sandbox OK (an exposure of at most 3.0 of
10; systemd's own default for a unit with none of it is 9.2, UNSAFE)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, fleet_bin

UNITS = sorted((ROOT / "examples" / "systemd").glob("*.service"))
ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (Debian's systemd)")


def installed(unit: Path, into: Path) -> Path:
    out = into / unit.name
    out.write_text(unit.read_text().replace("/opt/fleet/bin/", str(Path(fleet_bin()).parent) + "/"))
    return out


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_the_unit_verifies(unit: Path, tmp_path: Path) -> None:
    proc = subprocess.run([str(ANALYZE), "verify", str(installed(unit, tmp_path))], capture_output=True, text=True,
                          timeout=60)
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if unit.name in line]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_the_unit_is_sandboxed(unit: Path, tmp_path: Path) -> None:
    proc = subprocess.run([str(ANALYZE), "security", "--offline=true", str(installed(unit, tmp_path))],
                          capture_output=True, text=True, timeout=60)
    level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert level is not None, proc.stdout + proc.stderr
    assert float(level[1]) <= 3.0, proc.stdout
    text = unit.read_text()
    for directive in ("NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet=\n", "UMask=0077"):
        assert directive in text, directive
