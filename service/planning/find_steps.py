"""`playbook find-steps`: the playbook's way to pick an initial max_train_steps.

Sweep constant learning rates on a grid, each trial N steps, "without data augmentation and
regularisation": weight_decay 0 and every switch the workload declares (`Workload.regularizers`,
`Workload.augmentation`) at its 'off' value, other searched hyperparameters fixed at their
middle. Take the step at which the *fastest* learning rate first fits the training set: the
loss of a fixed sample of training examples, evaluated in eval mode exactly like validation
(`train_eval/loss`), at or below a threshold. The answer is only trustworthy when the fastest
learning rate is inside the grid; at an edge, a faster one may lie beyond it, so the finder
refuses and says which way to extend the grid.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from service import workloads
from service.core.errors import SpecError
from service.core.trial_status import TrialStatus
from service.study.search import OPTIMIZER_HPARAMS, HParam, Round
from service.study.spec import Study
from service.study.training import Schedule

FIT_METRIC = "train_eval/loss"


@dataclass(frozen=True)
class StepsFound:
    ok: bool
    message: str
    max_train_steps: int | None = None
    learning_rate: float | None = None
    fit_steps: tuple[tuple[float, int | None], ...] = ()
    """(learning rate, first step at which it fit, or None) for every grid point."""


def sweep_study(study: Study) -> Study:
    """The derived study that runs the sweep: a grid round over `find_steps.learning_rates`,
    constant schedule, regularisation and augmentation off (`switches_off`), other searched
    hyperparameters fixed at their middle, and the fixed training sample evaluated at every
    eval point."""
    fs = study.find_steps
    off = switches_off(workloads.get(study.workload))
    search = {"learning_rate": HParam(role="scientific", type="choice", values=fs.learning_rates)}
    for name, hp in study.search.items():
        if name != "learning_rate" and name not in off:
            search[name] = hp if not hp.searched else HParam(role="fixed", value=middle(hp))
    search.update({name: HParam(role="fixed", value=value) for name, value in off.items()})
    training = dataclasses.replace(
        study.training,
        max_train_steps=fs.max_train_steps,
        eval_every_steps=fs.eval_every_steps,
        schedule=Schedule(kind="constant"),
        validation_sample_size=None,
        full_eval_every_steps=None,
        train_eval_sample_size=fs.train_eval_sample_size,
    )
    rounds = (Round(name="sweep", kind="grid", num_trials=len(fs.learning_rates)),)
    return dataclasses.replace(
        study,
        name=f"{study.name}-find-steps",
        search=search,
        training=training,
        rounds=rounds,
        description=f"max_train_steps finder for {study.name}",
    )


def switches_off(workload) -> dict[str, Any]:
    """Every regularisation and augmentation switch, at its 'off' value: weight_decay and
    those the workload declares. A declared name the workload does not accept is refused."""
    if "loss" not in workload.metric_names:
        raise SpecError(
            f"find_steps: workload {workload.name} reports no 'loss' metric (metric_names), "
            "which tells whether the training set is fit"
        )
    declared = {**workload.regularizers, **workload.augmentation}
    for name in declared:
        if name not in workload.hparam_defaults and name not in OPTIMIZER_HPARAMS:
            raise SpecError(
                f"find_steps: workload {workload.name} declares regularizer/augmentation {name!r}, "
                "which is not one of its hparam_defaults"
            )
    return {"weight_decay": 0.0, **declared}


def middle(hp: HParam):
    """The centre of a searched dimension (log-aware), or the first value of a choice."""
    if hp.type == "choice":
        return hp.values[0]
    if hp.scale == "log":
        value = math.sqrt(hp.min * hp.max)
    else:
        value = (hp.min + hp.max) / 2
    return int(round(value)) if hp.type == "int" else value


def first_fit_step(history: list[dict], threshold: float) -> int | None:
    """The first eval step whose training-sample loss (`train_eval/loss`) is at or below
    `threshold`; None if there is none or the trial diverged first."""
    for row in history:
        loss = row.get(FIT_METRIC)
        if row.get("status") == TrialStatus.DIVERGED.reported:
            return None
        if isinstance(loss, float) and math.isfinite(loss) and loss <= threshold:
            return row["step"]
    return None


def choose(fit_steps: dict[float, int | None], max_train_steps: int, threshold: float) -> StepsFound:
    grid = sorted(fit_steps)
    table = tuple((lr, fit_steps[lr]) for lr in grid)
    fitted = {lr: s for lr, s in fit_steps.items() if s is not None}
    if not fitted:
        return StepsFound(
            False,
            f"no learning rate fit the training set ({FIT_METRIC} <= {threshold}) "
            f"within {max_train_steps} steps: raise find_steps.max_train_steps "
            "or the threshold",
            fit_steps=table,
        )
    best = min(fitted, key=lambda lr: (fitted[lr], lr))
    if best in (grid[0], grid[-1]):
        side = "below" if best == grid[0] else "above"
        return StepsFound(
            False,
            f"the fastest learning rate, {best:g}, is at the edge of the grid; "
            f"extend find_steps.learning_rates {side} it and rerun",
            learning_rate=best,
            fit_steps=table,
        )
    steps = fitted[best]
    return StepsFound(
        True,
        f"initial max_train_steps: {steps} (learning_rate={best:g} fits the "
        f"training set at step {steps}, the fastest of {len(grid)})",
        max_train_steps=steps,
        learning_rate=best,
        fit_steps=table,
    )
