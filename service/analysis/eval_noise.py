"""Playbook verdict on the periodic-eval sample: is it big enough to rank the trials?

The playbook (choosing the periodic-eval sample): the sample must be small enough to evaluate
often, and big enough to measure the model's improvements accurately -- the measurement must
not be drowned by noise. With `training.validation_sample_size`, every ranked metric is the
sample's, and the sample's own noise is its standard error: the per-example standard deviation
of the metric over sqrt(n). When that is larger than the gap between the best trial and the
next one, the sample cannot tell them apart, and the round's "best" is a draw of the sample.

Which rows count is as in `service.analysis.verdicts`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from service.analysis.verdicts import OK, WARNING, Verdict, make_verdict
from service.core.formatting import fmt, trial_count
from service.core.ranking import ranked_results

RATE_METRICS = ("error", "accuracy")
"""Metric names (after `validation/`) taken to be means of 0/1 per-example values: without saved
predictions, their standard error is the binomial sqrt(p (1 - p) / n)."""


def standard_error(values: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Standard error of the weighted mean of per-example `values` (the eval's metric):
    sqrt(n / (n - 1) * sum(w^2 (x - m)^2)) / sum(w), m the weighted mean; with unit weights
    that is the sample standard deviation (ddof=1) over sqrt(n). NaN for fewer than 2 values."""
    x = np.asarray(values, dtype=np.float64).ravel()
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    n = x.size
    if n < 2 or w.sum() <= 0:
        return math.nan
    mean = float((w * x).sum() / w.sum())
    return math.sqrt(n / (n - 1) * float((w * w * (x - mean) ** 2).sum())) / float(w.sum())


def rate_standard_error(p: float, n: int) -> float:
    """Standard error of a rate (a mean of 0/1 per-example values, such as an error rate) p
    measured on n examples: sqrt(p (1 - p) / n). At most 0.5 / sqrt(n), at p = 0.5."""
    return math.sqrt(max(0.0, p * (1 - p)) / n)


def rate_noise(p: float, n: int) -> float:
    """The largest change of a rate p measured on n examples that the measurement cannot tell
    from noise: its binomial standard error sqrt(p (1 - p) / n), and at least one example's
    worth, 1 / n (the resolution: a rate over n examples moves in steps of 1 / n)."""
    return max(1 / n, rate_standard_error(p, n))


def eval_noise(
    rows: Iterable[Mapping[str, Any]],
    mode: str,
    metric: str,
    sample_size: int,
    se: float,
    source: str,
) -> Verdict | None:
    """Is the standard error `se` of `metric` on the eval sample of `sample_size` examples
    smaller than the gap between the best result and the next one?

    Warning when se > |best - next|, or when they tie (gap 0: the sample does not separate them,
    whatever its standard error -- 0 for a trial without a single error); the message counts the
    other results within one standard error of the best and how many examples would bring the
    standard error down to that gap (se scales as 1/sqrt(n): n * (se / gap)^2). `source` says
    where se comes from. Fewer than 2 results, or a se that is not finite: None.
    """
    ranked = ranked_results(rows, mode)
    if len(ranked) < 2 or not math.isfinite(se):
        return None
    best, nxt = ranked[0], ranked[1]
    b = float(best["best_metric"])
    gap = abs(float(nxt["best_metric"]) - b)
    within = sum(1 for r in ranked[1:] if abs(float(r["best_metric"]) - b) <= se)
    facts = dict(
        sample_size=sample_size,
        se=se,
        gap=gap,
        best_trial=best.get("trial_name"),
        next_trial=nxt.get("trial_name"),
        num_within_se=within,
        num_trials=len(ranked),
    )
    measured = (
        f"On the validation sample of {sample_size} examples, {metric} has a standard error of {fmt(se)} "
        f"({source})"
    )
    pair = (
        f"the gap {fmt(gap)} between the best trial {best.get('trial_name')} ({fmt(b)}) and the next, "
        f"{nxt.get('trial_name')} ({fmt(float(nxt['best_metric']))})"
    )
    if se <= gap and gap > 0:
        return make_verdict("eval_noise", "study", OK, f"{measured}, no larger than {pair}.", **facts)
    if gap > 0:
        needed = (
            f"about {math.ceil(sample_size * (se / gap) ** 2)} examples would bring the standard error "
            "down to that gap"
        )
    else:
        needed = "a tie: no sample size separates them"
    return make_verdict(
        "eval_noise",
        "study",
        WARNING,
        f"{measured}, larger than {pair}: {within} of the other {trial_count(len(ranked) - 1)} are within "
        f"one standard error of the best, so the sample cannot rank them ({needed}). "
        "Raise training.validation_sample_size: big enough to beat the noise, small enough to "
        "evaluate often.",
        **facts,
    )
