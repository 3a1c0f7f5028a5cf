"""One trial's plan (what to train)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from service.planning import schedules
from service.study.layout import TrialLayout
from service.study.spec import Study, schedule_from_dict
from service.study.training import Schedule


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

    @functools.cached_property
    def lr_schedule(self) -> Schedule:
        """Worked out once (the step loop reads it every step)."""
        return self.schedule or schedules.for_trial(self.study.training.schedule, self.hparams)

    @property
    def layout(self) -> TrialLayout:
        """Where this trial's files are on storage."""
        return self.study.layout.trial(self.trial_name)

    @property
    def trial_uri(self) -> str:
        return self.layout.uri

    @property
    def topology_uri(self) -> str:
        return self.layout.topology

    def predictions_uri(self, split: str, step: int) -> str:
        return self.layout.predictions(split, step)

    @property
    def metrics_uri(self) -> str:
        return self.layout.metrics_log
