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

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from service.analysis.verdicts import (
    OK,
    WARNING,
    Verdict,
    _numeric_choices,
    _pct,
    _trials,
    _verdict,
    as_number,
    range_position,
)
from service.core import ranking
from service.core.formatting import fmt
from service.core.ranking import ranked_results
from service.core.trial_status import TrialStatus
from service.study.spec import HParam

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
            if row.get("status") == TrialStatus.DIVERGED:
                diverged.append(value)
            elif row.get("status") == TrialStatus.FINISHED and as_number(row.get("best_metric")) is not None:
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
