"""The points of the playbook's isolation plot: for each value of a scientific hyperparameter,
the best result over the nuisance hyperparameters, with the spread over seeds where a
`kind: repeat` round reran that best.

One series per round that is not a repeat round: trials of different rounds ran for different
numbers of steps (an extend round trains longer), so a round's trials are compared only with
each other. A point's value is the best of the round's results with that value (FINISHED with a
finite best_metric, see `service.core.ranking.results`), over every other hyperparameter --
the nuisance ones and, in a study with several scientific ones, the others (each is then a
plot of its own); a tie goes to the earlier trial name. Diverged trials have no result: they
are left out of the best and counted per point.

A point's seed spread is that of the repeat rounds' trials that reran the point's best trial
(their `repeat_of`): `plan_repeat` reruns the best trial of each combination of scientific
values, so with one scientific hyperparameter every value's best is repeated. The spread is of
the repeats alone (the best itself was picked as the best of several, so it sits low against
its own seed noise), the same values `seed_noise` compares with Welch's test.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.ranking import is_finite, ranked_results, results
from service.core.trial_status import TrialStatus
from service.study.search import HParam
from service.study.spec import Study


@dataclass(frozen=True)
class Spread:
    """The finished repeats of one trial: their results, the mean, the sample standard deviation
    (ddof=1; nan with one repeat), the extremes, and how many repeats diverged."""

    round: str
    values: tuple[float, ...]
    diverged: int

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan

    @property
    def std(self) -> float:
        return float(np.std(self.values, ddof=1)) if self.n > 1 else math.nan

    @property
    def min(self) -> float:
        return min(self.values, default=math.nan)

    @property
    def max(self) -> float:
        return max(self.values, default=math.nan)


@dataclass(frozen=True)
class Point:
    """One scientific value in one round: its best result (None when every trial with the value
    diverged), the best trial, how many results and diverged trials it had, its repeats."""

    value: Any
    best_metric: float | None
    trial_name: str | None
    num_results: int
    num_diverged: int
    repeats: Spread | None


@dataclass(frozen=True)
class Series:
    """One round's points for one scientific hyperparameter, in the order of its values."""

    round: str
    points: tuple[Point, ...]


def isolation(study: Study, rows: list[Mapping[str, Any]]) -> dict[str, list[Series]]:
    """For each hyperparameter scientific in some round's space (`Study.compared_space`), one
    series per round that is not a repeat round, has it as scientific and has a row with a value
    for it (in the study's round order)."""
    repeat_rounds = {r.name for r in study.rounds if r.kind == "repeat"}
    rows = list(rows)
    repeats: dict[str, list[Mapping]] = {}  # the repeat rounds' rows by the trial they rerun
    for r in sorted(rows, key=lambda r: str(r.get("trial_name"))):
        if r.get("round") in repeat_rounds and r.get("repeat_of") is not None:
            repeats.setdefault(r["repeat_of"], []).append(r)
    out: dict[str, list[Series]] = {}
    spaces = {rnd.name: study.compared_space(rnd) for rnd in study.rounds if rnd.name not in repeat_rounds}
    for name in dict.fromkeys(
        k for space in spaces.values() for k, hp in space.items() if hp.role == "scientific"
    ):
        series = []
        for rnd_name, space in spaces.items():  # a round where `name` is scientific, in its own space
            hp = space.get(name)
            own = [r for r in rows if r.get("round") == rnd_name and r.get(f"hp/{name}") is not None]
            if hp is not None and hp.role == "scientific" and own:
                series.append(round_series(rnd_name, name, hp, own, repeats, study.training.mode))
        out[name] = series
    return out


def spanned_space(study: Study, rounds) -> dict[str, HParam]:
    """One entry per hyperparameter of these rounds' spaces (`Study.compared_space`), spanning
    them all, to draw them on one axis: a choice's values united (in order of appearance), a
    range from the lowest min to the highest max; role, type and scale of the last round that
    has it, which decides a later round's kind of axis."""
    out: dict[str, HParam] = {}
    for rnd in rounds:
        for name, hp in study.compared_space(rnd).items():
            was = out.get(name)
            if was is not None and was.type == hp.type and hp.searched and was.searched:
                if hp.type == "choice":
                    hp = dataclasses.replace(hp, values=tuple(dict.fromkeys((*was.values, *hp.values))))
                else:
                    hp = dataclasses.replace(hp, min=min(was.min, hp.min), max=max(was.max, hp.max))
            out[name] = hp
    return out


def round_series(
    round_name: str, name: str, hp: HParam, rows: list[Mapping], repeats: Mapping[str, list], mode: str
) -> Series:
    """One round's point for each value of `name` its rows have."""
    groups: dict[Any, list[Mapping]] = {}
    for row in rows:
        groups.setdefault(row[f"hp/{name}"], []).append(row)
    points = [point(value, group, repeats, mode) for value, group in groups.items()]
    return Series(round_name, tuple(sorted(points, key=lambda p: value_order(hp, p.value))))


def point(value: Any, rows: list[Mapping], repeats: Mapping[str, list], mode: str) -> Point:
    ranked = ranked_results(rows, mode)
    diverged = sum(r.get("status") == TrialStatus.DIVERGED for r in rows)
    if not ranked:
        return Point(value, None, None, 0, diverged, None)
    best = ranked[0]
    return Point(
        value,
        float(best["best_metric"]),
        best["trial_name"],
        len(ranked),
        diverged,
        spread_of(repeats.get(best["trial_name"], [])),
    )


def spread_of(mine: list[Mapping]) -> Spread | None:
    """The spread of one trial's repeats (in trial-name order); None if it has none."""
    if not mine:
        return None
    values = tuple(float(r["best_metric"]) for r in results(mine))
    diverged = sum(r.get("status") == TrialStatus.DIVERGED for r in mine)
    return Spread(str(mine[0].get("round")), values, diverged)


def value_order(hp: HParam, value: Any) -> tuple:
    """A choice's values in the study file's order (an unknown value after them); numbers
    ascending; anything else by its text."""
    if hp.type == "choice":
        values = list(hp.values)
        return (0, values.index(value), "") if value in values else (1, 0, str(value))
    return (0, value, "") if is_finite(value) else (1, 0, str(value))
