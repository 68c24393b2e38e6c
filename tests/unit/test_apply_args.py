"""`fleet apply PLANFILE` refusals that come before any node is asked: a plan file nested too deep
for the JSON reader, and --target beside a saved plan (which keeps the targets it was made with)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from reconciler.cli import main as cli

FLEET = Path(__file__).resolve().parents[2] / "examples" / "local-demo.yaml"


def apply(tmp_path: Path, *args: str) -> tuple[int, dict[str, object]]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.run(["apply", "-f", str(FLEET), "--state-dir", str(tmp_path / "state"), "--json", *args])
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue() + out.getvalue()
    return code, json.loads(out.getvalue())


def test_a_plan_file_nested_too_deep_is_unreadable_not_an_internal_error(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("[" * 100_000)
    code, doc = apply(tmp_path, str(plan))
    assert code == 3 and doc["error"]["code"] == "unreadable_plan", doc  # type: ignore[index]


def test_target_beside_a_saved_plan_is_a_usage_error(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    code, doc = apply(tmp_path, str(plan), "--target", "server.chat@cp")
    assert code == 64 and "--target" in doc["error"]["message"], doc  # type: ignore[index]
