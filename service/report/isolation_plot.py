"""The isolation plot (see `service.analysis.isolation`): one panel per scientific hyperparameter,
its values along x (a choice's on a categorical axis, in the study file's order), the best
result of each value over the nuisance hyperparameters up y, one marker series per round; where
a repeat round reran a point's best trial, its repeats as dots beside the marker with their mean
and standard deviation as an error bar; a value whose trials all diverged as a cross on the
panel's top edge. A caption sentence says what is drawn and from which rounds."""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from service.analysis.isolation import Point, Series, isolation, spanned_space
from service.core.formatting import fmt
from service.core.trial_status import TrialStatus
from service.report.load import StudyData
from service.study.search import HParam

COLUMNS = 2
"""Panels in rows of at most this many, so each stays readable at the page's width."""
ROUND_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")
DIVERGED_COLOR = "#7f7f7f"
OFFSET = 0.2
"""On a categorical axis, the rounds' markers of one value sit this far apart (in categories)."""
REPEAT_SHIFT = 0.07
"""A point's repeats are drawn this far right of its marker (in categories; 0 on a number axis)."""


def isolation_figure(data: StudyData) -> tuple[Figure, str] | None:
    """(the figure, its caption); None for a study without a scientific hyperparameter or
    without a trial that has a value for one."""
    panels = {name: series for name, series in isolation(data.study, data.rows).items() if series}
    if not panels:
        return None
    ncols = min(COLUMNS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(10 if ncols == 1 else 13, 4.6 * nrows), layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in grid[len(panels) :]:
        fig.delaxes(ax)
    space = spanned_space(data.study, data.study.rounds)  # every round's values on one axis
    for ax, (name, series) in zip(grid, panels.items(), strict=False):
        _panel(ax, name, space[name], series, data)
    return fig, caption(data, panels)


def _panel(ax, name: str, hp: HParam, series: list[Series], data: StudyData) -> None:
    categorical = hp.type == "choice"
    for k, s in enumerate(series):
        _series(
            ax, s, hp, _shift(k, len(series), categorical), ROUND_COLORS[k % len(ROUND_COLORS)], categorical
        )
    if categorical:
        ax.set_xticks(range(len(hp.values)), [fmt(v) for v in hp.values])
        ax.set_xlim(-0.5, len(hp.values) - 0.5)
    elif hp.scale == "log":
        ax.set_xscale("log")
    _diverged_values(ax, series, hp, categorical)
    better = "lower" if data.mode == "min" else "higher"
    ax.set(
        xlabel=f"{name} (scientific)",
        ylabel=f"best {data.metric} ({better} is better)",
        title=f"isolation plot: {name}",
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)


def _shift(k: int, n: int, categorical: bool) -> float:
    """Where round k of n sits beside its value on a categorical axis (centred on the value)."""
    return (k - (n - 1) / 2) * OFFSET if categorical else 0.0


def _x(hp: HParam, value, categorical: bool) -> float | None:
    if categorical:
        return list(hp.values).index(value) if value in hp.values else None
    return value


def _series(ax, s: Series, hp: HParam, shift: float, color: str, categorical: bool) -> None:
    """The round's best per value (markers joined by a line) and its points' seed repeats."""
    pts = [(_x(hp, p.value, categorical), p) for p in s.points if p.best_metric is not None]
    pts = [(x + shift, p) for x, p in pts if x is not None]
    if not pts:
        return
    ax.plot([x for x, _ in pts], [p.best_metric for _, p in pts], marker="o", markersize=8,
            linewidth=1, color=color, label=f"{s.round}: best trial per value")  # fmt: skip
    _repeats(ax, [(x + (REPEAT_SHIFT if categorical else 0.0), p) for x, p in pts], color)


def _repeats(ax, pts: list[tuple[float, Point]], color: str) -> None:
    """Each repeat as a hollow dot at x; the repeats' mean as a tick with their standard
    deviation as the error bar (none with one repeat)."""
    reps = [(x, p.repeats) for x, p in pts if p.repeats is not None and p.repeats.values]
    if not reps:
        return
    xs = [x for x, r in reps for _ in r.values]
    label = f"{reps[0][1].round}: seed repeats (dots), mean ± std"
    ax.scatter(xs, [v for _, r in reps for v in r.values], s=22, facecolors="none", edgecolors=color,
               zorder=3, label=label)  # fmt: skip
    std = [r.std if r.n > 1 else 0.0 for _, r in reps]
    ax.errorbar([x for x, _ in reps], [r.mean for _, r in reps], yerr=std, fmt="_", markersize=14,
                capsize=5, color=color, zorder=4)  # fmt: skip


def _diverged_values(ax, series: list[Series], hp: HParam, categorical: bool) -> None:
    """A value whose trials in a round all diverged (no result): a cross in the round's colour
    on the panel's top edge, where its marker would be."""
    crosses = []
    for k, s in enumerate(series):
        for p in s.points:
            x = _x(hp, p.value, categorical)
            if p.best_metric is None and p.num_diverged and x is not None:
                crosses.append((x + _shift(k, len(series), categorical), ROUND_COLORS[k % len(ROUND_COLORS)]))
    if crosses:
        bottom, top = ax.get_ylim()
        ax.scatter([x for x, _ in crosses], [top] * len(crosses), marker="x", s=60, clip_on=False,
                   color=[c for _, c in crosses], label="all trials diverged", zorder=5)  # fmt: skip
        ax.set_ylim(bottom, top)


def caption(data: StudyData, panels: dict[str, list[Series]]) -> str:
    """What the plot shows, from which rounds, the repeats drawn and the diverged trials."""
    space = spanned_space(data.study, data.study.rounds)
    nuisance = [k for k, hp in space.items() if hp.role == "nuisance"]
    over = (
        f"over the nuisance hyperparameters ({', '.join(nuisance)})"
        if nuisance
        else "(the study has no nuisance hyperparameter)"
    )
    if len(panels) > 1:
        over += " and the other scientific one(s)"
    better = "lower" if data.mode == "min" else "higher"
    rounds = list(dict.fromkeys(s.round for series in panels.values() for s in series))
    text = (
        f"Isolation plot of {', '.join(panels)}: each marker is the best {data.metric} ({better} is "
        f"better) among one round's finished trials with that value {over}; "
        f"round{'s' if len(rounds) > 1 else ''} {', '.join(rounds)}."
    )
    return " ".join(t for t in (text, _repeats_text(panels), _diverged_text(data.rows)) if t)


def _repeats_text(panels: dict[str, list[Series]]) -> str:
    reps = [
        (name, p)
        for name, series in panels.items()
        for s in series
        for p in s.points
        if p.repeats is not None and p.repeats.values
    ]
    if not reps:
        return "No repeat round reran these bests, so no seed spread is drawn."
    parts = [f"{name}={fmt(p.value)}: {p.repeats.n} of {p.trial_name}" for name, p in reps]
    names = sorted({p.repeats.round for _, p in reps})
    return (
        f"Dots: the seed repeats of a marker's trial (round{'s' if len(names) > 1 else ''} "
        f"{', '.join(names)}; {'; '.join(parts)}); the error bar: their mean ± standard deviation."
    )


def _diverged_text(rows: list[dict]) -> str:
    """Diverged trials per round (they have no result, so no marker or dot)."""
    counts: dict[str, int] = {}
    for r in rows:
        if r.get("status") == TrialStatus.DIVERGED:
            counts[str(r.get("round"))] = counts.get(str(r.get("round")), 0) + 1
    if not counts:
        return ""
    return "Diverged trials left out: " + ", ".join(f"{n} in {k}" for k, n in counts.items()) + "."
