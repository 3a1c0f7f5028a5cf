"""A trial's training curves as the curve verdicts (`service.analysis.curves`) read them: each
logged quantity against step (`Curve`), the trial's metric and training-loss curves with its
length and history (`TrialCurves`), and the evaluation's noise where it is known
(`metric_noise`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.analysis.eval_noise import RATE_METRICS, rate_noise
from service.analysis.verdicts import as_number
from service.core.formatting import fmt
from service.study.sections import Curves

TRAIN_LOSS = "train/loss"


@dataclass(frozen=True)
class Curve:
    """One logged quantity of a trial against step: its finite evaluations in step order.
    `sign` turns values into losses (lower is better): +1 for mode min, -1 for mode max."""

    key: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    sign: int = 1

    @classmethod
    def of(cls, history: Sequence[Mapping[str, Any]], key: str, mode: str = "min") -> Curve:
        points = [
            (int(h["step"]), v)
            for h in history
            if (v := as_number(h.get(key))) is not None and as_number(h.get("step")) is not None
        ]
        steps, values = zip(*points, strict=True) if points else ((), ())
        return cls(key, tuple(steps), tuple(values), 1 if mode == "min" else -1)

    @property
    def losses(self) -> np.ndarray:
        return self.sign * np.asarray(self.values, dtype=float)

    @property
    def improvement(self) -> float:
        """How much better than its first evaluation its best one is (0 if none is)."""
        return float(self.losses[0] - self.losses.min()) if self.values else 0.0

    @property
    def mode(self) -> str:
        return "min" if self.sign == 1 else "max"

    def best_index(self) -> int:
        """The last evaluation at the best value."""
        losses = self.losses
        return int(np.flatnonzero(losses == losses.min())[-1])

    def at(self, i: int) -> str:
        return f"{fmt(self.values[i])} at step {self.steps[i]}"


@dataclass(frozen=True)
class TrialCurves:
    """What the per-trial checks read: the trial, its length, its metric and training-loss
    curves, and its history (for the gradient norms)."""

    name: str
    max_train_steps: int
    metric: Curve
    train: Curve
    history: Sequence[Mapping[str, Any]]
    row: Mapping[str, Any]

    def tail(self, th: Curves, curve: Curve) -> tuple[list[int], list[int]]:
        """Indices of `curve`'s evaluations up to (1 - tail_fraction) x max_train_steps, and after."""
        start = (1 - th.tail_fraction) * self.max_train_steps
        before = [i for i, s in enumerate(curve.steps) if s <= start]
        return before, [i for i, s in enumerate(curve.steps) if s > start]


def trial_curves(row: Mapping[str, Any], history: Sequence[Mapping[str, Any]], metric: str, mode: str):
    """The `TrialCurves` of a trial row and its metrics log."""
    total = as_number(row.get("max_train_steps")) or max([int(h.get("step") or 0) for h in history] or [1])
    return TrialCurves(
        str(row["trial_name"]),
        int(total),
        Curve.of(history, metric, mode),
        Curve.of(history, TRAIN_LOSS),
        history,
        row,
    )


def metric_noise(t: TrialCurves) -> tuple[float, int] | None:
    """(noise, n): the largest change of the metric its evaluation cannot tell from noise, and
    the examples it was measured on. Known for a rate metric (`validation/error`,
    `validation/accuracy`: a mean of 0/1 values) whose log has the evaluation's example count
    (`validation/count`) at its best evaluation: `eval_noise.rate_noise` of the best value,
    the binomial standard error and at least one example (1 / n). None otherwise (a loss:
    its per-example spread is not in the log)."""
    m = t.metric
    prefix, _, name = m.key.rpartition("/")
    if name not in RATE_METRICS or len(m.values) < 1:
        return None
    b = m.best_index()
    at_best = next((h for h in t.history if h.get("step") == m.steps[b]), {})
    n = as_number(at_best.get(f"{prefix}/count"))
    if n is None or n < 1:
        return None
    return rate_noise(m.values[b], int(n)), int(n)
