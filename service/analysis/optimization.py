"""Optimization-failure verdicts, read from a trial's metrics log beside its curve shapes
(`service.analysis.curves` runs them per trial and per round):

* `early_instability` -- a training-loss spike (or a divergence) early in training: the
  playbook's early-training instability, cured by warmup ("warmup length ... transfers");
* `clipping` -- from the gradient norms the step loop logs on every eval row, clipping on or
  off (`train/grad_norm`, the interval's mean norm before clipping, and
  `train/clipped_fraction`, 0 without `grad_clip_norm`): the 90th percentile of the norms as a
  clipping threshold, and a warning when more than half of the updates were clipped;
* `clip_threshold` -- the round's: the best trial's suggested threshold.

Each rule as applied: docs/verdicts.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from service.analysis.verdicts import OK, WARNING, Verdict, as_number, make_verdict, percent
from service.core.formatting import fmt
from service.core.trial_status import TrialStatus
from service.study.search import CLIP_HPARAM
from service.study.sections import Curves

if TYPE_CHECKING:
    from service.analysis.curve_data import TrialCurves

GRAD_NORM, CLIPPED = "train/grad_norm", "train/clipped_fraction"
CLIP_PERCENTILE = 90
"""The suggested clipping threshold: this percentile of the logged gradient norms."""
CLIPPED_MAJORITY = 0.5
"""More than this fraction of the updates clipped: the clip sets the step size."""


def early_instability(t: TrialCurves, th: Curves) -> Verdict | None:
    """In the first `early_fraction` x max_train_steps steps: a divergence, or the first
    evaluation whose training loss is above `spike_ratio` times the lowest before it."""
    window = th.early_fraction * t.max_train_steps
    advice = "early instability; a learning-rate warmup (or a longer one) usually cures it."
    where = f"in the first {percent(th.early_fraction)} of its {t.max_train_steps} steps"
    diverged_at = as_number(t.row.get("diverged_at_step"))
    if t.row.get("status") == TrialStatus.DIVERGED and diverged_at is not None and diverged_at <= window:
        message = f"{t.name} diverged at step {int(diverged_at)}, {where}: {advice}"
        return make_verdict(
            "early_instability", t.name, WARNING, message, trial_name=t.name, step=int(diverged_at)
        )
    c = t.train
    for i in range(1, len(c.values)):
        if c.steps[i] > window:
            break
        low = int(np.argmin(c.values[:i]))
        if c.values[low] > 0 and c.values[i] > th.spike_ratio * c.values[low]:
            return make_verdict(
                "early_instability",
                t.name,
                WARNING,
                f"{t.name}'s training loss spiked {where}: {c.at(i)} against {c.at(low)} "
                f"({fmt(c.values[i] / c.values[low])} times): {advice}",
                trial_name=t.name,
                step=c.steps[i],
                value=c.values[i],
                low_step=c.steps[low],
                low_value=c.values[low],
            )
    return None


def logged_norms(history: Sequence[Mapping[str, Any]]) -> list[float]:
    """The finite `train/grad_norm` of each eval row, in log order."""
    return [v for h in history if (v := as_number(h.get(GRAD_NORM))) is not None]


def clipped_updates(history: Sequence[Mapping[str, Any]]) -> tuple[float, int]:
    """(updates clipped, updates) over the evaluations that logged a clipped fraction: each
    eval row's fraction times the steps of its interval (since the previous row)."""
    clipped, updates, previous = 0.0, 0, 0
    for h in history:
        step, fraction = as_number(h.get("step")), as_number(h.get(CLIPPED))
        if step is None:
            continue
        if fraction is not None:
            clipped += fraction * (step - previous)
            updates += int(step - previous)
        previous = int(step)
    return clipped, updates


def clipping(t: TrialCurves, th: Curves | None = None) -> Verdict | None:
    """The 90th percentile of the logged gradient norms (each an eval interval's mean norm
    before clipping; numpy's linear interpolation) as the suggested `grad_clip_norm`, for a
    trial that clips or not (its row's `hp/grad_clip_norm`); a warning when more than half of
    the updates were clipped. None without logged norms."""
    norms = logged_norms(t.history)
    if not norms:
        return None
    p90 = float(np.percentile(norms, CLIP_PERCENTILE))
    clipped, updates = clipped_updates(t.history)
    share = clipped / updates if updates else 0.0
    clip = as_number(t.row.get(f"hp/{CLIP_HPARAM}"))
    return make_verdict(
        "clipping",
        t.name,
        WARNING if share > CLIPPED_MAJORITY else OK,
        _clip_message(t.name, p90, clip, clipped, updates),
        trial_name=t.name,
        suggested_clip=p90,
        grad_clip_norm=clip,
        clipped_share=share,
        clipped_updates=clipped,
        updates=updates,
        num_norms=len(norms),
    )


def _clip_message(name: str, p90: float, clip: float | None, clipped: float, updates: int) -> str:
    share = clipped / updates if updates else 0.0
    said = f"{percent(share)} of its updates were clipped ({round(clipped)} of {updates})"
    norms = "the 90th percentile of its logged gradient norms (eval-interval means, before clipping) is"
    norms += f" {fmt(p90)}"
    if share > CLIPPED_MAJORITY:
        return (
            f"{name}: {said}, more than half: the clip, not the gradient, sets the step size; raise "
            f"grad_clip_norm towards {fmt(p90)} (the 90th percentile of its logged gradient norms) or "
            "lower the learning rate."
        )
    if clip is None:
        return f"{name} trains without gradient clipping; {norms}, the grad_clip_norm to try."
    return f"{name}: {norms}, the clipping threshold to try; {said}."


def clip_threshold(v: Verdict) -> Verdict:
    """The round's suggested `grad_clip_norm`: the best trial's `clipping` verdict `v`."""
    facts = v.facts
    return make_verdict(
        "clip_threshold",
        "study",
        OK,
        f"Suggested grad_clip_norm: {fmt(facts['suggested_clip'])}, the 90th percentile of the best trial "
        f"{v.subject}'s {facts['num_norms']} logged gradient norms (eval-interval means, before clipping).",
        trial_name=v.subject,
        suggested_clip=facts["suggested_clip"],
    )
