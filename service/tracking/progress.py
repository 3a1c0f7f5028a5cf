"""Live progress lines for the job log: per trial, step / max steps, the latest metrics and an
ETA, at most one line per trial every `min_interval_s` (trials report at each evaluation,
which can be many times a second for short trials).

Built only from the Tune reports the coordinator receives; it keeps one timestamp per trial
(no history), so its memory does not grow with the number of steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from service.core.formatting import fmt

DEFAULT_MIN_INTERVAL_S = 10.0


class ProgressLimiter:
    """Decides whether a trial's report is printed: its first report, its last (step ==
    max steps) and otherwise at most one every `min_interval_s` per trial."""

    def __init__(
        self, min_interval_s: float = DEFAULT_MIN_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ):
        self.min_interval_s, self.clock = min_interval_s, clock
        self._last_print_s: dict[str, float] = {}

    def should_print(self, trial_name: str, step: int | None, max_steps: int | None) -> bool:
        now = self.clock()
        last = self._last_print_s.get(trial_name)
        final = step is not None and max_steps is not None and step >= max_steps
        if last is None or final or now - last >= self.min_interval_s:
            self._last_print_s[trial_name] = now
            return True
        return False

    def forget(self, trial_name: str) -> None:
        self._last_print_s.pop(trial_name, None)


def eta_s(step: int | None, max_steps: int | None, steps_per_s: float | None) -> float | None:
    """Seconds left at the latest measured rate, or None when there is no rate yet."""
    if step is None or max_steps is None or not steps_per_s or not math.isfinite(steps_per_s):
        return None
    return max(0, max_steps - step) / steps_per_s


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def progress_line(trial_name: str, result: dict, max_steps: int, metric: str) -> str:
    """`[explore-0001] step 40/100 (40%) train/loss=0.31 validation/loss=0.29 best=0.29 at 40
    12.5 steps/s ETA 4s`."""
    step, rate = result.get("step"), result.get("steps_per_s")
    pct = f" ({100 * step / max_steps:.0f}%)" if isinstance(step, int) and max_steps else ""
    best = ""
    if result.get("best_metric") is not None:
        best = f" best={fmt(result.get('best_metric'))} at {result.get('best_step')}"
    return (
        f"[{trial_name}] step {step}/{max_steps}{pct} train/loss={fmt(result.get('train/loss'))} "
        f"{metric}={fmt(result.get(metric))}{best} ({fmt(rate)} steps/s, "
        f"ETA {format_duration(eta_s(step, max_steps, rate))})"
    )
