"""Playbook verdicts about the search space: is the best point near its boundary, and where
does training stop being feasible.

* `boundary` (nuisance dimensions only) -- "A search space is suspicious if the best point
  sampled from it is close to its boundary. We might find an even better point if we expanded
  the search range in that direction." Closeness is measured in the scale the dimension is
  searched in (log10 for a log dimension): in [1e-4, 1] on a log scale, 0.04 sits at 65% of the
  range although it is at 4% of the linear one, and 0.9 sits at 99% although it is at 90% of
  the linear one. Scientific dimensions are the experiment's design, not a range to widen.
* `infeasible_region` -- "If all trials are infeasible for learning rates greater than some
  threshold value, and if the best performing trials have learning rates at the edge of that
  region, the model may suffer from stability issues preventing it from accessing higher
  learning rates." Such a threshold is the edge of the feasible region, not of the search
  space: widening the search space beyond it only adds diverged trials.

Which rows count is as in `service.analysis.verdicts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from service.analysis.verdicts import (
    OK,
    WARNING,
    Verdict,
    as_number,
    make_verdict,
    numeric_choices,
    percent,
    range_position,
    trial_count,
)
from service.core import ranking
from service.core.formatting import fmt
from service.core.ranking import ranked_results
from service.core.trial_status import TrialStatus
from service.study.search import HParam

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

    Only nuisance dimensions are judged: a scientific dimension's values are the experiment's
    design (what the study compares), not a range the search should widen, and a fixed one is
    not searched.

    For each nuisance float/int dimension, in the order of `space`: a trial is within `margin`
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
    ranking.sign(mode)  # validates mode
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1 (got {top_k})")
    if not 0 <= margin < 0.5:
        raise ValueError(f"margin must be in [0, 0.5) (got {margin})")
    top = ranked_results(rows, mode)[:top_k]
    out: list[Verdict] = []
    for name, hp in space.items():
        if hp.role != "nuisance":
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


def _place(
    name: str, top: list[Mapping[str, Any]], position_of: Callable[[float], float | None]
) -> list[_Placed]:
    """The top trials that have a numeric value of `name` with a position (`position_of`)."""
    placed = []
    for rank, row in enumerate(top, 1):
        value = as_number(row.get(f"hp/{name}"))
        position = None if value is None else position_of(value)
        if position is not None:
            placed.append(_Placed(rank, str(row.get("trial_name")), value, position))
    return placed


def _at_bound(
    name: str, near: _Placed, side: str, value: Any, bound: Any, message: str, **data: Any
) -> Verdict:
    """The warning that trial `near` (at `value`) sits at the `side` bound of `name`'s search space."""
    return make_verdict(
        "boundary",
        name,
        WARNING,
        message,
        side=side,
        trial_name=near.trial_name,
        rank=near.rank,
        value=value,
        bound=bound,
        **data,
    )


def _inside(name: str, placed: list[_Placed], message: str, **data: Any) -> Verdict:
    """The ok verdict that the `placed` trials sit away from both bounds of `name`."""
    return make_verdict(
        "boundary", name, OK, message, trial_names=tuple(p.trial_name for p in placed), **data
    )


def _range_boundary(name: str, hp: HParam, top: list[Mapping[str, Any]], margin: float) -> list[Verdict]:
    placed = _place(name, top, lambda value: range_position(value, hp))
    if not placed:
        return []
    scale = "log-scale" if hp.scale == "log" else "linear"
    span = f"the {scale} range [{fmt(float(hp.min))}, {fmt(float(hp.max))}]"
    near_bounds = _range_near_bounds(name, hp, placed, len(top), span, margin)
    if near_bounds:
        return near_bounds
    if len(placed) == 1:
        (p,) = placed
        where = f"{name} of the best trial {p.trial_name} is {fmt(p.value)}, at {percent(p.position)}"
    else:
        first, last = min(p.position for p in placed), max(p.position for p in placed)
        where = f"{name} of the {len(placed)} best trials lies between {percent(first)} and {percent(last)}"
    message = f"{where} of {span}, more than {percent(margin)} away from both bounds."
    positions = tuple(p.position for p in placed)
    return [_inside(name, placed, message, positions=positions, scale=hp.scale, margin=margin)]


def _range_near_bounds(
    name: str, hp: HParam, placed: list[_Placed], k: int, span: str, margin: float
) -> list[Verdict]:
    """A warning for each bound of the range that one of the `placed` trials is within `margin`
    of, naming the one closest to it."""
    lower = [p for p in placed if p.position <= margin]
    upper = [p for p in placed if p.position >= 1 - margin]
    out = []
    for side, near, bound, word in (
        ("lower", min(lower, key=lambda p: (p.position, p.rank), default=None), float(hp.min), "below"),
        ("upper", max(upper, key=lambda p: (p.position, -p.rank), default=None), float(hp.max), "above"),
    ):
        if near is None:
            continue
        message = (
            f"{name} of {_who(near, k)} is {fmt(near.value)}, at {percent(near.position)} of {span} "
            f"(within {percent(margin)} of the {side} bound {fmt(bound)}): "
            f"widen the search space {word} {fmt(bound)}."
        )
        facts = dict(position=near.position, scale=hp.scale, margin=margin)
        out.append(_at_bound(name, near, side, near.value, bound, message, **facts))
    return out


def _choice_boundary(name: str, hp: HParam, top: list[Mapping[str, Any]]) -> list[Verdict]:
    ordered = numeric_choices(hp)
    if ordered is None or len(ordered) < 2:
        return []
    smallest, largest = float(ordered[0]), float(ordered[-1])
    placed = _place(name, top, lambda value: (value - smallest) / (largest - smallest))
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
        message = (
            f"{name} of {_who(near, len(top))} is {fmt(edge)}, the {extreme} of the choices {choices}: "
            f"widen the search space {word} {fmt(edge)}."
        )
        out.append(_at_bound(name, near, side, edge, edge, message, choices=tuple(ordered)))
    if out:
        return out
    if len(placed) == 1:
        where = f"{name} of the best trial {placed[0].trial_name} is {fmt(placed[0].value)}"
    else:
        where = f"{name} of the {len(placed)} best trials is one of " + ", ".join(
            fmt(p.value) for p in placed
        )
    message = f"{where}, inside the choices {choices} (neither the smallest nor the largest)."
    values = tuple(p.value for p in placed)
    return [_inside(name, placed, message, values=values, choices=tuple(ordered))]


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
        if not hp.searched or (hp.type == "choice" and numeric_choices(hp) is None):
            continue
        diverged, feasible = _diverged_and_feasible(all_rows, name)
        if diverged or feasible:
            out.extend(_feasible_region(name, diverged, feasible))
    return out


def _diverged_and_feasible(rows: list[Mapping[str, Any]], name: str) -> tuple[list[float], list[float]]:
    """The values of `name` of the DIVERGED rows, and of the results."""
    diverged: list[float] = []
    feasible: list[float] = []
    for row in rows:
        value = as_number(row.get(f"hp/{name}"))
        if value is None:
            continue
        if row.get("status") == TrialStatus.DIVERGED:
            diverged.append(value)
        elif row.get("status") == TrialStatus.FINISHED and as_number(row.get("best_metric")) is not None:
            feasible.append(value)
    return diverged, feasible


def _feasible_region(name: str, diverged: list[float], feasible: list[float]) -> list[Verdict]:
    """The `infeasible_region` verdicts of one dimension, from its diverged and feasible values."""
    if not feasible:
        message = (
            f"All {trial_count(len(diverged))} with a value of {name} diverged, "
            f"from {fmt(min(diverged))} to {fmt(max(diverged))}: no feasible region was found."
        )
        return [
            make_verdict(
                "infeasible_region",
                name,
                WARNING,
                message,
                side="all",
                num_diverged=len(diverged),
                num_trials=len(diverged),
            )
        ]
    top_ok, bottom_ok = max(feasible), min(feasible)
    above = [v for v in diverged if v > top_ok]
    below = [v for v in diverged if v < bottom_ok]
    found = []
    if above:
        found.append(_threshold(name, "upper", above, top_ok))
    if below:
        found.append(_threshold(name, "lower", below, bottom_ok))
    if found:
        return found
    total = len(diverged) + len(feasible)
    if diverged:
        message = (
            f"{len(diverged)} of {trial_count(total)} diverged, but there is no value of {name} "
            "beyond which every trial diverged."
        )
    elif total == 1:
        message = f"The one trial did not diverge along {name}."
    else:
        message = f"None of the {total} trials diverged along {name}."
    return [
        make_verdict("infeasible_region", name, OK, message, num_diverged=len(diverged), num_trials=total)
    ]


def _threshold(name: str, side: str, beyond: list[float], last_feasible: float) -> Verdict:
    """The warning that every trial `beyond` the feasible values on `side` (upper or lower)
    diverged: the threshold is the diverged value closest to `last_feasible`."""
    if side == "upper":
        threshold, at_or, ends, extreme = min(beyond), ">=", "below", "largest"
    else:
        threshold, at_or, ends, extreme = max(beyond), "<=", "above", "smallest"
    return make_verdict(
        "infeasible_region",
        name,
        WARNING,
        f"Every trial with {name} {at_or} {fmt(threshold)} diverged ({trial_count(len(beyond))}); "
        f"the feasible region ends {ends} it (the {extreme} {name} that trained without "
        f"diverging is {fmt(last_feasible)}).",
        side=side,
        threshold=threshold,
        num_diverged=len(beyond),
        last_feasible=last_feasible,
    )
