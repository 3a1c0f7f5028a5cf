"""One trial's plan (what to train) and the retrospective choice of its best evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from service import storage
from service.spec import Schedule, Study


@dataclass(frozen=True)
class TrialPlan:
    study: Study
    trial_name: str
    """`<round>-<index>`; also the Ray Train run name, so a retried trial resumes its run."""
    round_name: str
    hparams: dict[str, Any] = field(default_factory=dict)
    max_train_steps: int = 0
    seed: int | None = None
    """Overrides training.seed (extend rounds rerun one configuration with several seeds)."""
    schedule: Schedule | None = None
    """Overrides training.schedule (the extended schedule of an extend round)."""

    @property
    def trial_seed(self) -> int:
        return self.study.training.seed if self.seed is None else self.seed

    @property
    def lr_schedule(self) -> Schedule:
        return self.schedule or self.study.training.schedule

    @property
    def trial_uri(self) -> str:
        return storage.join(self.study.study_uri, "trials", self.trial_name)

    @property
    def topology_uri(self) -> str:
        return storage.join(self.trial_uri, "topology.json")

    def predictions_uri(self, split: str, step: int) -> str:
        return storage.join(self.trial_uri, "predictions", f"{split}-step{step:08d}.parquet")

    @property
    def metrics_uri(self) -> str:
        return storage.join(self.trial_uri, "metrics.jsonl")


def worst(mode: str) -> float:
    return math.inf if mode == "min" else -math.inf


def best_row(history: list[dict], metric: str, mode: str) -> dict | None:
    """The evaluation with the best finite `metric` (the earliest one on a tie)."""
    rows = [r for r in history if isinstance(r.get(metric), float | int) and math.isfinite(r[metric])]
    if not rows:
        return None
    sign = 1 if mode == "min" else -1
    return min(rows, key=lambda r: (sign * r[metric], r["step"]))
