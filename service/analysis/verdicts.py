"""Playbook verdicts: the checks the Deep Learning Tuning Playbook asks for after every study,
computed from the study's trial rows and returned as values.

Each check returns `Verdict`s -- frozen, hashable, comparable -- and acts on nothing: whatever
prints the report, writes the log or decides about the next round reads them, in one place.
A verdict carries one plain English sentence with the numbers (`message`) and the same numbers
as structured `data`.

This module holds the `Verdict` type, the public helpers the checks share (`make_verdict`,
`as_number`, `range_position`, `numeric_choices`, and `percent` for the messages; a count
of trials is `core.formatting.trial_count`), the `best_step_position` check and
`study_verdicts`, which runs every check.
The other checks live one practice per module:

* `best_step_position` (here) -- "Never tune the max_train_steps number in a study ... plot the
  training step that retrospective checkpoint selection finds in order to refine the choice of
  max_train_steps": if the best step is in the first 10% of training, the maximum number of
  steps is way too high; if it is in the last 25%, we might benefit from training longer and
  re-tuning the decay schedule. Judged at the step where the trial first reached its best
  value (`first_best_step`): the best checkpoint is the latest of equal best values, and a
  plateau that began before the end is not "best at the end".
* `best_step_distribution` (here) -- the same rule across the trials of a round ("always",
  "consistently"): the fraction of trials, and of the top quarter, whose best step is early or
  late, and whether the first evaluation comes early enough to see an early one.
* `boundary` and `infeasible_region` (`service.analysis.search_space`) -- is the best point
  close to the boundary of the search space, and where does training stop being feasible.
* `enough_trials` (`service.analysis.enough_trials`) -- does the study's best result rest on
  the luck of one trial.

Which rows count: only FINISHED rows with a finite `best_metric` are results. DIVERGED rows
are the infeasible trials; FAILED (a crash says nothing about the hyperparameters), RUNNING and
PENDING rows are ignored. A hyperparameter's value is the row's ``hp/<name>`` column.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from service.core.formatting import fmt, trial_count
from service.core.ranking import first_best_step, ranked_results
from service.study.search import HParam

Severity = Literal["ok", "warning"]
OK: Severity = "ok"
WARNING: Severity = "warning"

EARLY_FRACTION = Fraction(1, 10)
"""A best step <= EARLY_FRACTION * max_train_steps is in the first 10% of training."""
LATE_FRACTION = Fraction(3, 4)
"""A best step > LATE_FRACTION * max_train_steps is in the last 25% of training."""


@dataclass(frozen=True)
class Verdict:
    """One finding about a study.

    `kind` names the check (the function that made it: ``best_step_position``, ``boundary``,
    ``infeasible_region``, ``enough_trials``); `subject` what it is about (a trial name, a
    hyperparameter name, or ``study``); `message` one sentence for a log or report; `data` the
    numbers behind it as (key, value) pairs, so that the verdict stays hashable (`facts` gives
    them as a dict)."""

    kind: str
    subject: str
    severity: Severity
    message: str
    data: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.severity not in (OK, WARNING):
            raise ValueError(f"severity must be 'ok' or 'warning' (got {self.severity!r})")

    @property
    def facts(self) -> dict[str, Any]:
        return dict(self.data)

    @property
    def is_warning(self) -> bool:
        return self.severity == WARNING


def make_verdict(kind: str, subject: str, severity: Severity, message: str, **data: Any) -> Verdict:
    """A `Verdict` whose `data` are the keyword arguments, in their order."""
    return Verdict(kind, subject, severity, message, tuple(data.items()))


# ----------------------------------------------------------------------------- rows


def as_number(x: Any) -> float | None:
    """`x` as a float if it is a finite real number (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def range_position(value: float, hp: HParam) -> float | None:
    """Where `value` lies in the range [hp.min, hp.max], as a fraction of the range measured in
    the dimension's own scale (log10 for scale log): 0 at the lower bound, 1 at the upper one,
    outside [0, 1] for a value outside the range. None for a one-point range or a value that has
    no logarithm."""
    lo, hi = float(hp.min), float(hp.max)
    if hp.scale == "log":
        if value <= 0 or lo <= 0:
            return None
        value, lo, hi = math.log10(value), math.log10(lo), math.log10(hi)
    if hi == lo:
        return None
    return (value - lo) / (hi - lo)


def numeric_choices(hp: HParam) -> list[Any] | None:
    """The distinct values of a choice dimension in increasing order, or None if any is not a
    number (strings and booleans have no order to widen along)."""
    values = hp.values or ()
    if not values or any(as_number(v) is None for v in values):
        return None
    return sorted(set(values), key=float)


def percent(x: float) -> str:
    """A fraction as a percentage with three significant digits (`0.125` -> `12.5%`)."""
    return f"{x * 100:.3g}%"


# ----------------------------------------------------------------------------- best step


def reached_best_step(
    row: Mapping[str, Any], history: Iterable[Mapping[str, Any]], metric: str, mode: str
) -> int | None:
    """The step at which the trial of `row` reached its best value: `first_best_step` of its
    metrics log when that is at or before the row's `best_step` (the log the row was made
    from), else the row's `best_step` (None without one). The one rule by which the best-step
    verdicts (`best_step_position`, `best_step_distribution`) and the training-curve verdicts
    (`curves.best_step`) judge whether the best is at the end of training."""
    step = as_number(row.get("best_step"))
    first = first_best_step(history, metric, mode)
    if first is not None and (step is None or first <= step):
        return first
    return None if step is None else int(step)


def judged_step(row: Mapping[str, Any], reached: Mapping[str, int] | None) -> Any:
    """The step whose place in training the best-step verdicts judge: the step at which the
    trial first reached its best value (`reached`, by trial name) when known, else its row's
    `best_step` (the best checkpoint, the latest of equal best values)."""
    return (reached or {}).get(str(row.get("trial_name")), row.get("best_step"))


def best_step_position(
    trial_name: str,
    best_step: int,
    max_train_steps: int,
    compute_bound: bool = False,
    reached_step: int | None = None,
) -> Verdict:
    """Where the best checkpoint of a trial falls in its training.

    Judged at `reached_step`, the step at which the trial first reached its best value, when
    given (a plateau: the checkpoint at `best_step` is the latest of equal best values), else
    at `best_step`. Exactly (in exact rational arithmetic, so that the boundaries do not depend
    on rounding):
    * ``step <= 0.10 * max_train_steps`` -- in the first 10%: warning, max_train_steps is
      probably too high;
    * ``step > 0.75 * max_train_steps`` -- in the last 25%: warning, train longer and
      retune the decay;
    * otherwise ok.
    So step 100 of 1000 is early, step 101 is not; step 750 of 1000 is not late, step 751 is.
    With `compute_bound`, a late best step is what a budget that sets the length gives: ok,
    and the message says a later, longer round is where training longer pays.
    Raises ValueError for max_train_steps <= 0, a best_step outside [0, max_train_steps] or a
    reached_step outside [0, best_step].
    """
    if max_train_steps <= 0:
        raise ValueError(f"max_train_steps must be > 0 (got {max_train_steps})")
    if not 0 <= best_step <= max_train_steps:
        raise ValueError(f"best_step must be in [0, {max_train_steps}] (got {best_step})")
    reached = best_step if reached_step is None else reached_step
    if not 0 <= reached <= best_step:
        raise ValueError(f"reached_step must be in [0, {best_step}] (got {reached_step})")
    step, total = _exact(reached), _exact(max_train_steps)
    position, fraction = _position(step, total), float(step / total)
    where = f"step {fmt(best_step)} of {fmt(max_train_steps)}"
    if reached != best_step:
        where += f", its best value first reached at step {fmt(reached)}"
    severity, message = _position_message(trial_name, where, position, fraction, compute_bound)
    return make_verdict(
        "best_step_position",
        trial_name,
        severity,
        message,
        position=position,
        trial_name=trial_name,
        best_step=best_step,
        reached_step=reached,
        max_train_steps=max_train_steps,
        fraction=fraction,
    )


def _position_message(
    trial_name: str, where: str, position: str, fraction: float, compute_bound: bool
) -> tuple[Severity, str]:
    """The severity and sentence of `best_step_position` for a best step at `where`."""
    best = f"The best checkpoint of {trial_name} is at {where}"
    if position == "early":
        return WARNING, (
            f"max_train_steps is probably too high (the best checkpoint of {trial_name} is at {where}, "
            "in the first 10% of training)."
        )
    if position == "late" and compute_bound:
        return OK, (
            f"{best}, in the last 25% of training, as expected when compute-bound: a later, longer round "
            "is where training longer pays."
        )
    if position == "late":
        return WARNING, f"{best}, in the last 25% of training: train longer and retune the decay."
    return OK, f"{best} ({percent(fraction)} of training), neither in the first 10% nor in the last 25%."


def _exact(x: float) -> Fraction:
    return Fraction(int(x)) if isinstance(x, numbers.Integral) else Fraction(float(x))


def _position(step: Fraction, total: Fraction) -> str:
    """`early` (first 10% of training), `late` (last 25%) or `middle`, in exact arithmetic."""
    if step <= EARLY_FRACTION * total:
        return "early"
    return "late" if step > LATE_FRACTION * total else "middle"


def step_position(step: Any, total: Any) -> str | None:
    """`early`, `late` or `middle` by the rule of `best_step_position`; None without numbers."""
    step, total = as_number(step), as_number(total)
    if step is None or total is None or total <= 0:
        return None
    return _position(_exact(step), _exact(total))


def early_is_visible(eval_every_steps: int, max_train_steps: int) -> bool:
    """Can a best checkpoint land in the first 10% of training? Only if an evaluation happens
    there: the first one is at step min(eval_every_steps, max_train_steps)."""
    return min(eval_every_steps, max_train_steps) <= EARLY_FRACTION * max_train_steps


def best_step_distribution(
    rows: Iterable[Mapping[str, Any]],
    mode: str,
    eval_every_steps: int | None = None,
    compute_bound: bool = False,
    reached: Mapping[str, int] | None = None,
) -> Verdict | None:
    """Where the best checkpoints of a round's trials fall: the playbook's rule is about the
    trials together ("if the best step is *always* in the first 10%", "*consistently* in the
    last 25%"), not about one trial.

    Over the results that have best_step and max_train_steps (each judged against its own
    max_train_steps, with the boundaries of `best_step_position`), and over their top quarter
    by metric (the ceil(n/4) best): the fraction early (first 10%) and late (last 25%).
    Warning when more than half of either group is early (max_train_steps too high), or late
    (train longer and retune the decay). With `compute_bound`, "late" is what a budget that
    sets the length gives: said, with severity ok (the next, longer round is the remedy).

    Each trial is judged at `judged_step`: the step at which it first reached its best value
    (`reached`, by trial name, from the metrics logs), else its row's best_step.

    With `eval_every_steps`, a trial whose first evaluation (step min(eval_every_steps,
    max_train_steps)) comes after the first 10% of its training cannot show an early best
    step; the message says so. No such results: None.
    """
    ranked = [
        r
        for r in ranked_results(rows, mode)
        if step_position(judged_step(r, reached), r.get("max_train_steps"))
    ]
    if not ranked:
        return None
    (n, early, late), (k, top_early, top_late) = (
        _places(ranked, reached),
        _places(ranked[: math.ceil(len(ranked) / 4)], reached),
    )
    text = _distribution_text(n, early, late, k, top_early, top_late)
    blind = _first_blind(ranked, eval_every_steps)
    if blind is not None:
        text += _blind_note(eval_every_steps, int(blind["max_train_steps"]))
    most_early = early * 2 > n or top_early * 2 > k
    most_late = late * 2 > n or top_late * 2 > k
    severity, advice = _distribution_advice(most_early, most_late, compute_bound)
    return make_verdict(
        "best_step_distribution",
        "study",
        severity,
        text + advice,
        num_trials=n,
        early=early,
        late=late,
        early_fraction=early / n,
        late_fraction=late / n,
        top_trials=k,
        top_early=top_early,
        top_late=top_late,
        early_visible=blind is None,
        compute_bound=compute_bound,
    )


def _distribution_text(n: int, early: int, late: int, k: int, top_early: int, top_late: int) -> str:
    return (
        f"Best checkpoint{'s' if n > 1 else ''} of the {trial_count(n)}: {early} ({percent(early / n)}) in "
        f"the first 10% of training, {late} ({percent(late / n)}) in the last 25%; of the top quarter "
        f"({trial_count(k)} by metric): {top_early} early, {top_late} late."
    )


def _places(rows: list[Mapping[str, Any]], reached: Mapping[str, int] | None) -> tuple[int, int, int]:
    """How many `rows`, and how many of them have their best step (`judged_step`) early and late."""
    places = [step_position(judged_step(r, reached), r["max_train_steps"]) for r in rows]
    return len(rows), places.count("early"), places.count("late")


def _first_blind(rows: list[Mapping[str, Any]], eval_every_steps: int | None) -> Mapping[str, Any] | None:
    """The first of `rows` whose first evaluation comes too late to see an early best step."""
    if eval_every_steps is None:
        return None
    return next((r for r in rows if not early_is_visible(eval_every_steps, int(r["max_train_steps"]))), None)


def _blind_note(eval_every_steps: int, total: int) -> str:
    """The sentence that says an early best step cannot be seen, and how to see it."""
    first = min(eval_every_steps, total)
    return (
        f" The first evaluation is at step {first} of {total} ({percent(first / total)}), after the first "
        "10%, so a best step there cannot be seen: evaluate every "
        f"{max(1, int(EARLY_FRACTION * total))} steps or fewer to see it."
    )


def _distribution_advice(most_early: bool, most_late: bool, compute_bound: bool) -> tuple[Severity, str]:
    """The severity of `best_step_distribution` and the advice that ends its message."""
    if most_early:
        return WARNING, " Most are early: max_train_steps is probably too high."
    if most_late and compute_bound:
        return OK, (
            " Most are late, as expected when compute-bound: the budget sets the length, and a later, "
            "longer round is where training longer pays."
        )
    if most_late:
        return WARNING, " Most are late: train longer and retune the decay."
    return OK, ""


# ----------------------------------------------------------------------------- all


def study_verdicts(
    rows: Iterable[Mapping[str, Any]],
    space: Mapping[str, HParam],
    mode: str,
    eval_every_steps: int | None = None,
    compute_bound: bool = False,
    reached: Mapping[str, int] | None = None,
) -> list[Verdict]:
    """All the checks with their defaults, in this order: `best_step_position` of the overall
    best result (when its row has best_step and max_train_steps), `best_step_distribution`
    over all results (given `eval_every_steps` and `compute_bound`), `boundary` (top_k=1),
    `infeasible_region`, `enough_trials` (seed 0). `reached`: the step at which each trial
    first reached its best value, by trial name (`reached_best_steps`), where the two best-step
    checks judge it."""
    from service.analysis.enough_trials import enough_trials
    from service.analysis.search_space import boundary, infeasible_region

    rows = list(rows)
    out: list[Verdict] = []
    ranked = ranked_results(rows, mode)
    if ranked:
        best = ranked[0]
        step, total = best.get("best_step"), best.get("max_train_steps")
        if step is not None and total is not None:
            name = str(best.get("trial_name"))
            at = (reached or {}).get(name)
            out.append(best_step_position(name, step, total, compute_bound, at))
    spread = best_step_distribution(rows, mode, eval_every_steps, compute_bound, reached)
    if spread is not None:
        out.append(spread)
    out.extend(boundary(rows, space, mode))
    out.extend(infeasible_region(rows, space))
    out.append(enough_trials(rows, mode))
    return out
