"""Playbook verdicts: the checks the Deep Learning Tuning Playbook asks for after every study,
computed from the study's trial rows and returned as values.

Each check returns `Verdict`s -- frozen, hashable, comparable -- and acts on nothing: whatever
prints the report, writes the log or decides about the next round reads them, in one place.
A verdict carries one plain English sentence with the numbers (`message`) and the same numbers
as structured `data`.

The checks, and the playbook's reasoning behind each:

* `best_step_position` -- "Never tune the max_train_steps number in a study ... plot the
  training step that retrospective checkpoint selection finds in order to refine the choice of
  max_train_steps": if the best step is in the first 10% of training, the maximum number of
  steps is way too high; if it is in the last 25%, we might benefit from training longer and
  re-tuning the decay schedule.
* `boundary` -- "A search space is suspicious if the best point sampled from it is close to its
  boundary. We might find an even better point if we expanded the search range in that
  direction." Closeness is measured in the scale the dimension is searched in (log10 for a log
  dimension): in [1e-4, 1] on a log scale, 0.04 sits at 65% of the range although it is at 4%
  of the linear one, and 0.9 sits at 99% although it is at 90% of the linear one.
* `infeasible_region` -- "If all trials are infeasible for learning rates greater than some
  threshold value, and if the best performing trials have learning rates at the edge of that
  region, the model may suffer from stability issues preventing it from accessing higher
  learning rates." Such a threshold is the edge of the feasible region, not of the search
  space: widening the search space beyond it only adds diverged trials.
* `enough_trials` -- the playbook simulates smaller tuning budgets by bootstrapping the trials
  of a study and shows how widely the best result spreads with few trials. The same bootstrap
  at the study's own size tells whether its best result rests on the luck of one trial.

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
from typing import Any, Literal, NamedTuple

import numpy as np

from service.spec import HParam

Severity = Literal["ok", "warning"]
OK: Severity = "ok"
WARNING: Severity = "warning"
MODES = ("min", "max")

EARLY_FRACTION = Fraction(1, 10)
"""A best step <= EARLY_FRACTION * max_train_steps is in the first 10% of training."""
LATE_FRACTION = Fraction(3, 4)
"""A best step > LATE_FRACTION * max_train_steps is in the last 25% of training."""
MIN_TRIALS = 5
"""Fewer finished trials than this always earn an `enough_trials` warning."""
RELATIVE_SPREAD = 0.25
"""Without a tolerance, the bootstrap best may spread over at most this fraction of the
10th-90th percentile range of all trial results."""
_BOOTSTRAP_CHUNK = 1_000_000  # indices drawn per chunk, to bound memory on large studies


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


def _verdict(kind: str, subject: str, severity: Severity, message: str, **data: Any) -> Verdict:
    return Verdict(kind, subject, severity, message, tuple(data.items()))


# ----------------------------------------------------------------------------- rows


def as_number(x: Any) -> float | None:
    """`x` as a float if it is a finite real number (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def results(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows that count as results: FINISHED with a finite best_metric."""
    return [r for r in rows if r.get("status") == "FINISHED" and as_number(r.get("best_metric")) is not None]


def ranked_results(rows: Iterable[Mapping[str, Any]], mode: str) -> list[Mapping[str, Any]]:
    """`results(rows)`, best first; ties go to the earlier trial name, so the order is stable."""
    sign = _sign(mode)
    return sorted(results(rows), key=lambda r: (sign * float(r["best_metric"]), str(r.get("trial_name"))))


def fmt(v: Any) -> str:
    """A value for a message: floats with 4 significant digits, everything else as str()."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return str(v)
    if isinstance(v, numbers.Integral):
        return str(int(v))
    return f"{float(v):.4g}"


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


def _sign(mode: str) -> float:
    if mode not in MODES:
        raise ValueError(f"mode must be 'min' or 'max' (got {mode!r})")
    return 1.0 if mode == "min" else -1.0


def _numeric_choices(hp: HParam) -> list[Any] | None:
    """The distinct values of a choice dimension in increasing order, or None if any is not a
    number (strings and booleans have no order to widen along)."""
    values = hp.values or ()
    if not values or any(as_number(v) is None for v in values):
        return None
    return sorted(set(values), key=float)


def _trials(n: int) -> str:
    return f"{n} trial" if n == 1 else f"{n} trials"


def _pct(x: float) -> str:
    return f"{x * 100:.3g}%"


# ----------------------------------------------------------------------------- best step


def best_step_position(trial_name: str, best_step: int, max_train_steps: int) -> Verdict:
    """Where the best checkpoint of a trial falls in its training.

    Exactly (in exact rational arithmetic, so that the boundaries do not depend on rounding):
    * ``best_step <= 0.10 * max_train_steps`` -- in the first 10%: warning, max_train_steps is
      probably too high;
    * ``best_step > 0.75 * max_train_steps`` -- in the last 25%: warning, train longer and
      retune the decay;
    * otherwise ok.
    So step 100 of 1000 is early, step 101 is not; step 750 of 1000 is not late, step 751 is.
    Raises ValueError for max_train_steps <= 0 or a best_step outside [0, max_train_steps].
    """
    if max_train_steps <= 0:
        raise ValueError(f"max_train_steps must be > 0 (got {max_train_steps})")
    if not 0 <= best_step <= max_train_steps:
        raise ValueError(f"best_step must be in [0, {max_train_steps}] (got {best_step})")
    step, total = _exact(best_step), _exact(max_train_steps)
    where = f"step {fmt(best_step)} of {fmt(max_train_steps)}"
    facts = dict(
        trial_name=trial_name,
        best_step=best_step,
        max_train_steps=max_train_steps,
        fraction=float(step / total),
    )
    if step <= EARLY_FRACTION * total:
        return _verdict(
            "best_step_position",
            trial_name,
            WARNING,
            f"max_train_steps is probably too high (the best checkpoint of {trial_name} is at {where}, "
            "in the first 10% of training).",
            position="early",
            **facts,
        )
    if step > LATE_FRACTION * total:
        return _verdict(
            "best_step_position",
            trial_name,
            WARNING,
            f"The best checkpoint of {trial_name} is at {where}, in the last 25% of training: "
            "train longer and retune the decay.",
            position="late",
            **facts,
        )
    return _verdict(
        "best_step_position",
        trial_name,
        OK,
        f"The best checkpoint of {trial_name} is at {where} ({_pct(facts['fraction'])} of training), "
        "neither in the first 10% nor in the last 25%.",
        position="middle",
        **facts,
    )


def _exact(x: float) -> Fraction:
    return Fraction(int(x)) if isinstance(x, numbers.Integral) else Fraction(float(x))


# ----------------------------------------------------------------------------- boundary


class _Placed(NamedTuple):
    rank: int
    trial_name: str
    value: float
    position: float


def boundary(
    rows: Iterable[Mapping[str, Any]],
    space: Mapping[str, HParam],
    mode: str,
    top_k: int = 1,
    margin: float = 0.05,
) -> list[Verdict]:
    """Is the best trial (or any of the `top_k` best) close to a bound of the search space?

    For each searched float/int dimension, in the order of `space`: a trial is within `margin`
    of the lower bound when its `range_position` is <= margin, of the upper bound when it is
    >= 1 - margin (positions in log10 space for scale log). Each side touched gives a warning
    naming the top-k trial closest to that bound (so a dimension may get two); a dimension
    with neither gets one ok verdict.

    For a choice dimension whose values are all numbers, the values are ordered by size (not
    by their order in the study file): a top-k trial at the smallest or the largest value gets
    a warning. Choice dimensions with a non-numeric value or fewer than two distinct values get
    no verdict, nor do dimensions none of the top-k trials has a value for, nor one-point
    ranges. No results, no verdicts.
    """
    _sign(mode)  # validates mode
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1 (got {top_k})")
    if not 0 <= margin < 0.5:
        raise ValueError(f"margin must be in [0, 0.5) (got {margin})")
    top = ranked_results(rows, mode)[:top_k]
    out: list[Verdict] = []
    for name, hp in space.items():
        if not hp.searched:
            continue
        if hp.type == "choice":
            out.extend(_choice_boundary(name, hp, top))
        else:
            out.extend(_range_boundary(name, hp, top, margin))
    return out


def _who(p: _Placed, k: int) -> str:
    if p.rank == 1:
        return f"the best trial {p.trial_name}"
    return f"{p.trial_name} (number {p.rank} of the {k} best trials)"


def _range_boundary(name: str, hp: HParam, top: list[Mapping[str, Any]], margin: float) -> list[Verdict]:
    placed = []
    for rank, row in enumerate(top, 1):
        value = as_number(row.get(f"hp/{name}"))
        pos = None if value is None else range_position(value, hp)
        if pos is not None:
            placed.append(_Placed(rank, str(row.get("trial_name")), value, pos))
    if not placed:
        return []
    lo, hi = float(hp.min), float(hp.max)
    scale = "log-scale" if hp.scale == "log" else "linear"
    span = f"the {scale} range [{fmt(lo)}, {fmt(hi)}]"
    out = []
    lower = [p for p in placed if p.position <= margin]
    upper = [p for p in placed if p.position >= 1 - margin]
    for side, near, bound, word in (
        ("lower", min(lower, key=lambda p: (p.position, p.rank), default=None), lo, "below"),
        ("upper", max(upper, key=lambda p: (p.position, -p.rank), default=None), hi, "above"),
    ):
        if near is None:
            continue
        out.append(
            _verdict(
                "boundary",
                name,
                WARNING,
                f"{name} of {_who(near, len(top))} is {fmt(near.value)}, at {_pct(near.position)} of {span} "
                f"(within {_pct(margin)} of the {side} bound {fmt(bound)}): "
                f"widen the search space {word} {fmt(bound)}.",
                side=side,
                trial_name=near.trial_name,
                rank=near.rank,
                value=near.value,
                bound=bound,
                position=near.position,
                scale=hp.scale,
                margin=margin,
            )
        )
    if out:
        return out
    if len(placed) == 1:
        (p,) = placed
        where = f"{name} of the best trial {p.trial_name} is {fmt(p.value)}, at {_pct(p.position)} of {span}"
    else:
        first, last = min(p.position for p in placed), max(p.position for p in placed)
        where = (
            f"{name} of the {len(placed)} best trials lies between {_pct(first)} and {_pct(last)} of {span}"
        )
    return [
        _verdict(
            "boundary",
            name,
            OK,
            f"{where}, more than {_pct(margin)} away from both bounds.",
            trial_names=tuple(p.trial_name for p in placed),
            positions=tuple(p.position for p in placed),
            scale=hp.scale,
            margin=margin,
        )
    ]


def _choice_boundary(name: str, hp: HParam, top: list[Mapping[str, Any]]) -> list[Verdict]:
    ordered = _numeric_choices(hp)
    if ordered is None or len(ordered) < 2:
        return []
    smallest, largest = float(ordered[0]), float(ordered[-1])
    placed = []
    for rank, row in enumerate(top, 1):
        value = as_number(row.get(f"hp/{name}"))
        if value is not None:
            position = (value - smallest) / (largest - smallest)
            placed.append(_Placed(rank, str(row.get("trial_name")), value, position))
    if not placed:
        return []
    choices = "[" + ", ".join(fmt(v) for v in ordered) + "]"
    out = []
    for side, edge, word, extreme in (
        ("lower", ordered[0], "below", "smallest"),
        ("upper", ordered[-1], "above", "largest"),
    ):
        hits = [p for p in placed if (p.value <= smallest if side == "lower" else p.value >= largest)]
        if not hits:
            continue
        near = hits[0]  # the best-ranked trial at that edge
        out.append(
            _verdict(
                "boundary",
                name,
                WARNING,
                f"{name} of {_who(near, len(top))} is {fmt(edge)}, the {extreme} of the choices {choices}: "
                f"widen the search space {word} {fmt(edge)}.",
                side=side,
                trial_name=near.trial_name,
                rank=near.rank,
                value=edge,
                bound=edge,
                choices=tuple(ordered),
            )
        )
    if out:
        return out
    if len(placed) == 1:
        where = f"{name} of the best trial {placed[0].trial_name} is {fmt(placed[0].value)}"
    else:
        where = f"{name} of the {len(placed)} best trials is one of " + ", ".join(
            fmt(p.value) for p in placed
        )
    return [
        _verdict(
            "boundary",
            name,
            OK,
            f"{where}, inside the choices {choices} (neither the smallest nor the largest).",
            trial_names=tuple(p.trial_name for p in placed),
            values=tuple(p.value for p in placed),
            choices=tuple(ordered),
        )
    ]


# ----------------------------------------------------------------------------- infeasible region


def infeasible_region(rows: Iterable[Mapping[str, Any]], space: Mapping[str, HParam]) -> list[Verdict]:
    """Where, along each searched numeric dimension, does training stop being feasible?

    For each searched float/int dimension and each choice dimension of numbers, in the order of
    `space`, over the DIVERGED rows and the results (FINISHED with a finite metric; other rows
    are ignored):

    * upper threshold: the smallest value v of a diverged trial such that every trial with a
      value >= v diverged, provided some trial below v did not. Equivalently, the smallest
      diverged value above the largest value that did not diverge. Warning: "every trial with
      <name> >= v diverged (k trials); the feasible region ends below it".
    * lower threshold, symmetrically: the largest diverged value below the smallest value that
      did not diverge; "every trial with <name> <= v diverged ...".

    A dimension with neither threshold gets one ok verdict (no divergence, or divergence
    scattered among feasible trials). A dimension where every trial diverged gets a warning
    with side "all": there is no feasible region to bound. No trials with a value, no verdict.
    """
    out: list[Verdict] = []
    all_rows = list(rows)
    for name, hp in space.items():
        if not hp.searched or (hp.type == "choice" and _numeric_choices(hp) is None):
            continue
        diverged: list[float] = []
        feasible: list[float] = []
        for row in all_rows:
            value = as_number(row.get(f"hp/{name}"))
            if value is None:
                continue
            if row.get("status") == "DIVERGED":
                diverged.append(value)
            elif row.get("status") == "FINISHED" and as_number(row.get("best_metric")) is not None:
                feasible.append(value)
        if not diverged and not feasible:
            continue
        if not feasible:
            out.append(
                _verdict(
                    "infeasible_region",
                    name,
                    WARNING,
                    f"All {_trials(len(diverged))} with a value of {name} diverged, "
                    f"from {fmt(min(diverged))} to {fmt(max(diverged))}: no feasible region was found.",
                    side="all",
                    num_diverged=len(diverged),
                    num_trials=len(diverged),
                )
            )
            continue
        found = []
        top_ok, bottom_ok = max(feasible), min(feasible)
        above = [v for v in diverged if v > top_ok]
        if above:
            threshold = min(above)
            found.append(
                _verdict(
                    "infeasible_region",
                    name,
                    WARNING,
                    f"Every trial with {name} >= {fmt(threshold)} diverged ({_trials(len(above))}); "
                    f"the feasible region ends below it (the largest {name} that trained without "
                    f"diverging is {fmt(top_ok)}).",
                    side="upper",
                    threshold=threshold,
                    num_diverged=len(above),
                    last_feasible=top_ok,
                )
            )
        below = [v for v in diverged if v < bottom_ok]
        if below:
            threshold = max(below)
            found.append(
                _verdict(
                    "infeasible_region",
                    name,
                    WARNING,
                    f"Every trial with {name} <= {fmt(threshold)} diverged ({_trials(len(below))}); "
                    f"the feasible region ends above it (the smallest {name} that trained without "
                    f"diverging is {fmt(bottom_ok)}).",
                    side="lower",
                    threshold=threshold,
                    num_diverged=len(below),
                    last_feasible=bottom_ok,
                )
            )
        if found:
            out.extend(found)
            continue
        total = len(diverged) + len(feasible)
        if diverged:
            message = (
                f"{len(diverged)} of {total} trials diverged, but there is no value of {name} "
                "beyond which every trial diverged."
            )
        else:
            message = f"None of the {total} trials diverged along {name}."
        out.append(
            _verdict("infeasible_region", name, OK, message, num_diverged=len(diverged), num_trials=total)
        )
    return out


# ----------------------------------------------------------------------------- enough trials


def enough_trials(
    rows: Iterable[Mapping[str, Any]],
    mode: str,
    num_bootstrap: int = 2000,
    seed: int = 0,
    tolerance: float | None = None,
) -> Verdict:
    """Would the study's best result survive a different draw of its trials?

    Bootstrap: `num_bootstrap` resamples of the n results' best metrics (with replacement, n
    each, from ``numpy.random.default_rng(seed)``, so deterministic for a seed); the best of
    each resample is the "bootstrap best". Reported:

    * the 10th and 90th percentiles of the bootstrap best (numpy's linear interpolation) and
      their distance, the *spread*;
    * the probability that a resample reaches the observed best: the fraction of resamples
      whose best is within `tolerance` of it (exactly equal when tolerance is None).

    Warning when n < 5 (MIN_TRIALS), or when the spread exceeds the allowed spread: `tolerance`
    if given (e.g. the retrain variance of the metric: a study whose luck moves the best by more
    than a retrain does is too small), else 0.25 times the 10th-90th percentile range of the n
    results themselves. No results: a warning.
    """
    sign = _sign(mode)
    if num_bootstrap < 1:
        raise ValueError(f"num_bootstrap must be >= 1 (got {num_bootstrap})")
    if tolerance is not None and not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0 (got {tolerance})")
    metrics = np.array([float(r["best_metric"]) for r in ranked_results(rows, mode)])
    n = int(metrics.size)
    if n == 0:
        return _verdict(
            "enough_trials",
            "study",
            WARNING,
            "No finished trial has a finite metric yet, so the study has no result to judge.",
            num_trials=0,
        )
    observed = float(metrics[0])
    boot = _bootstrap_best(sign * metrics, num_bootstrap, seed) * sign
    b10, b90 = (float(x) for x in np.percentile(boot, [10, 90]))
    r10, r90 = (float(x) for x in np.percentile(metrics, [10, 90]))
    spread = b90 - b10
    reach = float(np.mean(np.abs(boot - observed) <= (tolerance or 0.0)))
    if tolerance is None:
        allowed = RELATIVE_SPREAD * (r90 - r10)
        why = "a quarter of the 10th-90th percentile range of all results"
    else:
        allowed = float(tolerance)
        why = "the tolerance"
    stats = (
        f"over {num_bootstrap} bootstrap resamples of the {n} finished {'trial' if n == 1 else 'trials'}, "
        f"the best result spans "
        f"{fmt(b10)} to {fmt(b90)} (10th-90th percentile, spread {fmt(spread)} against "
        f"{fmt(allowed)} allowed, {why}) and {_pct(reach)} of resamples reach the observed best "
        f"{fmt(observed)}"
    )
    facts = dict(
        num_trials=n,
        num_bootstrap=num_bootstrap,
        seed=seed,
        tolerance=tolerance,
        observed_best=observed,
        bootstrap_p10=b10,
        bootstrap_p90=b90,
        spread=spread,
        results_p10=r10,
        results_p90=r90,
        allowed_spread=allowed,
        p_reach=reach,
    )
    if n < MIN_TRIALS:
        message = f"Only {_trials(n)} finished (fewer than {MIN_TRIALS}), too few to trust the best: {stats}."
        return _verdict("enough_trials", "study", WARNING, message, reason="few_trials", **facts)
    if spread > allowed:
        message = f"The best result depends on which trials happened to be drawn: {stats}; run more trials."
        return _verdict("enough_trials", "study", WARNING, message, reason="wide_spread", **facts)
    return _verdict("enough_trials", "study", OK, f"Enough trials: {stats}.", reason="", **facts)


def _bootstrap_best(scores: np.ndarray, num_bootstrap: int, seed: int) -> np.ndarray:
    """The minimum of each of `num_bootstrap` resamples of `scores` (lower is better)."""
    rng = np.random.default_rng(seed)
    n = scores.size
    per_chunk = max(1, _BOOTSTRAP_CHUNK // n)
    best = np.empty(num_bootstrap)
    for start in range(0, num_bootstrap, per_chunk):
        stop = min(start + per_chunk, num_bootstrap)
        best[start:stop] = scores[rng.integers(0, n, size=(stop - start, n))].min(axis=1)
    return best


# ----------------------------------------------------------------------------- all


def study_verdicts(
    rows: Iterable[Mapping[str, Any]], space: Mapping[str, HParam], mode: str
) -> list[Verdict]:
    """All the checks with their defaults, in this order: `best_step_position` of the overall
    best result (when its row has best_step and max_train_steps), `boundary` (top_k=1),
    `infeasible_region`, `enough_trials` (seed 0)."""
    rows = list(rows)
    out: list[Verdict] = []
    ranked = ranked_results(rows, mode)
    if ranked:
        best = ranked[0]
        step, total = best.get("best_step"), best.get("max_train_steps")
        if step is not None and total is not None:
            out.append(best_step_position(str(best.get("trial_name")), step, total))
    out.extend(boundary(rows, space, mode))
    out.extend(infeasible_region(rows, space))
    out.append(enough_trials(rows, mode))
    return out
