"""The report's PNG plots (matplotlib, no pyplot: a `Figure` per plot, no global state).

A fixed number of figures whatever the number of trials; every trial's curve goes into one
`LineCollection`, so drawing is linear in the points plotted."""

from __future__ import annotations

import base64
import io
import math

from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

from service.analysis.isolation import spanned_space
from service.analysis.verdicts import EARLY_FRACTION, LATE_FRACTION
from service.core.ranking import best_result
from service.core.trial_status import TrialStatus
from service.report.isolation_plot import isolation_figure
from service.report.load import StudyData

BEST_COLOR, TRIAL_COLOR, DIVERGED_COLOR = "#d62728", "#1f77b4", "#7f7f7f"


def png_data_uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _finite(v) -> bool:
    return isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v)


def best_trial(data: StudyData) -> str | None:
    best = best_result(data.rows, data.mode)
    return best["trial_name"] if best else None


def curves(data: StudyData, key: str, title: str) -> Figure | None:
    """`key` against step, one line per trial; the best trial drawn on top in red."""
    best = best_trial(data)
    lines, best_line = [], None
    for trial, history in data.histories.items():
        pts = [(h["step"], h[key]) for h in history if _finite(h.get(key)) and _finite(h.get("step"))]
        if not pts:
            continue
        if trial == best:
            best_line = pts
        else:
            lines.append(pts)
    if not lines and best_line is None:
        return None
    fig = Figure(figsize=(10, 4.4))
    ax = fig.subplots()
    alpha = max(0.08, min(0.8, 8 / max(1, len(lines))))
    ax.add_collection(LineCollection(lines, colors=TRIAL_COLOR, linewidths=0.9, alpha=alpha, label="trials"))
    if best_line:
        xs, ys = zip(*best_line, strict=True)
        ax.plot(xs, ys, color=BEST_COLOR, linewidth=2, label=f"best: {best}")
    ax.autoscale()
    ax.set(xlabel="step", ylabel=key, title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


HPARAM_COLUMNS = 3
"""The hyperparameter axes in rows of at most this many, so each stays readable at the page's width."""


SEARCHING_KINDS = ("quasi_random", "grid", "bayesian")
"""Rounds that spread trials over the search space; an extend or repeat round reruns one
configuration, longer or with other seeds, and is left off the hyperparameter axes."""
ROUND_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def hparam_axes(data: StudyData) -> Figure | None:
    """The best result of each trial of the searching rounds against each searched
    hyperparameter, a color per round (rounds of other lengths are not comparable point for
    point), the search bounds drawn (spanning every round's own space), the best of these
    trials marked, log axes for log-scale ones; diverged trials are marked along the top edge
    (they have no result)."""
    rounds = [r for r in data.study.rounds if r.kind in SEARCHING_KINDS]
    space = {k: hp for k, hp in spanned_space(data.study, rounds).items() if hp.searched}
    if not space or not rounds:
        return None
    colors = {
        r.name: (ROUND_COLORS[i % len(ROUND_COLORS)], data.study.round_steps(r)) for i, r in enumerate(rounds)
    }
    rows = [r for r in data.rows if r.get("round") in colors]
    finished = [r for r in rows if r.get("status") == TrialStatus.FINISHED and _finite(r.get("best_metric"))]
    diverged = [r for r in rows if r.get("status") == TrialStatus.DIVERGED]
    best = best_result(rows, data.mode)
    ncols = min(HPARAM_COLUMNS, len(space))
    nrows = math.ceil(len(space) / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.8 * nrows), layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in grid[len(space) :]:
        fig.delaxes(ax)
    for ax, (name, hp) in zip(grid, space.items(), strict=False):
        _hparam_axis(ax, name, hp, finished, diverged, best and best["trial_name"], colors)
        ax.set_ylabel(f"best {data.metric}")
    left_out = [r.name for r in data.study.rounds if r.kind not in SEARCHING_KINDS]
    fig.suptitle(
        "hyperparameter axes (dashed: search bounds)"
        + (f"; left out: {', '.join(left_out)} (one configuration each)" if left_out else "")
    )
    return fig


def _hparam_axis(
    ax, name: str, hp, finished: list[dict], diverged: list[dict], best: str | None, colors: dict
) -> None:
    """One hyperparameter's axis: the finished trials' results in their round's color, the best
    one starred, the diverged ones as crosses along the top."""

    def x_of(r):
        v = r.get(f"hp/{name}")
        if hp.type == "choice":
            return list(hp.values).index(v) if v in hp.values else None
        return v if _finite(v) else None

    pts = [(x_of(r), r["best_metric"], r["trial_name"], r["round"]) for r in finished if x_of(r) is not None]
    for rnd, (color, steps) in colors.items():
        mine = [p for p in pts if p[3] == rnd]
        if mine:
            ax.scatter(
                [p[0] for p in mine], [p[1] for p in mine], s=14, color=color, alpha=0.7,
                label=f"{rnd} ({steps} steps)",
            )  # fmt: skip
    for x, y, trial, _ in pts:
        if trial == best:
            ax.scatter([x], [y], s=120, marker="*", color=BEST_COLOR, zorder=3, label=f"best: {trial}")
    if hp.type == "choice":
        ax.set_xticks(range(len(hp.values)), [str(v) for v in hp.values])
        ax.set_xlim(-0.5, len(hp.values) - 0.5)
    else:
        _range_axis(ax, hp)
    dx = [x_of(r) for r in diverged if x_of(r) is not None]
    if dx:
        top = ax.get_ylim()[1]
        ax.scatter(dx, [top] * len(dx), marker="x", color=DIVERGED_COLOR, label="diverged", clip_on=False)
    ax.set(xlabel=f"{name} ({hp.role}{', log' if hp.scale == 'log' and hp.type != 'choice' else ''})")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=7)


def _range_axis(ax, hp) -> None:
    """A float/int dimension: its bounds dashed, 5% of the range (in its scale) beyond them."""
    for bound in (hp.min, hp.max):
        ax.axvline(bound, color="black", linestyle="--", linewidth=1)
    if hp.scale == "log":
        ax.set_xscale("log")
    pad = (math.log10(hp.max / hp.min) if hp.scale == "log" else hp.max - hp.min) * 0.05 or 1
    lo, hi = (hp.min / 10**pad, hp.max * 10**pad) if hp.scale == "log" else (hp.min - pad, hp.max + pad)
    ax.set_xlim(lo, hi)


def best_step_positions(data: StudyData) -> Figure | None:
    """Where in training each finished trial's best checkpoint sits (fraction of its
    max_train_steps), with the playbook's first-10% and last-25% zones shaded."""
    fractions = [
        r["best_step"] / r["max_train_steps"]
        for r in data.rows
        if r.get("status") == TrialStatus.FINISHED
        and _finite(r.get("best_step"))
        and r.get("max_train_steps")
    ]
    if not fractions:
        return None
    fig = Figure(figsize=(10, 3.6))
    ax = fig.subplots()
    ax.axvspan(
        0, float(EARLY_FRACTION), color="#ff7f0e", alpha=0.2, label="first 10%: max_train_steps too high"
    )
    ax.axvspan(float(LATE_FRACTION), 1, color="#2ca02c", alpha=0.2, label="last 25%: train longer")
    ax.hist(fractions, bins=20, range=(0, 1), color=TRIAL_COLOR, alpha=0.8)
    ax.set(xlim=(0, 1), xlabel="best step / max_train_steps", ylabel="trials", title="best-step positions")
    ax.legend(loc="upper left", fontsize=7)
    return fig


def sample_bias(data: StudyData) -> Figure | None:
    """The validation sample's gap to the full set with its 95% interval, at each full eval."""
    pts = [
        (
            h["step"],
            h["validation_full/sample_gap"],
            h["validation_full/sample_gap_ci_low"],
            h["validation_full/sample_gap_ci_high"],
            bool(h.get("validation_full/sample_biased")),
        )
        for history in data.histories.values()
        for h in history
        if _finite(h.get("validation_full/sample_gap"))
        and _finite(h.get("validation_full/sample_gap_ci_low"))
        and _finite(h.get("validation_full/sample_gap_ci_high"))
    ]
    if not pts:
        return None
    fig = Figure(figsize=(10, 3.6))
    ax = fig.subplots()
    for biased in (False, True):
        sel = [p for p in pts if p[4] == biased]
        if sel:
            ax.errorbar(
                [p[0] for p in sel],
                [p[1] for p in sel],
                yerr=[[p[1] - p[2] for p in sel], [p[3] - p[1] for p in sel]],
                fmt="o",
                ms=3,
                color=BEST_COLOR if biased else TRIAL_COLOR,
                label="biased" if biased else "within noise",
            )
    ax.axhline(0, color="black", linewidth=1)
    ax.set(xlabel="step", ylabel="sample - full", title=f"eval-sample bias of {data.metric}")
    ax.legend(loc="best", fontsize=7)
    return fig


def all_plots(data: StudyData) -> list[tuple[str, str, str]]:
    """(title, PNG data URI, caption or "") of every plot that has data."""
    isolation = isolation_figure(data) or (None, "")
    figures = [
        ("training loss", curves(data, "train/loss", "training loss per trial"), ""),
        (data.metric, curves(data, data.metric, f"{data.metric} per trial"), ""),
        ("isolation plot", *isolation),
        ("hyperparameter axes", hparam_axes(data), ""),
        ("best-step positions", best_step_positions(data), ""),
        ("eval-sample bias", sample_bias(data), ""),
    ]
    return [(title, png_data_uri(fig), caption) for title, fig, caption in figures if fig is not None]
