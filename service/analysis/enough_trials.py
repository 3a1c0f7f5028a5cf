"""Playbook verdict on the size of a study: would its best result survive a different draw of
its trials?

The playbook simulates smaller tuning budgets by bootstrapping the trials of a study and shows
how widely the best result spreads with few trials. The same bootstrap at the study's own size
tells whether its best result rests on the luck of one trial.

Which rows count is as in `service.analysis.verdicts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from service.analysis.verdicts import (
    OK,
    WARNING,
    Verdict,
    make_verdict,
    percent,
    trial_count,
)
from service.core import ranking
from service.core.formatting import fmt
from service.core.ranking import ranked_results

MIN_TRIALS = 5
"""Fewer finished trials than this always earn an `enough_trials` warning."""
RELATIVE_SPREAD = 0.25
"""Without a tolerance, the bootstrap best may spread over at most this fraction of the
10th-90th percentile range of all trial results."""
_BOOTSTRAP_CHUNK = 1_000_000  # indices drawn per chunk, to bound memory on large studies


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
    sign = ranking.sign(mode)
    if num_bootstrap < 1:
        raise ValueError(f"num_bootstrap must be >= 1 (got {num_bootstrap})")
    if tolerance is not None and not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0 (got {tolerance})")
    metrics = np.array([float(r["best_metric"]) for r in ranked_results(rows, mode)])
    if metrics.size == 0:
        return make_verdict(
            "enough_trials",
            "study",
            WARNING,
            "No finished trial has a finite metric yet, so the study has no result to judge.",
            num_trials=0,
        )
    facts = _bootstrap_facts(metrics, sign, num_bootstrap, seed, tolerance)
    n, stats = facts["num_trials"], _bootstrap_sentence(facts)
    if n < MIN_TRIALS:
        message = (
            f"Only {trial_count(n)} finished (fewer than {MIN_TRIALS}), too few to trust the best: {stats}."
        )
        return make_verdict("enough_trials", "study", WARNING, message, reason="few_trials", **facts)
    if facts["spread"] > facts["allowed_spread"]:
        message = f"The best result depends on which trials happened to be drawn: {stats}; run more trials."
        return make_verdict("enough_trials", "study", WARNING, message, reason="wide_spread", **facts)
    return make_verdict("enough_trials", "study", OK, f"Enough trials: {stats}.", reason="", **facts)


def _bootstrap_facts(
    metrics: np.ndarray, sign: int, num_bootstrap: int, seed: int, tolerance: float | None
) -> dict[str, Any]:
    """The numbers behind `enough_trials`, in the order its verdict's data lists them, from the
    results' best metrics (best first)."""
    observed = float(metrics[0])
    boot = _bootstrap_best(sign * metrics, num_bootstrap, seed) * sign
    b10, b90 = (float(x) for x in np.percentile(boot, [10, 90]))
    r10, r90 = (float(x) for x in np.percentile(metrics, [10, 90]))
    return dict(
        num_trials=int(metrics.size),
        num_bootstrap=num_bootstrap,
        seed=seed,
        tolerance=tolerance,
        observed_best=observed,
        bootstrap_p10=b10,
        bootstrap_p90=b90,
        spread=b90 - b10,
        results_p10=r10,
        results_p90=r90,
        allowed_spread=RELATIVE_SPREAD * (r90 - r10) if tolerance is None else float(tolerance),
        p_reach=float(np.mean(np.abs(boot - observed) <= (tolerance or 0.0))),
    )


def _bootstrap_sentence(facts: Mapping[str, Any]) -> str:
    """What the bootstrap found, as the clause every `enough_trials` message ends with."""
    n = facts["num_trials"]
    if facts["tolerance"] is None:
        why = "a quarter of the 10th-90th percentile range of all results"
    else:
        why = "the tolerance"
    return (
        f"over {facts['num_bootstrap']} bootstrap resamples of the {n} finished "
        f"{'trial' if n == 1 else 'trials'}, the best result spans {fmt(facts['bootstrap_p10'])} to "
        f"{fmt(facts['bootstrap_p90'])} (10th-90th percentile, spread {fmt(facts['spread'])} against "
        f"{fmt(facts['allowed_spread'])} allowed, {why}) and {percent(facts['p_reach'])} of resamples "
        f"reach the observed best {fmt(facts['observed_best'])}"
    )


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
