"""examples/prometheus/alerts.yml: every metric it names is one `fleet serve` exports (its /metrics
rendered from a view with a failed member, a corrupt copy and a replication under way), and
promtool, where installed (Debian's prometheus package: scripts/install-dev), checks the rules
and runs the cases of alerts.test.yml."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from reconciler.serve.metrics import ServeMetrics
from reconciler.serve.overview import ViewCollector
from tests.unit.test_overview import DIGEST, desired, state, view

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prometheus"
PROMETHEUS_OWN = {"up"}  # the scrape's own series


def exported() -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample name /metrics carries, with its labels and value."""
    corrupt = state("b", "running", weights=[{"digest": DIGEST, "name": "m", "format": "safetensors", "bytes": 1,
                                              "path": "/srv/b-home/m", "integrity": {"state": "corrupt",
                                                                                     "file": "x", "reason": "y"}}],
                    fetches=[{"digest": DIGEST, "state": "fetching", "peer": "10.0.0.1:7070", "bytes_total": 1000,
                              "bytes_done": 10, "rate_bytes_per_s": 5}])
    v = view(cp=state("cp"), a=state("a", "failed", "boom"), b=corrupt)
    metrics = ServeMetrics()
    metrics.registry.register(ViewCollector(desired(), v))
    metrics.node_up.labels("a").set(1)
    metrics.requests.labels("chat", "200").inc()
    metrics.latency.labels("chat").observe(0.1)
    metrics.answered("chat", b'"completion_tokens": 3')
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def rules() -> list[dict[str, object]]:
    doc = yaml.safe_load((EXAMPLES / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_every_metric_the_rules_name_is_exported() -> None:
    names = exported()
    assert names["fleet_cluster_members"][(("cluster", "chat"), ("state", "failed"))] == 1
    assert names["fleet_weights_corrupt"][(("model", "m"), ("node", "b"))] == 1
    assert names["fleet_replication_bytes_done"][(("model", "m"), ("node", "b"))] == 10
    assert names["fleet_replication_bytes_total"][(("model", "m"), ("node", "b"))] == 1000
    assert names["fleet_completion_tokens_total"][(("cluster", "chat"),)] == 3
    alerts = {str(r["alert"]) for r in rules()}
    assert {"FleetNodeOffline", "FleetServerFailed", "FleetDrift", "FleetWeightsCorrupt",
            "FleetReplicationStuck"} <= alerts
    for r in rules():
        expr = str(r["expr"])
        used = set(re.findall(r"\b(fleet_[a-z0-9_]+)", expr)) | ({"up"} if re.search(r"\bup\{", expr) else set())
        assert used, r
        for name in used:
            assert name in names or name in PROMETHEUS_OWN, f"{r['alert']}: {name} is not exported by fleet serve"


def test_promtool_checks_the_rules_and_runs_their_cases() -> None:
    if shutil.which("promtool") is None:  # .ci/run sets FLEET_REQUIRE_PROMTOOL=1: there it must run
        (pytest.fail if os.environ.get("FLEET_REQUIRE_PROMTOOL") == "1" else pytest.skip)(
            "no promtool (apt-get install prometheus: scripts/install-dev does it as root)")
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts.test.yml"]):
        done = subprocess.run(["promtool", *args], cwd=EXAMPLES, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
