"""A search range widened past the bound its best trial is at (`playbook next`'s `boundary`
rule): a log range by a factor of `WIDEN_LOG_FACTOR`, a linear one by its own width (a range of
non-negative values stops at 0; one inside [0, 1], a fraction, goes at most halfway to 1), a
choice of numbers by one value past its edge; never past a bound where every trial diverged."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from service.analysis.verdicts import Verdict, numeric_choices
from service.core.formatting import fmt
from service.study.search import HParam

WIDEN_LOG_FACTOR = 10.0
"""A log range at its bound widens by this factor (a decade) on that side."""


def widenings(
    verdicts: list[Verdict], space: Mapping[str, HParam]
) -> tuple[tuple[tuple[str, HParam, str], ...], tuple[str, ...]]:
    """The widened search entry (name, entry, why) of each dimension a `boundary` warning
    names, and a note for each bound not widened because every trial past it diverged
    (`infeasible_region`: the feasible region, not the search space, ends there)."""
    unstable = {
        (v.subject, v.facts.get("side")) for v in verdicts if v.kind == "infeasible_region" and v.is_warning
    }
    sides: dict[str, list[Verdict]] = {}
    notes = []
    for v in verdicts:
        if v.kind != "boundary" or not v.is_warning or v.subject not in space:
            continue
        if (v.subject, v.facts["side"]) in unstable:
            notes.append(
                f"boundary: {v.subject} at its {v.facts['side']} bound, not widened: every trial past it "
                "diverged (infeasible_region); stabilise training (warmup, clipping) first"
            )
        else:
            sides.setdefault(v.subject, []).append(v)
    out = []
    for name, found in sides.items():
        hp, why = space[name], []
        for v in found:
            hp, said = widen(hp, v.facts["side"])
            why.append(f"boundary: {name} {fmt(v.facts['value'])} of {v.facts['trial_name']} at the "
                       f"{v.facts['side']} bound: {said}")  # fmt: skip
        if hp != space[name]:
            out.append((name, hp, "; ".join(why)))
    return tuple(out), tuple(notes)


def widen(hp: HParam, side: str) -> tuple[HParam, str]:
    """`hp` widened on `side` (`lower` or `upper`) and what was done, in words."""
    if hp.type == "choice":
        values = numeric_choices(hp)
        new = beyond(values, side)
        if new == (values[0] if side == "lower" else values[-1]):
            return hp, f"cannot widen past {fmt(new)}"
        ordered = [new, *values] if side == "lower" else [*values, new]
        return dataclasses.replace(hp, values=tuple(ordered)), f"{fmt(new)} added"
    old = float(hp.min if side == "lower" else hp.max)
    bound = _widened_bound(hp, side)
    if hp.type == "int":
        bound = math.floor(bound) if side == "lower" else math.ceil(bound)
    else:
        bound = float(f"{bound:.4g}")
    if bound == old:
        return hp, f"cannot widen past {fmt(old)}"
    new = dataclasses.replace(hp, **{"min" if side == "lower" else "max": bound})
    how = f"x{fmt(WIDEN_LOG_FACTOR)}" if hp.scale == "log" else "by the range's width"
    return new, f"{fmt(old)} -> {fmt(bound)} ({how})"


def _widened_bound(hp: HParam, side: str) -> float:
    lo, hi = float(hp.min), float(hp.max)
    if hp.scale == "log":
        return lo / WIDEN_LOG_FACTOR if side == "lower" else hi * WIDEN_LOG_FACTOR
    width = hi - lo
    if side == "lower":
        return max(0.0, lo - width) if lo >= 0 else lo - width
    if lo >= 0 and hi <= 1:  # a fraction stays below 1
        return min(hi + width, (hi + 1) / 2)
    return hi + width


def beyond(values: list, side: str) -> float | int:
    """The next value past the smallest (`lower`) or largest (`upper`) of sorted numbers: their
    last two values' ratio when every neighbouring pair has that ratio (all positive), else the
    difference of the last two; as a range widens, non-negative values stay non-negative and
    values inside [0, 1] go at most halfway to 1 (the edge itself when it cannot move)."""
    edge, near = (values[0], values[1]) if side == "lower" else (values[-1], values[-2])
    ratios = [b / a for a, b in zip(values, values[1:], strict=False)] if all(v > 0 for v in values) else []
    if ratios and np.allclose(ratios, ratios[0]):
        new = edge * (edge / near)
    else:
        new = edge + (edge - near)
    if values[0] >= 0:
        new = max(new, 0)
        if values[-1] <= 1 and new > edge:  # a fraction
            new = min(new, (edge + 1) / 2)
    if all(isinstance(v, int) for v in values):
        return int(round(new))
    return float(f"{new:.4g}")
