"""The lines a study says to its user (a trial started, evaluated, finished, diverged, failed or
resumed; a round planned; a round's verdicts) and where its running trials are, kept in the
coordinator for the command that started the study to fetch and show
(`orchestration.study_run.run_study`, `cli.live_table`). Printed by the
coordinator itself, each would reach that command through Ray's log forwarding: prefixed with
"(Coordinator pid=N)", coloured, and late, after the command's own last lines."""

from __future__ import annotations

import collections
import sys
import threading
from typing import TextIO

KEEP_LINES = 1000
"""Lines kept for a reader that has not fetched them yet: it fetches twice a second, and a
study's lines come at most one per trial event (progress lines at most one per running trial
every `tracking.progress_interval_s`). A bound, so that the coordinator holds no more per trial
than its row."""


class ConsoleLines:
    """Numbered lines, the latest `keep` of them kept: `since(n)` gives the lines from number n
    on and the next number to ask for; a reader that fell further behind is told how many it
    missed. `echo`: each line is printed as well (where no command fetches them: a benchmark,
    a test; `keep=0` then). And the running trials' latest progress (`progress`, `done`,
    `running`), forgotten when a trial is done."""

    def __init__(self, keep: int = KEEP_LINES, echo: bool = False):
        self._lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._next, self.echo = 0, echo
        self._running: dict[str, dict] = {}
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
            self._next += 1
        if self.echo:
            print(line, flush=True)

    def since(self, number: int) -> tuple[int, list[str]]:
        with self._lock:
            first = self._next - len(self._lines)
            lines = list(self._lines)[max(0, number - first) :]
            missed = first - number
            if missed > 0:
                lines.insert(0, f"({missed} earlier lines were not kept)")
            return self._next, lines

    def progress(self, trial: str, **fields) -> None:
        """A running trial's latest: round, step, total, metric, best, steps_per_s."""
        with self._lock:
            self._running[trial] = {**self._running.get(trial, {}), **fields}

    def done(self, trial: str) -> None:
        with self._lock:
            self._running.pop(trial, None)

    def running(self) -> dict[str, dict]:
        with self._lock:
            return {name: dict(fields) for name, fields in self._running.items()}


class PlainLines:
    """How the command that started a study shows what it says, in a job log or a pipe: each
    line as it comes, printed; running trials are not shown (`cli.live_table` on a terminal)."""

    def __init__(self, out: TextIO | None = None):
        self.out = out or sys.stdout

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def running(self, trials: dict[str, dict]) -> None:
        pass
