"""Diagnostics, plans and apply results → text for people (diagnostics like a compiler: place,
source line, caret) or JSON for machines."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from reconciler.core.diagnostics import Diagnostic, Severity
from reconciler.planning.gpus import gib, picture
from reconciler.planning.notes import receive_lines

if TYPE_CHECKING:
    from rich.console import Console

    from reconciler.applying.execute import Result
# rich (~25 ms of start-up) is imported by the functions that write for people: a --json command
# (a plan, a validation, an error document) never loads it.

JSON_FORMAT_VERSION = "1.0"


def console(*, stderr: bool) -> Console:
    from rich.console import Console  # on use: see the note above

    # Colour only on a terminal (rich decides; NO_COLOR and TERM=dumb are honoured); never wrap
    # lines, so that file:line:col and source lines stay intact in CI logs.
    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def diagnostic_lines(diag: Diagnostic, source_text: str | None) -> list[str]:
    """Rich-markup lines for one diagnostic."""
    from rich.markup import escape  # on use: see the note at the top

    colour = "red" if diag.severity is Severity.ERROR else "yellow"
    code = escape(f"[{diag.code}]")
    lines = [f"[bold {colour}]{diag.severity.value}[/][bold]{code}[/]: {escape(diag.summary)}"]
    if diag.range is not None:
        lines.append(f"  [blue]-->[/] {escape(str(diag.range))}")
        if source_text is not None:
            lines += _excerpt(diag, source_text)
    elif diag.address:
        lines.append(f"  [blue]-->[/] {escape(diag.address)}")
    if diag.detail:
        lines.append(f"  [blue]=[/] {escape(diag.detail)}")
    return lines


def _excerpt(diag: Diagnostic, text: str) -> list[str]:
    from rich.markup import escape  # on use: see the note at the top

    assert diag.range is not None
    all_lines = text.splitlines()
    n = diag.range.start.line
    if not 1 <= n <= len(all_lines):
        return []
    line = all_lines[n - 1].replace("\t", " ")
    if len(line) > 200:
        line = line[:200] + "…"
    col = diag.range.start.column
    end = diag.range.end.column if diag.range.end.line == n and diag.range.end.column > col else col + 1
    end = min(end, len(line) + 1) if len(line) >= col else col + 1
    gutter = " " * len(str(n))
    colour = "red" if diag.severity is Severity.ERROR else "yellow"
    return [f"{gutter} [blue]|[/]",
            f"[blue]{n} |[/] {escape(line)}",
            f"{gutter} [blue]|[/] {' ' * (col - 1)}[{colour}]{'^' * max(1, end - col)}[/]"]


# The styles our own lines use; text in them went through escape(), which puts a backslash before
# any "[" that could read as a tag.
_TAG = re.compile(r"(?<!\\)\[(?:/|(?:bold|dim|red|green|yellow|blue|magenta|cyan)(?: [a-z]+)*)\]")


def plain(markup: str) -> str:
    """A line of our markup as rich prints it without colours."""
    return _TAG.sub("", markup).replace("\\[", "[")


def print_lines(out: Console, lines: list[str]) -> None:
    """Many lines of markup at once. rich spent ~0.9 ms on each print call (0.2 ms a line even in
    one call, parsing markup): 30 s of an apply of 10,000 starts went to its plan and result lines.
    Where rich would print no colours (a pipe, a file, a CI log, NO_COLOR) the lines are written as
    it would write them; a terminal gets one print."""
    if not lines:
        return
    if out.color_system is None and not out.record:
        out.file.write("".join(plain(line) + "\n" for line in lines))
        out.file.flush()
        return
    out.print("\n".join(lines))


def print_diagnostics(out: Console, diags: Iterable[Diagnostic], source_text: str | None) -> None:
    for diag in diags:
        for line in diagnostic_lines(diag, source_text):
            out.print(line)
        out.print()


def diagnostics_json(diags: Iterable[Diagnostic]) -> list[dict[str, Any]]:
    return [d.to_json() for d in diags]


_SYMBOL = {"replicate": ("+", "green"), "start": ("+", "green"), "replace": ("~", "yellow"),
           "stop": ("-", "red"), "delete": ("-", "red")}


def pipeline_line(details: Mapping[str, Any]) -> str | None:
    """A pipeline stage's group in one line (None for any other change): "pipeline big: 2 stages
    (a 0-14, b 15-29), rendezvous 10.0.0.2:9103, group 1f0c…"."""
    p = details.get("pipeline")
    if not isinstance(p, dict):
        return None
    host = p["rendezvous"]["address"]
    host = f"[{host}]" if ":" in host else host
    stages = ", ".join(f"{s['node']} {s['layers']}" for s in p["stages"])
    return (f"pipeline {details['cluster']}: {p['world_size']} stages ({stages}), rendezvous "
            f"{host}:{p['rendezvous']['port']}, group {p['group']}")


def gpu_lines(plan: Any) -> list[str]:
    """Each GPU of every node the plan reserves GPU memory on, in words (reconciler/planning/gpus.py)."""
    return [picture(row) for row in plan.gpus]


def gpus_given(details: Mapping[str, Any]) -> str | None:
    """`GPU 0,1: 7.2 GiB each (weights 12.0 GiB + KV cache 1.0 GiB + overhead 1.0 GiB)` for a start or
    replace given GPUs (None for any other change)."""
    shares, vram = details.get("gpus"), details.get("vram")
    if not shares or not isinstance(vram, dict):
        return None
    each = " each" if len(shares) > 1 else ""
    return (f"GPU {','.join(str(g['index']) for g in shares)}: {gib(shares[0]['bytes'])}{each} "
            f"(weights {gib(vram['weights_bytes'])} + KV cache {gib(vram['kv_cache_bytes'])} + overhead "
            f"{gib(vram['overhead_bytes'])})")


def print_plan(out: Console, plan: Any) -> None:
    """A plan for people: one block per action with its reason, then the summary line; a pipeline's
    group is named above its first stage (its stages start together). A refused plan prints
    nothing: its errors and the refusal are the whole story (never "No changes." beside them)."""
    from rich.markup import escape  # on use: see the note at the top

    if plan.errored:
        return
    if not plan.changes:
        out.print("[green]No changes.[/] The fleet matches the configuration.")
    else:
        lines = ["fleet will perform these actions, in this order:", ""]
        groups: set[str] = set()
        for c in plan.changes:
            group = pipeline_line(c.details)
            if group is not None and group not in groups:
                groups.add(group)
                lines.append(f"  [cyan]{escape(group)}[/] [dim](its stages start together)[/]")
            sym, colour = _SYMBOL[c.action.value]
            after = f"  [dim](after {escape(', '.join(c.depends_on))})[/]" if c.depends_on else ""
            drift = "  [magenta]\\[drift][/]" if c.drift else ""
            lines.append(f"  [{colour}]{sym} {c.action.value}[/] [bold]{escape(c.address)}[/]{after}{drift}")
            lines.append(f"      {escape(c.reason)}")
            given = gpus_given(c.details)
            if given is not None:
                lines.append(f"      [dim]{escape(given)}[/]")
            adapter = (c.details.get("settings") or {}).get("adapter") if "server_id" in c.details else None
            if isinstance(adapter, dict):  # a LoRA adapter merged at load
                lines.append(f"      [dim]adapter {escape(str(adapter['name']))} ({escape(str(adapter['digest']))})"
                             " merged at load[/]")
        gpus = gpu_lines(plan)
        if gpus:  # every GPU of the nodes this plan reserves on: what holds it, what the plan adds
            lines += ["", "GPUs of the nodes this plan starts servers on:"]
            lines += [f"  {escape(line)}" for line in gpus]
        receiving = receive_lines(plan.changes)
        if receiving:  # bytes per node and how long, at the rates the receivers measured
            lines += ["", "Replication, at the rates each node measured on its recent fetches:"]
            lines += [f"  {escape(line)}" for line in receiving]
        print_lines(out, lines + ["", f"[bold]{escape(plan.summary())}[/]"])


_MARK = {"done": "[green]✓[/]", "failed": "[red]✗[/]", "skipped": "[yellow]-[/]"}


def result_line(r: Result) -> str:
    """One apply result (reconciler.applying.execute.Result): mark, action, address, what happened with the
    failure's code, time taken and the retries it needed."""
    from rich.markup import escape  # on use: see the note at the top

    code = f"[{r.code}] " if r.code else ""
    retries = f", {r.retries} {'retry' if r.retries == 1 else 'retries'}" if r.retries else ""
    return (f"{_MARK[r.status]} {r.action} {escape(r.address)}: {escape(code + r.message)} "
            f"({r.seconds:.1f}s{retries})")
