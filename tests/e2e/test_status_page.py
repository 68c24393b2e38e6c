"""The status page of `fleet serve` in a real browser (Playwright driving Debian's chromium) against
a real `fleet serve` with API keys and real agents: cp runs SmolLM2 (the playground asks it), b a
server that fails with markup in its reason, a runs nothing and has two simulated GPUs (it is
killed and brought back).

Screenshots: with FLEET_SCREENSHOTS=1 the overview and the playground are saved to docs/img/ (the
README shows them): `FLEET_SCREENSHOTS=1 .venv/bin/python -m pytest tests/e2e/test_status_page.py`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.agents import free_port
from tests.conftest import ROOT
from tests.fleets import Fleet, import_model, start_serve, stop_serve, three_node_fleet
from tests.models import smollm2_gguf, tiny_safetensors

pytestmark = pytest.mark.e2e

# .ci/run sets FLEET_REQUIRE_BROWSER=1: there a missing browser fails these tests instead of skipping them.
REQUIRED = os.environ.get("FLEET_REQUIRE_BROWSER") == "1"
if not REQUIRED:
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
import playwright.sync_api as playwright_api  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KEY = "ui-key-0123456789"
# Markup in what a worker reports: the model's config names a layer type transformers refuses, and
# its error (the server's reason) quotes it. The page must show it as text and run nothing.
HOSTILE = "<img src=x onerror=window.pwned=1>"
WAIT_MS = 60_000  # a ceiling for the page to show what the heartbeat saw (0.5 s beats), not a speed target


def hostile_model(base: Path) -> Path:
    src, out = tiny_safetensors(base / "models"), base / "models" / "hostile"
    shutil.copytree(src, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["layer_types"] = [HOSTILE] * int(config["num_hidden_layers"])
    (out / "config.json").write_text(json.dumps(config))
    return out


class Served:
    def __init__(self, f: Fleet, base: str, proc: subprocess.Popen[str]) -> None:
        self.f, self.base, self.proc = f, base, proc

    def overview(self) -> dict[str, Any]:
        r = httpx.get(f"{self.base}/ui/api/overview", headers={"authorization": f"Bearer {KEY}"}, timeout=30)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not Path(CHROMIUM).exists():
        (pytest.fail if REQUIRED else pytest.skip)("no chromium (apt-get install chromium: scripts/install-dev does it as root)")
    base = tmp_path_factory.mktemp("status-page")
    with three_node_fleet(base) as f:
        hostile = import_model(f.agents["b"], hostile_model(base))
        smol = import_model(f.agents["cp"], smollm2_gguf())
        gpus = base / "gpus.json"  # the seam for GPUs on a machine without any (fleet-agent --simulate-gpus)
        gpus.write_text(json.dumps([{"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * 2**30,
                                     "memory_free_bytes": 62 * 2**30}] * 2))
        f.agents["a"].stop()
        f.agents["a"].args = ["--simulate-gpus", str(gpus)]
        f.agents["a"].start()
        listen = f"127.0.0.2:{free_port('127.0.0.2')}"
        local, bad = free_port("127.0.0.2"), free_port("127.0.0.4")
        f.write(listen=listen, extra_models=f'  hostile: {{format: safetensors, digest: "{hostile}", source: b}}\n'
                                            f'  smollm2: {{format: gguf, digest: "{smol}", source: cp}}',
                clusters=f"  assistant: {{model: smollm2, members: [cp], port: {local}, "
                         "settings: {threads: 1, context_length: 1024}}\n"
                         f"  bad: {{model: hostile, members: [b], port: {bad}, "
                         "settings: {threads: 1, startup_timeout_s: 120}}")
        f.file.write_text(f.file.read_text().replace("control_plane: {node: cp", "control_plane: {node: cp, "
                                                     "api_keys_env: FLEET_UI_KEYS"))
        applied = f.run("apply", "--auto-approve")  # the bad server fails: the apply says so
        assert "bad@b" in applied.stdout + applied.stderr, applied.stdout + applied.stderr
        proc = start_serve(f, listen, interval=0.5, args=("--misses", "2"), env={"FLEET_UI_KEYS": KEY})
        try:
            yield Served(f, f"http://{listen}", proc)
        finally:
            stop_serve(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def logged_in(browser: Any, served: Served, **context: Any) -> Any:
    page = browser.new_context(**context).new_page()
    page.goto(f"{served.base}/ui")
    page.fill("#key", KEY)
    page.press("#key", "Enter")  # the keyboard alone logs in
    playwright_api.expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=WAIT_MS)
    return page


def shot(page: Any, name: str, tmp: Path, part: str | None = None) -> None:
    where = ROOT / "docs" / "img" if os.environ.get("FLEET_SCREENSHOTS") == "1" else tmp
    where.mkdir(parents=True, exist_ok=True)
    if part is None:
        page.screenshot(path=str(where / name), full_page=True)
    else:
        page.locator(part).screenshot(path=str(where / name))


def test_without_a_key_the_page_and_its_data_are_refused(served: Served) -> None:
    for path in ("/ui/api/overview", "/ui/api/events", "/ui/static/app.js"):
        r = httpx.get(served.base + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    page = httpx.get(f"{served.base}/ui", timeout=30)
    assert page.status_code == 401 and 'action="/ui/login"' in page.text and "node" not in page.text
    wrong = httpx.post(f"{served.base}/ui/login", data={"key": "not-it"}, timeout=30)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers


def test_the_page_shows_the_fleet_and_a_failed_servers_full_reason_as_text(served: Served, browser: Any,
                                                                             tmp_path: Path) -> None:
    expect = playwright_api.expect
    page = logged_in(browser, served)
    for node in ("cp", "a", "b"):
        expect(page.locator(f'[data-node="{node}"]')).to_have_attribute("data-status", "online", timeout=WAIT_MS)
    member = page.locator('#clusters [data-member="bad@b"]')
    expect(member.locator(".badge")).to_have_text("failed", timeout=WAIT_MS)
    expect(page.locator('#clusters [data-member="assistant@cp"] .badge')).to_have_text("running", timeout=WAIT_MS)
    # The reason the agent reports, whole (every line), less the paths the router scrubs.
    agent_reason = served.f.agents["b"].get("/v1/servers/bad@b").json()["reason"]
    shown = served.overview()
    page_reason = next(m for c in shown["clusters"] for m in c["members"] if m["id"] == "bad@b")["reason"]
    assert HOSTILE in agent_reason and HOSTILE in page_reason
    assert len(page_reason.splitlines()) == len(agent_reason.strip().splitlines())
    expect(member.locator("pre.reason")).to_have_text(page_reason.strip(), timeout=WAIT_MS)
    # Markup in it is text: no element made of it, no script run.
    assert page.locator('img[src="x"]').count() == 0
    assert page.evaluate("window.pwned") is None
    body = page.inner_text("body")
    assert HOSTILE in body
    for a in served.f.agents.values():
        assert str(a.home) not in body and str(a.home) not in page.content()  # nothing the router scrubs
    # The models held, the GPUs (none on these nodes), the latest apply and the alert it left.
    expect(page.locator('#weights [data-model="tiny"]')).to_contain_text("held by 1 node")
    gpu = page.locator('[data-node="a"] .bar').first  # simulated, as NVML would report them: 18 GiB used by others
    assert "others 18.0 GiB, free 62.0 GiB" in (gpu.get_attribute("aria-label") or "")
    expect(page.locator("#applies")).to_contain_text("failed")
    # The same failure as Prometheus sees it (examples/prometheus/alerts.yml alerts on it).
    scraped = httpx.get(f"{served.base}/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=30).text
    assert 'fleet_cluster_members{cluster="bad",state="failed"} 1.0' in scraped, scraped
    shot(page, "status-page.png", tmp_path)
    page.set_viewport_size({"width": 390, "height": 844})  # a phone: nothing wider than the screen
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    page.context.close()


def test_a_killed_agent_turns_its_node_offline_live_and_back(served: Served, browser: Any) -> None:
    expect = playwright_api.expect
    page = logged_in(browser, served)
    node = page.locator('[data-node="a"]')
    expect(node).to_have_attribute("data-status", "online", timeout=WAIT_MS)
    # The beat of the first view that shows it offline, as the page drew it (draw() renders the
    # nodes, then the live badge's "beat N", before any observer runs).
    page.evaluate("""() => { window.notReloaded = true; new MutationObserver(() => {
        const card = document.querySelector('[data-node="a"]');
        if (window.offlineAt === undefined && card && card.dataset.status === "offline")
          window.offlineAt = Number(document.getElementById("live").textContent.match(/beat (\\d+)/)[1]);
      }).observe(document.getElementById("main"), {subtree: true, childList: true, attributes: true}); }""")
    beats = served.overview()["summary"]["beats"]
    served.f.agents["a"].stop(signal.SIGKILL)
    try:
        expect(node).to_have_attribute("data-status", "offline", timeout=WAIT_MS)
        # Within two heartbeats (--misses 2): the beat in flight at the kill may still have had
        # its answer, the next two miss, and the page draws the view of the second; one beat more
        # is allowed for a page that polls the view (every 0.2 s) on a machine too busy to.
        shown_at = page.evaluate("window.offlineAt")
        assert beats < shown_at <= beats + 1 + 2 + 1, (beats, shown_at)
        expect(node.locator(".badge").first).to_have_text("offline")
        expect(page.locator("#alerts")).to_contain_text("node_offline")
    finally:
        served.f.agents["a"].start()
    expect(node).to_have_attribute("data-status", "online", timeout=WAIT_MS)
    assert page.evaluate("window.notReloaded") is True  # pushed, not reloaded
    page.context.close()


def test_the_playground_streams_an_answer_with_its_token_counts(served: Served, browser: Any, tmp_path: Path) -> None:
    expect = playwright_api.expect
    page = logged_in(browser, served)
    expect(page.locator('#pg-cluster option[value="assistant"]')).to_have_count(1, timeout=WAIT_MS)
    # From the keyboard: the first Tab reaches the skip link, which takes the focus to the fleet.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to the fleet"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    page.select_option("#pg-cluster", "assistant")
    page.fill("#pg-key", KEY)
    page.fill("#pg-max", "40")
    page.fill("#pg-prompt", "What is the capital of France? Answer in one sentence.")
    page.focus("#pg-prompt")
    page.keyboard.press("Control+Enter")
    answer = page.locator("#pg-answer")
    expect(answer).to_have_attribute("data-state", "done", timeout=WAIT_MS * 2)
    stats = page.inner_text("#pg-stats")
    assert "completion tokens" in stats and "prompt tokens" in stats, stats
    completion = int(stats.split(" completion tokens")[0].split("·")[-1].strip())
    assert 1 <= completion <= 40 and page.inner_text("#pg-answer").strip(), (stats, page.inner_text("#pg-answer"))
    # The router counted it: the cluster's card shows the request.
    expect(page.locator('#clusters [data-cluster="assistant"]')).to_contain_text("(1 since start)", timeout=WAIT_MS)
    shot(page, "playground.png", tmp_path, "#playground")
    page.context.close()
