"""`fleet-agent import --json` says what schemas/agent-import.schema.json promises, plain and
encrypted at rest: a script that validates the document against the published schema keeps working."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest

from reconciler.schemas import load_schema
from tests.agents import agent_env, enroll
from tests.conftest import fleet_bin
from tests.models import tiny_gguf

pytestmark = pytest.mark.e2e  # real fleet-agent processes


def test_import_json_validates_against_its_schema_plain_and_encrypted(tmp_path: Path) -> None:
    home = tmp_path / "home"
    enroll(home, "n")
    key = tmp_path / "weights.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    validator = jsonschema.Draft202012Validator(load_schema("agent-import.schema.json"))
    model = tiny_gguf(tmp_path / "models")
    docs = []
    for extra in ([], ["--name", "sealed", "--encrypt"]):
        proc = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(home), str(model), "--json", *extra],
                              capture_output=True, text=True, timeout=120,
                              env=agent_env(FLEET_WEIGHTS_KEY_FILE=str(key)))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        doc = json.loads(proc.stdout)
        assert [e.message for e in validator.iter_errors(doc)] == [], doc
        docs.append(doc)
    plain, sealed = docs
    assert plain["encryption"] is None and sealed["encryption"]["cipher"] == "aes-256-gcm", docs
