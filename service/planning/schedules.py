"""Learning-rate schedules: warmup, then constant, linear decay or cosine decay.

`lr_factor(step, ...)` is the multiplier of the base learning rate used for the optimizer
update numbered `step` (0-based). It is a pure function of the step, so the schedule's state
in a checkpoint is the step alone.
"""

from __future__ import annotations

import dataclasses
import math

from service.study.search import SCHEDULE_HPARAMS
from service.study.spec import schedule_from_dict
from service.study.training import Schedule

ROW_PREFIX = "schedule/"
"""A trial row records its schedule as `schedule/<field>` columns."""


def lr_factor(step: int, max_train_steps: int, schedule: Schedule) -> float:
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    final = schedule.final_lr_fraction
    if schedule.kind == "constant":
        return 1.0
    if schedule.kind == "cosine":
        progress = (step - warmup) / max(1, max_train_steps - warmup)
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    # linear: constant until the decay phase, which covers the last `decay_steps` steps.
    decay_steps = schedule.decay_steps or (max_train_steps - warmup)
    decay_start = max_train_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / decay_steps
    return 1.0 - (1.0 - final) * min(progress, 1.0)


def for_trial(schedule: Schedule, hparams: dict) -> Schedule:
    """A trial's schedule: the study's, with the fields its hyperparameters set (searched or
    fixed in `search`: warmup_steps, decay_steps, final_lr_fraction) where the schedule's kind
    reads them (study validation refuses the others; a derived study such as the find-steps
    sweep's constant schedule keeps only the warmup)."""
    fields = {
        k: hparams[k] for k, kinds in SCHEDULE_HPARAMS.items() if k in hparams and schedule.kind in kinds
    }
    return dataclasses.replace(schedule, **fields) if fields else schedule


def as_dict(schedule: Schedule) -> dict:
    """Its fields as plain data (`spec.schedule_from_dict` reads it back); a shallow copy of the
    scalar fields, cheaper than dataclasses.asdict when a round plans 100,000 trials."""
    return dict(vars(schedule))


def to_columns(schedule: Schedule) -> dict:
    return {ROW_PREFIX + k: v for k, v in as_dict(schedule).items()}


def from_columns(row: dict) -> Schedule | None:
    """The schedule a trial row records (None for a row written before rows recorded one)."""
    if ROW_PREFIX + "kind" not in row:
        return None
    names = [f.name for f in dataclasses.fields(Schedule)]
    return schedule_from_dict({k: row[ROW_PREFIX + k] for k in names if row.get(ROW_PREFIX + k) is not None})


def extend(schedule: Schedule, old_max_train_steps: int, new_max_train_steps: int) -> Schedule:
    """The playbook's round-2 rule for training longer at the same configuration, applied to
    the schedule a trial ran for `old_max_train_steps` steps.

    linear decay: keep the decay phase's length (in steps) and lengthen the constant high-LR
    phase before it, so the new run spends the extra steps at the base learning rate; the
    result names its decay length, so extending it again keeps that length. cosine: keep the
    base LR and stretch the curve over the new max_train_steps (the schedule is defined
    relative to max_train_steps, so it is unchanged). constant: unchanged. Warmup stays the
    same number of steps."""
    if schedule.kind != "linear":
        return schedule
    decay_steps = decay_length(schedule, old_max_train_steps)
    if schedule.warmup_steps + decay_steps > new_max_train_steps:
        raise ValueError(f"cannot shorten a linear decay of {decay_steps} steps into {new_max_train_steps}")
    return dataclasses.replace(schedule, decay_steps=decay_steps)


def decay_length(schedule: Schedule, max_train_steps: int) -> int:
    """Steps of a linear schedule's decay phase in a run of `max_train_steps`."""
    return schedule.decay_steps or (max_train_steps - schedule.warmup_steps)


def describe_extension(trial: str, old: Schedule, old_steps: int, new_steps: int) -> str:
    """What `extend(old, old_steps, new_steps)` does, in words (a trial row's schedule_origin)."""
    warmup = f"warmup {old.warmup_steps}"
    if old.kind == "linear":
        decay = decay_length(old, old_steps)
        before, after = old_steps - old.warmup_steps - decay, new_steps - old.warmup_steps - decay
        return (
            f"linear schedule of {trial} ({old_steps} steps) extended to {new_steps} steps: {warmup} and "
            f"decay {decay} steps kept, constant phase {before} -> {after} steps"
        )
    if old.kind == "cosine":
        return (
            f"cosine schedule of {trial} ({old_steps} steps) stretched to {new_steps} steps: {warmup} and "
            f"the base LR kept"
        )
    return f"constant schedule of {trial} ({old_steps} steps, {warmup}) run for {new_steps} steps"
