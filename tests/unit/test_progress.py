"""`fleet apply`'s progress for people: bytes of each replicate on a terminal, one line per action
in a pipe (a CI log gets no line per poll)."""

from __future__ import annotations

import io

from rich.console import Console

from reconciler.applying.execute import Result
from reconciler.planning.plan import Action, Change
from reconciler.applying.progress import ApplyProgress

REPLICATE = Change(Action.REPLICATE, "replica.tiny@a", "a", "a holds no replica of tiny", (),
                   {"digest": "sha256:" + "ab" * 32, "peer": "cp", "bytes": 4_000_000, "model": "tiny"})
START = Change(Action.START, "server.chat@a", "a", "a runs no server of cluster chat", ("replica.tiny@a",),
               {"server_id": "chat@a"})


def run(terminal: bool) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=120, color_system=None)
    with ApplyProgress(console) as progress:
        progress("started", {"change": REPLICATE})
        for done in (1_000_000, 2_000_000, 3_000_000):
            progress("progress", {"change": REPLICATE, "done": done, "total": 4_000_000})
        progress("retry", {"change": REPLICATE, "error": "peer closed", "attempt": 1})
        progress("finished", {"change": REPLICATE, "result": Result("replica.tiny@a", "replicate", "done", "", 1.0)})
        progress("started", {"change": START})
        progress("finished", {"change": START, "result": Result("server.chat@a", "start", "done", "", 1.0)})
    return out.getvalue()


def test_a_pipe_gets_one_line_per_action_and_per_retry() -> None:
    assert run(terminal=False).splitlines() == [
        "  … replicate replica.tiny@a",
        "  ↻ replicate replica.tiny@a: retry 1 after peer closed",
        "  … start server.chat@a"]


def test_a_terminal_shows_the_bytes_of_each_replicate() -> None:
    shown = run(terminal=True)
    for done in ("1.0/4.0 MB", "2.0/4.0 MB", "3.0/4.0 MB"):  # each answer drawn as it arrives
        assert done in shown
    last = shown.rsplit("replicate replica.tiny@a (done)", 1)
    assert len(last) == 2 and "4.0/4.0 MB" in last[1].split("\n")[0]
    assert "  … start server.chat@a" in shown and "↻ replicate replica.tiny@a: retry 1" in shown


def test_a_terminal_adds_every_fetch_up_in_one_row_with_the_aggregate_rate() -> None:
    other = Change(Action.REPLACE, "replica.tiny@b", "b", "b's replica of tiny is corrupt", (),
                   {**REPLICATE.details, "peer": "a"})  # a corrupt copy fetched again is a fetch too
    out = io.StringIO()
    with ApplyProgress(Console(file=out, force_terminal=True, width=120, color_system=None)) as progress:
        progress("started", {"change": REPLICATE})
        progress("started", {"change": other})
        progress("progress", {"change": REPLICATE, "done": 1_000_000, "total": 4_000_000})
        progress("progress", {"change": other, "done": 2_000_000, "total": 4_000_000})
        progress("finished", {"change": REPLICATE, "result": Result("replica.tiny@a", "replicate", "done", "", 1.0)})
    rows = [line for line in out.getvalue().splitlines() if "all fetches" in line]
    assert any("3.0/8.0 MB" in row for row in rows), rows  # both fetches' bytes so far
    assert "6.0/8.0 MB" in rows[-1] and "/s" in rows[-1], rows[-1]  # one done (4) + 2 of the other, with a rate
    assert "replace replica.tiny@b" in out.getvalue() and "… replace" not in out.getvalue()
