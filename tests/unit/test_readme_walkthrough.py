"""tests/readme.py, the reader of the README's by-hand walkthrough that tests/e2e/test_readme_walkthrough.py
runs on network namespaces: what it takes from the README, and the blocks it refuses. The run itself
needs root; these need nothing, so a README edit that loses a step fails the quick suite too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.readme import WalkthroughError, commands, walkthrough


def test_the_readme_walkthrough_has_every_step_of_the_multi_machine_setup() -> None:
    blocks = walkthrough(ROOT / "README.md")
    ran = [(m, c) for b in blocks for m in b.machines for c in b.commands]
    on = {m for b in blocks for m in b.machines}
    assert on == {"cp", "gpu-a", "gpu-b", "client"}, on

    def some(machine: str, start: str) -> bool:
        return any(m == machine and c.startswith(start) for m, c in ran)

    assert some("cp", "openssl req -x509") and some("cp", "openssl x509 -req") and some("cp", "scp ")
    for node in ("cp", "gpu-a", "gpu-b"):
        assert some(node, "fleet-agent enroll") and some(node, "fleet-agent serve")
        assert any(m == node and c.startswith("fleet-agent serve") and "--tls-cert" in c for m, c in ran)
    assert some("cp", "fleet-agent import")
    for step in ("fleet validate", "fleet plan", "fleet apply", "fleet serve", "fleet nodes --wide"):
        assert some("cp", step), step
    assert some("client", "python")
    services = [(b.machines, b.service) for b in blocks if b.service]
    assert [s for _, s in services if s.startswith("fleet serve")] and len(services) == 2, services
    fleet_file = next(b.script for b in blocks if "cat > fleet.yaml" in b.script)
    for pinned in ("<identity cp printed>", "<identity gpu-a printed>", "<identity gpu-b printed>",
                   "<digest import printed>", "api_keys_env:", "agent_ca_file:", "tls: true"):
        assert pinned in fleet_file, pinned


def test_commands_join_continuations_and_keep_a_here_document_with_its_command() -> None:
    script = ("# on cp: x\nopenssl req -x509 \\\n    -subj /CN=a\ncat > f <<'EOF'\nfleet serve\nEOF\n"
              "# a comment\n\nfleet plan\n")
    assert commands(script) == ["openssl req -x509 -subj /CN=a", "cat > f <<'EOF'", "fleet plan"]


def readme(tmp_path: Path, *blocks: str) -> Path:
    path = tmp_path / "README.md"
    body = "".join(f"```sh\n{b}```\n\n" for b in blocks)
    path.write_text(f"# x\n\n#### By hand: machines\n\nText.\n\n{body}## Next\n\n```sh\n# on cp: not this\nls\n```\n")
    return path


def test_blocks_are_read_up_to_the_next_heading_with_their_machines(tmp_path: Path) -> None:
    blocks = walkthrough(readme(tmp_path, "# on cp: one\nmkdir a\n",
                                "# on cp, gpu-a and gpu-b, as the agent's user: two\nfleet-agent serve --home h\n"))
    assert [(b.machines, b.service) for b in blocks] == [
        (("cp",), None), (("cp", "gpu-a", "gpu-b"), "fleet-agent serve --home h")]
    assert blocks[0].line == 8  # the "# on" line


@pytest.mark.parametrize(("block", "says"), [
    ("mkdir a\n", "starts with '# on MACHINE"),
    ("# on cp: a service that is not last\nfleet serve\nfleet nodes\n", "must end its block"),
    ("# on cp: nothing\n# more nothing\n", "no command"),
])
def test_a_malformed_block_is_refused_naming_its_line(tmp_path: Path, block: str, says: str) -> None:
    with pytest.raises(WalkthroughError, match=says) as refused:
        walkthrough(readme(tmp_path, block))
    assert "README.md:8:" in str(refused.value), refused.value


def test_a_readme_without_the_walkthrough_is_refused(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# x\n\n## Other\n")
    with pytest.raises(WalkthroughError, match="no section"):
        walkthrough(tmp_path / "README.md")
