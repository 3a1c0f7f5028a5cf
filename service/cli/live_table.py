"""What `playbook run` shows while its study runs. On a terminal, the study's lines scroll above a
table of its running trials (trial, round, step/total, metric, best, ETA), redrawn in place as
the command fetches them (`orchestration.study_run.follow`); anywhere else (a job log, a pipe)
the lines alone, plain. The table goes when no trial runs, so the command's own last lines
follow the study's."""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

from service.core.formatting import cell
from service.tracking.console import PlainLines
from service.tracking.progress import eta_s, format_duration

ERASE_BELOW = "\x1b[J"
MAX_ROWS = 20
"""Running trials shown; more are counted in one line."""


def up(lines: int) -> str:
    """The cursor to the start of the line `lines` lines up."""
    return f"\x1b[{lines}F"


class LiveTable(PlainLines):
    """The lines, and below them the running trials' table, erased and drawn again each time."""

    def __init__(self, metric: str, out: TextIO | None = None):
        super().__init__(out)
        self.metric, self.trials, self.drawn = metric, {}, 0

    def say(self, line: str) -> None:
        self._erase()
        self.out.write(line + "\n")
        self._draw()

    def running(self, trials: dict[str, dict]) -> None:
        self.trials = trials
        self._erase()
        self._draw()

    def _erase(self) -> None:
        if self.drawn:
            self.out.write(up(self.drawn) + ERASE_BELOW)
            self.drawn = 0

    def _draw(self) -> None:
        width = shutil.get_terminal_size().columns
        lines = [line[:width] for line in table_lines(self.trials, self.metric)]
        self.out.write("".join(line + "\n" for line in lines))
        self.out.flush()
        self.drawn = len(lines)


def view_for(metric: str, out: TextIO | None = None) -> PlainLines:
    """The live table where `out` (stdout) is a terminal, else plain lines."""
    out = out or sys.stdout
    return LiveTable(metric, out) if out.isatty() else PlainLines(out)


def table_lines(trials: dict[str, dict], metric: str) -> list[str]:
    """The running trials as aligned text lines, a header first; none when no trial runs.
    `trials`: name -> round, step, total, metric, best, steps_per_s (`ConsoleLines.progress`)."""
    if not trials:
        return []
    header = ["trial", "round", "step", metric, "best", "ETA"]
    names = sorted(trials)
    rows = [row(name, trials[name]) for name in names[:MAX_ROWS]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
        for cells in [header, *rows]
    ]
    if len(names) > MAX_ROWS:
        lines.append(f"... and {len(names) - MAX_ROWS} more running")
    return lines


def row(name: str, t: dict) -> list[str]:
    step, total = t.get("step"), t.get("total")
    eta = format_duration(eta_s(step, total, t.get("steps_per_s"))) if step else "?"
    return [
        name,
        cell(t.get("round")),
        f"{step or 0}/{total}",
        cell(t.get("metric")),
        cell(t.get("best")),
        eta,
    ]
