"""The lines a study says to its user (a trial started, evaluated, finished, diverged, failed or
resumed; a round planned; a round's verdicts), kept in the coordinator for the command that
started the study to fetch and print (`orchestration.coordinator.run_study`). Printed by the
coordinator itself, each would reach that command through Ray's log forwarding: prefixed with
"(Coordinator pid=N)", coloured, and late, after the command's own last lines."""

from __future__ import annotations

import collections
import threading

KEEP_LINES = 10_000
"""Lines kept for a reader that has not fetched them yet (it fetches twice a second)."""


class ConsoleLines:
    """Numbered lines, the latest `keep` of them kept: `since(n)` gives the lines from number n
    on and the next number to ask for; a reader that fell further behind is told how many it
    missed."""

    def __init__(self, keep: int = KEEP_LINES):
        self._lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._next = 0
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
            self._next += 1

    def since(self, number: int) -> tuple[int, list[str]]:
        with self._lock:
            first = self._next - len(self._lines)
            lines = list(self._lines)[max(0, number - first) :]
            missed = first - number
            if missed > 0:
                lines.insert(0, f"({missed} earlier lines were not kept)")
            return self._next, lines
