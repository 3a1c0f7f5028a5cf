"""Learning-rate schedules: warmup, then constant, linear decay or cosine decay.

`lr_factor(step, ...)` is the multiplier of the base learning rate used for the optimizer
update numbered `step` (0-based). It is a pure function of the step, so the schedule's state
in a checkpoint is the step alone.
"""

from __future__ import annotations

import dataclasses
import math

from service.spec import Schedule


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


def extend(schedule: Schedule, old_max_train_steps: int, new_max_train_steps: int) -> Schedule:
    """The playbook's round-2 rule for training longer at the same configuration.

    linear decay: keep the decay phase's length (in steps) and lengthen the constant high-LR
    phase before it, so the new run spends the extra steps at the base learning rate. cosine:
    keep the base LR and stretch the curve over the new max_train_steps (the schedule is
    defined relative to max_train_steps, so it is unchanged). constant: unchanged. Warmup stays
    the same number of steps."""
    if schedule.kind != "linear":
        return schedule
    decay_steps = schedule.decay_steps or (old_max_train_steps - schedule.warmup_steps)
    if schedule.warmup_steps + decay_steps > new_max_train_steps:
        raise ValueError(f"cannot shorten a linear decay of {decay_steps} steps into {new_max_train_steps}")
    return dataclasses.replace(schedule, decay_steps=decay_steps)
