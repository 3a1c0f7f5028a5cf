"""One trial's plan (what to train) and the retrospective choice of its best evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from service.core import storage
from service.planning import schedules
from service.study.spec import Schedule, Study, schedule_from_dict


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
    """The trial's schedule as its round planned it (an extend round's: the extended one);
    None: training.schedule with the schedule fields of `hparams`."""

    @classmethod
    def from_config(cls, study: Study, c: dict) -> TrialPlan:
        """The plan of a trial config of `rounds.plan_round` (what each Tune trial trains)."""
        return cls(
            study=study,
            trial_name=c["trial_name"],
            round_name=c["round"],
            hparams=c["hparams"],
            max_train_steps=c["max_train_steps"],
            seed=c.get("seed"),
            schedule=schedule_from_dict(c["schedule"]) if c.get("schedule") else None,
        )

    def learning_rate(self, step: int) -> float:
        """The learning rate of the optimizer update numbered `step` (0-based)."""
        steps = self.max_train_steps or self.study.training.max_train_steps
        return float(self.hparams["learning_rate"]) * schedules.lr_factor(step, steps, self.lr_schedule)

    @property
    def trial_seed(self) -> int:
        return self.study.training.seed if self.seed is None else self.seed

    @property
    def lr_schedule(self) -> Schedule:
        return self.schedule or schedules.for_trial(self.study.training.schedule, self.hparams)

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


def rank(value, step: int, mode: str) -> tuple[float, int]:
    """Where an evaluation (and its checkpoint) ranks, best first when sorted ascending: by the
    metric (a non-finite one last), and on a tie the later step first. This is Ray Train's own
    order for checkpoints of equal score (the later report ranks higher), so retention on both
    paths (Ray Train's, `trainer.checkpoint_store`'s) and the choice of the best agree: the best
    evaluation's checkpoint is always one that is kept."""
    finite = isinstance(value, float | int) and math.isfinite(value)
    sign = 1 if mode == "min" else -1
    return (sign * value if finite else math.inf, -step)


def best_row(history: list[dict], metric: str, mode: str) -> dict | None:
    """The evaluation with the best finite `metric` (the latest one on a tie: see `rank`)."""
    rows = [r for r in history if isinstance(r.get(metric), float | int) and math.isfinite(r[metric])]
    if not rows:
        return None
    return min(rows, key=lambda r: rank(r[metric], r["step"], mode))
