"""Learning-rate schedules: warmup, then constant, linear decay or cosine decay.

`lr_factor(step, ...)` is the multiplier of the base learning rate used for the optimizer
update numbered `step` (0-based). It is a pure function of the step, so the schedule's state
in a checkpoint is the step alone.
"""

from __future__ import annotations

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
