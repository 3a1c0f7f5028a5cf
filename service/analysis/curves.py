"""Training-curve verdicts: the playbook's "check the training curves at the end of training"
(periodic evaluation exists for it), read from each trial's metrics log.

Per trial (`trial_verdicts`), from its evaluations in step order, with the thresholds of the
study file's `curves:` section (`service.study.sections.Curves`):

* `overfitting` -- the validation metric worsens after its best evaluation while the training
  loss still falls ("training longer ... can even overfit"); the onset is the best step; not
  for a worsening (or an improvement) within the evaluation's noise (`curve_data.metric_noise`);
* `did_not_learn` -- a rate metric whose best is no better than its first evaluation, nor
  than predicting the most frequent class, within the evaluation's noise;
* `late_noise` -- high step-to-step variance late in training (it blurs the comparison of
  trials at their best checkpoints);
* `still_improving` -- the metric still improved over the last part of training: train longer;
* `saturated_early` -- metric and training loss both flat long before the end: steps wasted
  (not said of a trial whose best value was first reached in the last 25%:
  `best_step_position` says "train longer" there);
* `training_loss_rising` -- the training loss ends well above its lowest value;
* `early_instability` and `clipping` -- the optimization failures
  (`service.analysis.optimization`).

A round's summary of them: `service.analysis.curve_summary`. Each rule as applied:
docs/verdicts.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.analysis.curve_data import TRAIN_LOSS, Curve, TrialCurves, metric_noise, trial_curves
from service.analysis.optimization import clipping, early_instability
from service.analysis.verdicts import (
    WARNING,
    Verdict,
    as_number,
    make_verdict,
    percent,
    reached_best_step,
    step_position,
)
from service.core.formatting import fmt
from service.core.trial_status import TrialStatus
from service.study.sections import Curves

KINDS = (
    "did_not_learn", "overfitting", "late_noise", "still_improving", "saturated_early",
    "training_loss_rising", "early_instability", "clipping",
)  # fmt: skip
NAMES_SHOWN = 8
"""A round verdict names at most this many trials (and counts the rest)."""


# ----------------------------------------------------------------------------- curve shapes


def did_not_learn(t: TrialCurves, th: Curves) -> Verdict | None:
    """A rate metric (`metric_noise` known) whose best is within the evaluation's noise of its
    first evaluation (the first may come after some learning) and no better than predicting
    the most frequent class of the evaluation (its `<split>/per_class` supports, at the best
    evaluation) beyond that noise: the model learned nothing the evaluation can see."""
    m, noise = t.metric, metric_noise(t)
    if noise is None or len(m.values) < 2 or m.improvement > noise[0]:
        return None
    b = m.best_index()
    majority = _majority_rate(t, b)
    if majority is None:
        return None
    name = m.key.rpartition("/")[2]
    trivial = 1 - majority if name == "error" else majority  # predicting the most frequent class
    if m.sign * (trivial - m.values[b]) > noise[0]:  # better than that beyond the noise
        return None
    train = t.train
    fell = (
        f"; {TRAIN_LOSS} went from {train.at(0)} to {train.at(len(train.values) - 1)}" if train.values else ""
    )
    return make_verdict(
        "did_not_learn",
        t.name,
        WARNING,
        f"{t.name} did not learn: {m.key}'s best, {m.at(b)}, is {fmt(m.improvement * noise[1])} of "
        f"{noise[1]} examples ({fmt(m.improvement)}) better than its first evaluation, {m.at(0)}, within "
        f"the evaluation's noise ({fmt(noise[0])}), and no better than predicting the most frequent class "
        f"({fmt(trivial)}){fell}: check the learning rate, the labels and the input pipeline.",
        trial_name=t.name,
        first_value=m.values[0],
        best_value=m.values[b],
        best_step=m.steps[b],
        trivial_value=trivial,
        noise=noise[0],
        num_examples=noise[1],
    )


def _majority_rate(t: TrialCurves, i: int) -> float | None:
    """The share of the most frequent class among the evaluation's examples at evaluation `i`
    (from its `<split>/per_class` supports), or None when not logged."""
    prefix = t.metric.key.rpartition("/")[0]
    at = next((h for h in t.history if h.get("step") == t.metric.steps[i]), {})
    supports = [
        as_number(c.get("support")) for c in at.get(f"{prefix}/per_class") or () if isinstance(c, dict)
    ]
    if not supports or any(s is None for s in supports) or sum(supports) <= 0:
        return None
    return max(supports) / sum(supports)


def overfitting(t: TrialCurves, th: Curves) -> Verdict | None:
    """The metric ends worse than its best by more than `overfit_rise` of its improvement, and
    the training loss at the end is lower than at the metric's best step. Not when the
    evaluation's noise is known (`metric_noise`) and the worsening, or the improvement it is a
    share of, is within it. "Or fewer steps" only for an onset before the last 25%
    (`_or_fewer_steps`)."""
    m, train = t.metric, dict(zip(t.train.steps, t.train.values, strict=True))
    if len(m.values) < 2 or m.improvement <= 0:
        return None
    b, last = m.best_index(), len(m.values) - 1
    rise = float(m.losses[last] - m.losses[b])
    loss_then, loss_end = train.get(m.steps[b]), train.get(m.steps[last])
    if b == last or rise <= th.overfit_rise * m.improvement or loss_then is None or loss_end is None:
        return None
    if not loss_end < loss_then:
        return None
    noise = metric_noise(t)
    if noise is not None and (rise <= noise[0] or m.improvement <= noise[0]):
        return None
    return make_verdict(
        "overfitting",
        t.name,
        WARNING,
        f"{t.name} overfits from step {m.steps[b]}: {m.key} is best there ({fmt(m.values[b])}) and ends at "
        f"{m.at(last)}, giving back {percent(rise / m.improvement)} of its improvement, while {TRAIN_LOSS} "
        f"still fell from {fmt(loss_then)} to {fmt(loss_end)}: more regularization or data augmentation "
        f"{_or_fewer_steps(m.steps[b], t.max_train_steps)}would help.",
        trial_name=t.name,
        onset_step=m.steps[b],
        best_value=m.values[b],
        last_step=m.steps[last],
        last_value=m.values[last],
        train_loss_at_onset=loss_then,
        train_loss_last=loss_end,
        noise=None if noise is None else noise[0],
    )


def _or_fewer_steps(onset: int, max_train_steps: int) -> str:
    """Fewer steps are advised only for an onset before the last 25% of training: a later best
    step is `best_step_position`'s "train longer", and the best checkpoint is kept anyway."""
    return "" if step_position(onset, max_train_steps) == "late" else "(or fewer steps) "


def late_noise(t: TrialCurves, th: Curves) -> Verdict | None:
    """Over the tail's evaluations (at least 3), the standard deviation (ddof 1) of the
    step-to-step changes of the metric or the training loss is more than `noise_ratio` of
    that curve's improvement."""
    noisy = []
    for curve in (t.metric, t.train):
        _, tail = t.tail(th, curve)
        if len(tail) < 3 or curve.improvement <= 0:
            continue
        sd = float(np.std(np.diff(np.asarray(curve.values)[tail]), ddof=1))
        if sd > th.noise_ratio * curve.improvement:
            noisy.append((curve, tail, sd))
    if not noisy:
        return None
    said = "; ".join(
        f"{c.key} changes by {fmt(sd)} (standard deviation) between evaluations from step {c.steps[tail[0]]} "
        f"on, {percent(sd / c.improvement)} of its improvement {fmt(c.improvement)}"
        for c, tail, sd in noisy
    )
    return make_verdict(
        "late_noise",
        t.name,
        WARNING,
        f"{t.name} is noisy late in training: {said}. Its best checkpoint is partly luck; a larger batch, "
        "a lower final learning rate or more frequent evaluation would steady the comparison.",
        trial_name=t.name,
        curves=tuple(c.key for c, _, _ in noisy),
        change_sd=tuple(sd for _, _, sd in noisy),
        from_step=tuple(c.steps[tail[0]] for c, tail, _ in noisy),
    )


def still_improving(t: TrialCurves, th: Curves) -> Verdict | None:
    """The metric's best over the tail beats its best before the tail by more than
    `still_improving` of its whole improvement and, where the evaluation's noise is known
    (`metric_noise`), by more than that noise: a gain the evaluation cannot tell from noise is
    no reason to train longer."""
    m = t.metric
    before, tail = t.tail(th, m)
    if not before or not tail or m.improvement <= 0:
        return None
    i = before[int(np.argmin(m.losses[before]))]
    j = tail[int(np.argmin(m.losses[tail]))]
    gain = float(m.losses[i] - m.losses[j])
    noise = metric_noise(t)
    if gain <= th.still_improving * m.improvement or (noise is not None and gain <= noise[0]):
        return None
    return make_verdict(
        "still_improving",
        t.name,
        WARNING,
        f"{t.name} is still improving at the end: {m.key}'s best went from {m.at(i)} to {m.at(j)} in the "
        f"last {percent(th.tail_fraction)} of its {t.max_train_steps} steps, {percent(gain / m.improvement)} "
        "of its whole improvement: train longer.",
        trial_name=t.name,
        before_step=m.steps[i],
        before_value=m.values[i],
        tail_step=m.steps[j],
        tail_value=m.values[j],
        tail_share=gain / m.improvement,
    )


def best_step(t: TrialCurves) -> int:
    """The step at which the trial first reached its best value, as `best_step_position` judges
    it (`verdicts.reached_best_step`: from its metrics log, else its row's `best_step`); a
    plateau that began before the end is not "best at the end"."""
    step = reached_best_step(t.row, t.history, t.metric.key, t.metric.mode)
    return step if step is not None else t.metric.steps[t.metric.best_index()]


def saturation_step(curve: Curve, th: Curves) -> int | None:
    """The first step at which `curve` is within `saturation_tolerance` of its improvement of
    its best value (None for a curve that never improved)."""
    if len(curve.values) < 2 or curve.improvement <= 0:
        return None
    near = curve.losses <= curve.losses.min() + th.saturation_tolerance * curve.improvement
    return curve.steps[int(np.argmax(near))]


def saturated_early(t: TrialCurves, th: Curves) -> Verdict | None:
    """The metric and the training loss (when logged) were both within `saturation_tolerance`
    of their best by `saturated_by` x max_train_steps, and the trial's best value was not first
    reached in the last 25% of training (`best_step`): there `best_step_position` says "train
    longer" (the playbook: in doubt, train longer), so "fewer steps would do" is not said of
    the same trial."""
    curves = [c for c in (t.metric, t.train) if c.values]
    steps = [saturation_step(c, th) for c in curves]
    limit = th.saturated_by * t.max_train_steps
    if not curves or any(s is None or s > limit for s in steps):
        return None
    if step_position(best_step(t), t.max_train_steps) == "late":
        return None
    said = " and ".join(f"{c.key} by step {s}" for c, s in zip(curves[1:], steps[1:], strict=True))
    return make_verdict(
        "saturated_early",
        t.name,
        WARNING,
        f"{t.name} saturated early: {curves[0].key} had made {percent(1 - th.saturation_tolerance)} of its "
        f"improvement by step {steps[0]}{' and ' + said if said else ''}, of {t.max_train_steps} steps; the "
        f"steps after step {max(steps)} changed little (a lower max_train_steps would do).",
        trial_name=t.name,
        curves=tuple(c.key for c in curves),
        saturation_steps=tuple(steps),
    )


def training_loss_rising(t: TrialCurves, th: Curves) -> Verdict | None:
    """The training loss ends above its lowest value by more than `loss_rise` of its fall."""
    c = t.train
    if len(c.values) < 2:
        return None
    low, last = int(np.argmin(c.losses)), len(c.values) - 1
    rise = c.values[last] - c.values[low]
    if low == last or rise <= 0 or rise <= th.loss_rise * c.improvement:
        return None
    share = f", {percent(rise / c.improvement)} of its fall" if c.improvement > 0 else ""
    return make_verdict(
        "training_loss_rising",
        t.name,
        WARNING,
        f"{t.name}'s training loss rises: lowest {c.at(low)}, then {c.at(last)} (up {fmt(rise)}{share}): "
        "a learning rate too high for the late schedule, or a bug in the pipeline.",
        trial_name=t.name,
        low_step=c.steps[low],
        low_value=c.values[low],
        last_step=c.steps[last],
        last_value=c.values[last],
    )


# ----------------------------------------------------------------------------- per trial, per round

SHAPE_CHECKS = (
    did_not_learn,
    overfitting,
    late_noise,
    still_improving,
    saturated_early,
    training_loss_rising,
)
"""Read the whole curve: only for FINISHED trials (a diverged trial's curve is cut short)."""


def trial_verdicts(
    row: Mapping[str, Any], history: Sequence[Mapping[str, Any]], metric: str, mode: str, th: Curves
) -> list[Verdict]:
    """A FINISHED or DIVERGED trial's curve verdicts, in the order of `KINDS` (others: none)."""
    status = row.get("status")
    if status not in (TrialStatus.FINISHED, TrialStatus.DIVERGED):
        return []
    t = trial_curves(row, history, metric, mode)
    checks = (*(SHAPE_CHECKS if status == TrialStatus.FINISHED else ()), early_instability, clipping)
    return [v for check in checks if (v := check(t, th)) is not None]
