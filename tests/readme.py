"""The README's by-hand walkthrough (the section "By hand: ..." under "Running agents on real
machines") as the steps a test runs: each fenced ```sh block of that section, in order, with the
machines it runs on, read from its first line (`# on cp: ...`, `# on cp, gpu-a and gpu-b: ...`).
A block whose last command is a long-running one (`fleet-agent serve`, `fleet serve`: "keep it
running") is a service, which the test starts and leaves running."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

HEADING = "#### By hand:"
SERVICES = ("fleet-agent serve", "fleet serve")


class WalkthroughError(Exception):
    pass


@dataclass(frozen=True)
class Block:
    machines: tuple[str, ...]
    script: str  # the block's text, as written
    line: int  # of its first line (the "# on ..." comment) in the README
    service: str | None  # the long-running command it ends with, if it does

    @property
    def commands(self) -> list[str]:
        return commands(self.script)


def commands(script: str) -> list[str]:
    """The script's command lines: continuation lines joined, comments, blank lines and here-document
    bodies left out (a here-document's body is its command's)."""
    out: list[str] = []
    lines = iter(script.splitlines())
    for raw in lines:
        line = raw.strip()
        while line.endswith("\\"):
            line = line[:-1].rstrip() + " " + next(lines, "").strip()
        if not line or line.startswith("#"):
            continue
        out.append(line)
        here = re.search(r"<<-?\s*'?\"?(\w+)", line)
        if here:
            for body in lines:
                if body.strip() == here[1]:
                    break
    return out


def machines_of(first: str, line: int) -> tuple[str, ...]:
    m = re.match(r"#\s*on\s+([^:]+):", first)
    if not m:
        raise WalkthroughError(f"README.md:{line}: a walkthrough block starts with '# on MACHINE: ...', not {first!r}")
    # "cp", "cp, gpu-a and gpu-b, as the user that runs the agent", "cp, in another terminal": the names
    where = tuple(w.strip() for w in re.split(r",|\band\b", m[1]) if re.fullmatch(r"[\w.-]+", w.strip()))
    if not where:
        raise WalkthroughError(f"README.md:{line}: {first!r} names no machine")
    return where


def walkthrough(readme: Path) -> list[Block]:
    """The section's sh blocks, in order; a WalkthroughError if there is none or one is malformed."""
    text = readme.read_text(encoding="utf-8")
    start = text.find("\n" + HEADING)
    if start < 0:
        raise WalkthroughError(f"{readme} has no section starting {HEADING!r}")
    section, fenced = "", False
    for row in text[start + 1:].splitlines(keepends=True):
        if section and not fenced and re.match(r"#{1,4} ", row):
            break  # the next heading (a "# ..." line inside a block is a comment)
        fenced ^= row.startswith("```")
        section += row
    section = "\n" + section
    first_line = text[:start].count("\n") + 2
    blocks = []
    for m in re.finditer(r"^```sh\n(.*?)^```$", section, re.M | re.S):
        script = m[1]
        line = first_line + section[:m.start()].count("\n")
        header = script.splitlines()[0] if script.strip() else ""
        cmds = commands(script)
        if not cmds:
            raise WalkthroughError(f"README.md:{line}: a walkthrough block with no command")
        service = next((c for c in cmds if c.startswith(SERVICES)), None)
        if service is not None and service != cmds[-1]:
            raise WalkthroughError(f"README.md:{line}: {service!r} keeps running, so it must end its block")
        blocks.append(Block(machines_of(header, line), script, line, service))
    if not blocks:
        raise WalkthroughError(f"{readme}: the section {HEADING!r} has no ```sh block")
    return blocks
