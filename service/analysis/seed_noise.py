"""A repeat round's verdict: is the difference between scientific values more than seed noise?

The repeat round reruns the best trial of each scientific value with other seeds. The two
values with the best mean result are compared by Welch's t-test over their repeats (unequal
variances; two-sided; the t distribution's tail integrated numerically with numpy, no scipy):
p < ALPHA says the difference exceeds seed noise. When every repeat of both values scored the
same (no seed noise at all: a rate metric at 0 on every seed, say), there is nothing to test:
equal results are no difference, unequal ones a difference of known sign. With one value, the
sentence gives the seed spread alone."""

from __future__ import annotations

import math

import numpy as np

from service.core.formatting import fmt
from service.core.ranking import results, sign
from service.study.search import HParam

ALPHA = 0.05


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(t, degrees of freedom, two-sided p) of Welch's t-test of mean(a) == mean(b)."""
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return float(t), float(df), t_two_sided_p(float(t), float(df))


def t_two_sided_p(t: float, df: float, points: int = 200_001) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom: 1 - 2 * the density's
    integral over [0, |t|] (trapezoids on `points` points, in log-density for large df)."""
    x = np.linspace(0.0, abs(t), points)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    return float(max(0.0, 1.0 - 2.0 * np.trapezoid(density, x)))


def groups_by_scientific(
    rows: list[dict], space: dict[str, HParam], mode: str
) -> list[tuple[str, list[float]]]:
    """(the value's label, its results) for each scientific value, the best mean first."""
    names = [k for k, hp in space.items() if hp.role == "scientific"]
    groups: dict[str, list[float]] = {}
    for row in sorted(results(rows), key=lambda r: r["trial_name"]):
        label = ", ".join(f"{k}={fmt(row.get(f'hp/{k}'))}" for k in names) or "the best configuration"
        groups.setdefault(label, []).append(float(row["best_metric"]))
    return sorted(groups.items(), key=lambda g: sign(mode) * float(np.mean(g[1])))


def repeat_sentence(rows: list[dict], space: dict[str, HParam], metric: str, mode: str) -> str:
    groups = groups_by_scientific(rows, space, mode)
    if not groups:
        return ""
    parts = [f"{label}: {describe(values, metric)}" for label, values in groups]
    first, second = groups[0], groups[1] if len(groups) > 1 else None
    if second is None:
        return f"Seed repeats of {parts[0]}."
    if min(len(first[1]), len(second[1])) < 2:
        return f"Seed repeats: {'; '.join(parts)}. Too few finished repeats to compare (2 per value needed)."
    verdict = compare(first, second, metric)
    return f"Seed repeats: {'; '.join(parts)}. {first[0]} against {second[0]}: {verdict}."


def compare(first: tuple[str, list[float]], second: tuple[str, list[float]], metric: str) -> str:
    """The verdict on two values' repeats (`first` has the better mean): Welch's test, or, when
    neither value's result moved with the seed, the exact difference (0/0 is no t statistic)."""
    (label, best), (_, other) = first, second
    if np.ptp(best) == 0 and np.ptp(other) == 0:
        if best[0] == other[0]:
            return f"every seed of both gave {metric} {fmt(best[0])}: no difference (no seed noise)"
        return (
            f"every seed of each gave the same {metric}, {label} better by exactly "
            f"{fmt(abs(best[0] - other[0]))}: a difference (no seed noise to weigh it against)"
        )
    t, df, p = welch(best, other)
    verdict = "exceeds seed noise" if p < ALPHA else "is within seed noise"
    return (
        f"Welch's t = {fmt(t)}, df = {fmt(df)}, p = {fmt(p)}: the difference {verdict} "
        f"(p {'<' if p < ALPHA else '>='} {ALPHA})"
    )


def describe(values: list[float], metric: str) -> str:
    spread = f" ± {fmt(float(np.std(values, ddof=1)))}" if len(values) > 1 else ""
    return f"{metric} {fmt(float(np.mean(values)))}{spread} over {len(values)} seeds"
