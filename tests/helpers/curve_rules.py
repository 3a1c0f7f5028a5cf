"""The training-curve rules of docs/verdicts.md, default thresholds, read with numpy from one
FINISHED trial's metrics log: the independent reading the tests compare
`service.analysis.curves` with on real trials."""

from __future__ import annotations

import numpy as np


def plain_curve_kinds(
    log: list[dict], total: int, best_step: int, metric: str = "validation/loss"
) -> set[str]:
    """The kinds that fire for a trial of `total` steps whose best checkpoint is at `best_step`
    (a metric to minimize)."""
    steps = np.array([h["step"] for h in log])
    val, train = (np.array([h[k] for h in log], dtype=float) for k in (metric, "train/loss"))
    kinds = set()
    b = int(np.flatnonzero(val == val.min())[-1])  # the last evaluation at the best value
    gain = val[0] - val.min()
    if gain > 0 and b < len(val) - 1 and val[-1] - val[b] > 0.1 * gain and train[-1] < train[b]:
        kinds.add("overfitting")
    tail = steps > 0.75 * total
    if _noisy(val[tail], val) or _noisy(train[tail], train):
        kinds.add("late_noise")
    if tail.any() and (~tail).any() and val[~tail].min() - val[tail].min() > 0.05 * gain:
        kinds.add("still_improving")
    flat_by = [steps[np.argmax(c <= c.min() + 0.02 * (c[0] - c.min()))] for c in (val, train)]
    improved = all(c[0] > c.min() for c in (val, train))
    if improved and max(flat_by) <= 0.5 * total and best_step <= 0.75 * total:
        kinds.add("saturated_early")
    low = int(np.argmin(train))
    if low < len(train) - 1 and train[-1] - train[low] > 0.1 * (train[0] - train[low]):
        kinds.add("training_loss_rising")
    if any(steps[i] <= 0.2 * total and train[i] > 1.5 * train[:i].min() for i in range(1, len(train))):
        kinds.add("early_instability")
    return kinds


def _noisy(tail: np.ndarray, whole: np.ndarray) -> bool:
    """At least 3 tail evaluations whose changes' standard deviation (ddof 1) is over 10% of
    the curve's improvement."""
    gain = whole[0] - whole.min()
    return len(tail) >= 3 and gain > 0 and float(np.std(np.diff(tail), ddof=1)) > 0.1 * gain
