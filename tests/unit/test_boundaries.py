"""The pure core stays pure: the planner and its data types import no I/O."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PURE = ["reconciler/planner.py", "reconciler/plan.py", "reconciler/observed.py", "reconciler/model.py",
        "reconciler/diagnostics.py", "agent/manifest.py", "agent/windows.py"]
FORBIDDEN = {"os", "subprocess", "trio", "httpx", "socket", "time", "sqlite3", "shutil", "asyncio"}


@pytest.mark.parametrize("path", PURE)
def test_pure_modules_import_no_io(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
        assert not isinstance(node, (ast.AsyncFunctionDef, ast.Await)), f"{path} has async code"
    assert imported & FORBIDDEN == set()


def test_importing_the_planner_pulls_in_no_io_library() -> None:
    code = ("import sys, reconciler.planner; bad = {'trio', 'httpx', 'subprocess', 'sqlite3'} & set(sys.modules); "
            "print(sorted(bad)); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
