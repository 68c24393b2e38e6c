"""A failed member's full reason as a client gets it from the router: whole, naming the machine,
with no filesystem path left in it (the node's store and home, and any other absolute path)."""

from __future__ import annotations

import re

from hypothesis import given, strategies as st

from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
from reconciler.core.observed import node_from_state
from reconciler.serve.heartbeat import View
from reconciler.serve.router import Router
from reconciler.serve.scrub import scrub_reason
from tests.unit.test_router import call

DIGEST = "sha256:" + "2" * 64
HOME = "/srv/fleet/a-home"
REASON = f"""the worker exited with code 1
--- last lines of its output ({HOME}/servers/chat@a.log) ---
Traceback (most recent call last):
  File "/opt/venv/lib/python3.11/site-packages/safetensors/torch.py", line 313, in load_file
    with safe_open(filename, framework="pt", device=device) as f:
safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered
{HOME}/store/models/abc/model.safetensors: the weights lack 1 tensor(s) the model needs: model.layers.1.mlp.up_proj.weight"""


def router() -> Router:
    nodes = {"cp": NodeSpec("cp", "10.0.0.1"), "a": NodeSpec("a", "10.0.0.2")}
    d = Desired(1, ControlPlaneSpec("cp"), nodes, {"m": ModelSpec("m", "safetensors", DIGEST, "cp")}, (),
                {"chat": ClusterSpec("chat", "m", ("a",), 9001)})
    v = View()
    v.online["a"] = True
    v.nodes["a"] = node_from_state("a", {
        "servers": [{"id": "chat@a", "state": "failed", "model": DIGEST, "reason": REASON}],
        "inventory": {"disk": {"path": HOME}},
        "weights": [{"digest": DIGEST, "path": HOME + "/store/models/abc"}]})
    return Router(d, v)


def test_the_503_names_the_machine_and_carries_every_line_of_the_reason_without_paths() -> None:
    r = call(router(), body={"model": "chat", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_running_member"
    message = r.json()["error"]["message"]
    assert message.startswith("cluster 'chat' has no running member: a: server failed (the worker exited with code 1")
    for words in ("Traceback (most recent call last):", "incomplete metadata, file not fully covered",
                  "the weights lack 1 tensor(s) the model needs: model.layers.1.mlp.up_proj.weight",
                  'File "<path>", line 313, in load_file'):
        assert words in message
    assert HOME not in message and "/opt/venv" not in message and "site-packages" not in message
    assert not re.search(r"(?<![\w.:/~-])/[\w.@+~-]+/", message), message


def test_scrub_reason_keeps_urls_and_words() -> None:
    text = "see https://example.org/a/b (ratio 1/2, and/or): /etc/passwd was read"
    assert scrub_reason(text, [], "c") == "see https://example.org/a/b (ratio 1/2, and/or): <path> was read"


@given(st.lists(st.sampled_from(["/usr/lib/x.so", " ", "a", "\n", "/", "b/c", "~/d", "-", HOME, ":", "."]),
                max_size=30))
def test_no_absolute_path_survives(parts: list[str]) -> None:
    # Paths as logs write them: after a space, a quote, a bracket or at a line's start.
    out = scrub_reason(" ".join(parts).replace(" \n", "\n("), [HOME], "chat")
    assert HOME not in out and "/usr/lib" not in out
