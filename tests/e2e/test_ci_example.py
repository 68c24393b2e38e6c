"""The CI examples as a user would run them: the GitHub workflow's `run:` steps executed in order, as
the runner would (bash -eo pipefail, each step's env with the secrets filled in, the artifact handed
from the plan job to the apply job), against real agents. The apply job applies the reviewed plan;
when the fleet moved since review it exits 6, says so, and applies nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.agents import SECRET
from tests.conftest import ROOT, fleet_bin
from tests.fleets import Fleet, import_model, three_node_fleet
from tests.models import tiny_gguf

pytestmark = pytest.mark.e2e

WORKFLOW = ROOT / "examples" / "ci" / "github-actions.yml"
SCRIPT = ROOT / "examples" / "ci" / "fleet-plan.sh"
SECRETS = {"FLEET_CLUSTER_SECRET": SECRET, "FLEET_STATE_PASSWORD": ""}


def runner_env(step_env: dict[str, str], state: Path) -> dict[str, str]:
    """The step's environment as the runner gives it: the secrets filled in, fleet on PATH (what
    the workflow's `pip install` line installs: this checkout's), the state store a local one."""
    env = {**os.environ, "PATH": f"{Path(fleet_bin()).parent}:{os.environ['PATH']}"}
    for key, value in step_env.items():
        env[key] = re.sub(r"\$\{\{\s*secrets\.(\w+)\s*\}\}", lambda m: SECRETS[m[1]], str(value))
    env["FLEET_STATE_URL"] = f"sqlite:///{state}"  # the example's PostgreSQL is the team's; here a file
    env.pop("PGPASSWORD", None)
    return env


def run_job(job: dict[str, Any], workspace: Path, fleet_file: Path, artifacts: Path, state: Path) -> list[str]:
    """Every step of `job` in `workspace`; returns each `run:` step's output; fails on a failed step."""
    workspace.mkdir()
    outputs = []
    for step in job["steps"]:
        uses = step.get("uses", "")
        if uses.startswith("actions/checkout"):
            shutil.copy(fleet_file, workspace / "fleet.yaml")
        elif uses.startswith("actions/upload-artifact"):
            artifacts.mkdir(exist_ok=True)
            for name in str(step["with"]["path"]).split():
                shutil.copy(workspace / name, artifacts / name)
        elif uses.startswith("actions/download-artifact"):
            for f in artifacts.iterdir():
                shutil.copy(f, workspace / f.name)
        elif "run" in step:
            script = str(step["run"])
            if script.startswith("pip install"):
                assert "inference-fleet" in script, script  # this project's distribution, not the registry's `fleet`
                continue
            proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script], cwd=workspace,
                                  env=runner_env(step.get("env", {}), state), capture_output=True, text=True,
                                  timeout=600)
            outputs.append(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise StepFailed(step.get("name", script), proc.returncode, outputs[-1])
    return outputs


class StepFailed(Exception):
    def __init__(self, name: str, code: int, output: str) -> None:
        super().__init__(f"step {name!r} exited {code}: {output}")
        self.code, self.output = code, output


def replicate_onto_a(f: Fleet) -> None:
    f.write(replicas="  tiny: [cp, a]")


def held(f: Fleet, node: str) -> set[str]:
    return {w["digest"] for w in f.states()[node]["weights"]}


def test_the_workflow_plans_then_applies_the_reviewed_plan(tmp_path: Path) -> None:
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    assert jobs["apply"]["needs"] == "plan" and "environment" in jobs["apply"]  # a review stands between
    with three_node_fleet(tmp_path) as f:
        replicate_onto_a(f)
        artifacts, state = tmp_path / "artifacts", tmp_path / "ci-state"
        plan_out = run_job(jobs["plan"], tmp_path / "plan-job", f.file, artifacts, state)
        assert "changes planned" in plan_out[-1], plan_out
        assert (artifacts / "plan.json").is_file()
        assert f.digests["tiny"] not in held(f, "a")  # planning changed nothing
        apply_out = run_job(jobs["apply"], tmp_path / "apply-job", f.file, artifacts, state)
        assert "applied the reviewed plan" in apply_out[-1], apply_out
        assert f.digests["tiny"] in held(f, "a")
        # Converged: the same workflow again plans no changes.
        shutil.rmtree(artifacts)
        again = run_job(jobs["plan"], tmp_path / "plan-job-2", f.file, artifacts, state)
        assert "no changes" in again[-1], again


def test_the_apply_job_refuses_a_plan_the_fleet_moved_away_from_and_says_so(tmp_path: Path) -> None:
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    with three_node_fleet(tmp_path) as f:
        replicate_onto_a(f)
        artifacts, state = tmp_path / "artifacts", tmp_path / "ci-state"
        run_job(jobs["plan"], tmp_path / "plan-job", f.file, artifacts, state)
        import_model(f.agents["a"], tiny_gguf(tmp_path / "elsewhere"))  # node a changed after the review
        with pytest.raises(StepFailed) as failed:
            run_job(jobs["apply"], tmp_path / "apply-job", f.file, artifacts, state)
        assert failed.value.code == 6, failed.value.output
        assert "changed since this plan was reviewed: nothing was applied" in failed.value.output
        assert f.digests["tiny"] not in held(f, "a")


def test_the_generic_ci_script_validates_and_keeps_the_plan(tmp_path: Path) -> None:
    with three_node_fleet(tmp_path) as f:
        replicate_onto_a(f)
        work = tmp_path / "job"
        work.mkdir()
        shutil.copy(f.file, work / "fleet.yaml")
        script = SCRIPT.read_text()
        assert re.search(r"^pip install inference-fleet\b", script, re.M), script
        script = re.sub(r"^pip install .*$", ":", script, flags=re.M)  # installed: this checkout's fleet
        proc = subprocess.run(["bash", "-c", script], cwd=work, env=runner_env({"FLEET_CLUSTER_SECRET": "${{ secrets.FLEET_CLUSTER_SECRET }}"}, tmp_path / "ci-state"),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "changes planned" in proc.stdout and (work / "plan.json").is_file()
