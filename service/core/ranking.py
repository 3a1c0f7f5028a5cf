"""Which result is best: one order by a metric and its mode ("min" or "max"), for a trial's
evaluations (its best checkpoint) and for a study's trials (its best trial).

Best first when sorted ascending: by the metric in the mode's direction, a value that is not a
finite number last (and never the best), and on a tie by one stated rule -- for evaluations the
later step first (see `rank`), for trials the earlier trial name first (see `trial_key`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from service.core.trial_status import TrialStatus

MODES = ("min", "max")


def sign(mode: str) -> int:
    """1 for "min", -1 for "max": `sign * value` is smaller for a better value."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'min' or 'max' (got {mode!r})")
    return 1 if mode == "min" else -1


def worst(mode: str) -> float:
    """The value worse than any other: what a trial without a finite evaluation reports."""
    return sign(mode) * math.inf


def is_finite(value: Any) -> bool:
    """A real number (not a bool) that is finite."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def key(value: Any, mode: str, tie: Any = 0) -> tuple:
    """The sort key of `value` (best first when ascending; a non-finite value last), then `tie`."""
    return (sign(mode) * value if is_finite(value) else math.inf, tie)


def rank(value: Any, step: int, mode: str) -> tuple:
    """Where an evaluation (and its checkpoint) ranks, best first when sorted ascending: by the
    metric (a non-finite one last), and on a tie the later step first. This is Ray Train's own
    order for checkpoints of equal score (the later report ranks higher), so retention on both
    paths (Ray Train's, `distributed.checkpoint_store`'s) and the choice of the best agree: the best
    evaluation's checkpoint is always one that is kept."""
    return key(value, mode, -step)


def best_row(history: Iterable[Mapping], metric: str, mode: str) -> Any:
    """The evaluation with the best finite `metric` (the latest one on a tie: see `rank`);
    None if there is none."""
    rows = [r for r in history if is_finite(r.get(metric))]
    return min(rows, key=lambda r: rank(r[metric], r["step"], mode), default=None)


def first_best_step(history: Iterable[Mapping[str, Any]], metric: str, mode: str) -> int | None:
    """The first step at which a trial's `metric` reached its best finite value in `history`
    (its evaluations): where the best was reached. The best checkpoint (`best_row`) is
    the latest evaluation at that value, later on a plateau. None without a finite value."""
    history = list(history)
    best = best_row(history, metric, mode)
    if best is None:
        return None
    return min(int(r["step"]) for r in history if is_finite(r.get(metric)) and r[metric] == best[metric])


def trial_key(row: Mapping, mode: str) -> tuple:
    """Where a trial row ranks by its `best_metric`; on a tie the earlier trial name first, so
    the order does not depend on the order of the rows."""
    return key(row.get("best_metric"), mode, str(row.get("trial_name")))


def results(rows: Iterable[Mapping]) -> list:
    """The trial rows that count as results: FINISHED with a finite best_metric."""
    return [r for r in rows if r.get("status") == TrialStatus.FINISHED and is_finite(r.get("best_metric"))]


def ranked_results(rows: Iterable[Mapping], mode: str) -> list:
    """`results(rows)`, best first (see `trial_key`)."""
    return sorted(results(rows), key=lambda r: trial_key(r, mode))


def best_result(rows: Iterable[Mapping], mode: str) -> Any:
    """The first of `ranked_results`; None if no trial has a result."""
    return min(results(rows), key=lambda r: trial_key(r, mode), default=None)
