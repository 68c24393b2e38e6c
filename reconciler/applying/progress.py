"""What `fleet apply` shows while it runs, on stderr: on a terminal, a live bar per replicate (and per
corrupt copy fetched again) with its bytes, speed and time left, and one row adding them all up with
the aggregate rate (rich); in a pipe or a CI log, one line per action as it starts, and one per retry
or drain, never a line per poll."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from reconciler.planning.plan import Action, Change


class ApplyProgress:
    """The executor's progress hook (reconciler/applying/execute.py: started, progress, retry, drain,
    finished), for people. Use as a context manager: the bars live between enter and exit."""

    def __init__(self, out: Console) -> None:
        self.out = out
        self.tasks: dict[str, TaskID] = {}
        self.moved: dict[str, int] = {}  # bytes each fetch has on its node so far
        self.total: TaskID | None = None  # every fetch added up: the aggregate rate
        self.bars = Progress(TextColumn("  {task.description}"), BarColumn(), DownloadColumn(),
                             TransferSpeedColumn(), TimeRemainingColumn(), console=out) if out.is_terminal else None

    def __enter__(self) -> ApplyProgress:
        if self.bars is not None:
            self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars is not None:
            self.bars.stop()

    def line(self, text: str) -> None:
        """A line of plain text: written as is where rich would print no colours (rich's print cost
        ~0.5 ms a line, 5 s of an apply of 10,000 starts)."""
        if self.bars is None and self.out.color_system is None and not self.out.record:
            self.out.file.write(text + "\n")
            self.out.file.flush()
        else:
            self.out.print(text, markup=False)

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        change: Change = data["change"]
        what = f"{change.action.value} {change.address}"
        task = self.tasks.get(change.address)
        if event == "started":
            if self.bars is not None and (change.action is Action.REPLICATE or "peer" in change.details):
                size = change.details.get("bytes") or 0
                if self.total is None:
                    self.total = self.bars.add_task("all fetches", total=0)
                self.bars.update(self.total, total=(self.bars.tasks[self.total].total or 0) + size)
                self.tasks[change.address] = self.bars.add_task(what, total=size or None)
            else:
                self.line(f"  … {what}")
        elif event == "progress" and self.bars is not None and task is not None:
            # Drawn now, not at the next tick: an answer arrives once per poll, and is then on screen.
            self.bars.update(task, completed=data["done"], total=data["total"] or None)
            self._moved(change.address, data["done"])
        elif event == "finished" and self.bars is not None and task is not None:
            status = data["result"].status
            if status == "done":
                total = self.bars.tasks[task].total
                self.bars.update(task, completed=total or self.bars.tasks[task].completed)
                self._moved(change.address, int(total or self.bars.tasks[task].completed))
            self.bars.update(task, description=f"{what} ({status})")
        elif event == "retry":
            self.line(f"  ↻ {what}: retry {data['attempt']} after {data['error']}")
        elif event == "drain":
            self.line(f"  ⇄ {data['message']}")

    def _moved(self, address: str, done: int) -> None:
        assert self.bars is not None and self.total is not None
        self.moved[address] = done
        self.bars.update(self.total, completed=sum(self.moved.values()), refresh=True)
