"""The scientific comparison: each value of the scientific hyperparameters, with the nuisance
hyperparameters optimised away.

The playbook separates a study's hyperparameters into scientific ones (what the experiment
measures the effect of), nuisance ones (which must be tuned for the comparison to be fair,
because their best values depend on the scientific ones) and fixed ones. Scientific values are
compared by "the performance of the *best* trial across some (or all) of the nuisance
hyperparameters" -- the points of the playbook's isolation plot: comparing one trial per
scientific value, or an average over nuisance settings, would compare how well each value
happened to be tuned rather than the values themselves.

Only results count (FINISHED rows with a finite best_metric, see
`service.core.ranking.results`); a group's `num_trials` is its number of results, the
tuning budget that went into its best.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from service.core.formatting import fmt
from service.core.ranking import ranked_results
from service.study.search import HParam


def best_per_scientific(
    rows: Iterable[Mapping[str, Any]], space: Mapping[str, HParam], mode: str
) -> list[dict[str, Any]]:
    """The best result for each combination of scientific hyperparameter values.

    Rows are grouped by the tuple of their ``hp/<name>`` values over the scientific
    dimensions of `space` (in the order of `space`), compared by exact equality -- also for
    float dimensions: 0.1 and 0.1000001 are two groups, so a float scientific dimension sampled
    from a continuous range gives one group per trial; make it a choice (or bucket the values
    before calling) to compare it. 32 and 32.0 are one group (Python equality). A row without a
    value for a scientific dimension is grouped under None for it, visibly, rather than dropped.
    With no scientific dimension, all results form one group whose "scientific" is {}.

    Returns one dict per group, {"scientific": {name: value}, "best_metric": float,
    "trial_name": str (the group's best trial), "num_trials": int}, best group first (ties go
    to the group whose best trial has the earlier name). Raises ValueError for an unknown mode.
    """
    names = [name for name, hp in space.items() if hp.role == "scientific"]
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in ranked_results(rows, mode):  # best first, so a group's first row is its best
        key = tuple(row.get(f"hp/{name}") for name in names)
        group = groups.get(key)
        if group is None:
            groups[key] = {
                "scientific": dict(zip(names, key, strict=True)),
                "best_metric": float(row["best_metric"]),
                "trial_name": row.get("trial_name"),
                "num_trials": 1,
            }
        else:
            group["num_trials"] += 1
    return list(groups.values())  # insertion order follows the ranking of each group's best


def summary_sentence(groups: list[dict[str, Any]], metric: str) -> str:
    """One sentence comparing the groups of `best_per_scientific` (in their order, best first):
    e.g. "width=32 is best (validation/error 0.021, best of 6 trials over the nuisance
    hyperparameters); width=16: 0.034 (5 trials)"."""
    if not groups:
        return f"No finished trial has a finite {metric} yet."
    first, rest = groups[0], groups[1:]
    n = first["num_trials"]
    budget = f"best of {n} trial{'s' if n != 1 else ''} over the nuisance hyperparameters"
    if not first["scientific"]:
        return f"The best trial is {first['trial_name']} ({metric} {fmt(first['best_metric'])}, {budget})"
    parts = [f"{_label(first)} is best ({metric} {fmt(first['best_metric'])}, {budget})"]
    for g in rest:
        n = g["num_trials"]
        parts.append(f"{_label(g)}: {fmt(g['best_metric'])} ({n} trial{'s' if n != 1 else ''})")
    return "; ".join(parts)


def _label(group: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={fmt(value)}" for name, value in group["scientific"].items())
