"""Playbook verdicts and the scientific comparison on hand-made trial tables with known answers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from service.analysis.enough_trials import enough_trials
from service.analysis.round_checks import reached_best_steps
from service.analysis.scientific import best_per_scientific, summary_sentence
from service.analysis.search_space import boundary, infeasible_region
from service.analysis.verdicts import (
    Verdict,
    best_step_position,
    range_position,
    reached_best_step,
    study_verdicts,
)
from service.core import ranking
from service.core.ranking import first_best_step, ranked_results
from service.study.search import HParam

LR_LOG = HParam(role="nuisance", type="float", min=1e-4, max=1.0, scale="log")
LR_LINEAR = HParam(role="nuisance", type="float", min=1e-4, max=1.0, scale="linear")
MOMENTUM = HParam(role="nuisance", type="float", min=0.5, max=0.99)
WARMUP = HParam(role="nuisance", type="int", min=0, max=1000)
WIDTH = HParam(role="scientific", type="choice", values=(16, 32, 64))
TUNED_WIDTH = dataclasses.replace(WIDTH, role="nuisance")
ACTIVATION = HParam(role="nuisance", type="choice", values=("relu", "gelu"))
FIXED = HParam(role="fixed", value=3)


def row(name, status="FINISHED", metric=None, best_step=None, max_train_steps=1000, **hp) -> dict:
    r = {
        "trial_name": name,
        "round": "explore",
        "status": status,
        "best_metric": metric,
        "best_step": best_step,
        "max_train_steps": max_train_steps,
    }
    r.update({f"hp/{k}": v for k, v in hp.items()})
    return r


def log_position(v: float, lo: float, hi: float) -> float:
    return (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))


def by_subject(verdicts: list[Verdict], kind: str) -> dict[str, list[Verdict]]:
    out: dict[str, list[Verdict]] = {}
    for v in verdicts:
        assert v.kind == kind
        out.setdefault(v.subject, []).append(v)
    return out


# ----------------------------------------------------------------------------- Verdict


def test_verdict_is_frozen_hashable_and_rejects_unknown_severity():
    v = best_step_position("explore-0001", 500, 1000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.severity = "warning"
    assert {v: 1}[best_step_position("explore-0001", 500, 1000)] == 1
    assert v.facts["best_step"] == 500 and v.facts["max_train_steps"] == 1000
    with pytest.raises(ValueError, match="severity"):
        Verdict("boundary", "lr", "error", "x")


# ----------------------------------------------------------------------------- best step


@pytest.mark.parametrize(
    "step, total, position, severity",
    [
        (0, 1000, "early", "warning"),
        (100, 1000, "early", "warning"),  # exactly 10%: still the first 10%
        (101, 1000, "middle", "ok"),
        (1, 7, "middle", "ok"),  # 1/7 = 14%
        (750, 1000, "middle", "ok"),  # exactly 75%: not yet the last 25%
        (751, 1000, "late", "warning"),
        (1000, 1000, "late", "warning"),
        (3, 30, "early", "warning"),
        (4, 30, "middle", "ok"),
        (75, 100, "middle", "ok"),
        (76, 100, "late", "warning"),
    ],
)
def test_best_step_position_boundaries(step, total, position, severity):
    v = best_step_position("explore-0003", step, total)
    assert (v.kind, v.subject, v.severity) == ("best_step_position", "explore-0003", severity)
    assert v.facts["position"] == position
    assert v.facts["fraction"] == pytest.approx(step / total)
    assert f"step {step} of {total}" in v.message


def test_best_step_position_messages_say_what_to_do():
    early = best_step_position("explore-0003", 40, 1000)
    assert early.message.startswith("max_train_steps is probably too high")
    assert "step 40 of 1000" in early.message
    late = best_step_position("explore-0003", 900, 1000)
    assert "train longer and retune the decay" in late.message
    assert "too high" not in best_step_position("explore-0003", 500, 1000).message


def test_best_step_position_rejects_impossible_steps():
    with pytest.raises(ValueError, match="max_train_steps"):
        best_step_position("t", 0, 0)
    with pytest.raises(ValueError, match="best_step"):
        best_step_position("t", 1001, 1000)
    with pytest.raises(ValueError, match="best_step"):
        best_step_position("t", -1, 1000)


STEPS_160 = list(range(20, 161, 20))
PLATEAU = [135, 54, 27, 14, 10, 10, 10, 10]
"""The user's flat curve, validation/error in examples of 270: 10/270 = 0.037037 at steps 100,
120, 140 and 160, the last. The best checkpoint is the latest at that value (step 160); the
best value was first reached at step 100, 62.5% of training."""


def error_log(errors: list[int], n: int = 270, steps=STEPS_160) -> list[dict]:
    return [{"step": s, "validation/error": e / n} for s, e in zip(steps, errors, strict=True)]


def test_the_best_value_is_first_reached_where_its_plateau_begins():
    h = error_log(PLATEAU)
    assert ranking.best_row(h, "validation/error", "min")["step"] == 160  # the checkpoint: kept
    assert first_best_step(h, "validation/error", "min") == 100
    r = row("explore-0003", metric=10 / 270, best_step=160, max_train_steps=160)
    assert reached_best_step(r, h, "validation/error", "min") == 100
    # strictly better at the last step (9/270): reached there
    assert first_best_step(error_log(PLATEAU[:-1] + [9]), "validation/error", "min") == 160
    # mode max: accuracy's plateau
    acc = [{"step": x["step"], "validation/accuracy": 1 - x["validation/error"]} for x in h]
    assert first_best_step(acc, "validation/accuracy", "max") == 100
    # no log: the row's best step
    assert reached_best_step(r, [], "validation/error", "min") == 160


def test_best_step_position_judges_where_the_best_value_was_first_reached():
    v = best_step_position("explore-0003", 160, 160, reached_step=100)
    assert (v.severity, v.facts["position"], v.facts["best_step"], v.facts["reached_step"]) == (
        "ok", "middle", 160, 100,
    )  # fmt: skip
    assert v.facts["fraction"] == 0.625
    assert v.message == (
        "The best checkpoint of explore-0003 is at step 160 of 160, its best value first reached at step "
        "100 (62.5% of training), neither in the first 10% nor in the last 25%."
    )
    late = best_step_position("explore-0003", 160, 160, reached_step=160)
    assert late.facts["position"] == "late" and late.message == (
        "The best checkpoint of explore-0003 is at step 160 of 160, in the last 25% of training: train "
        "longer and retune the decay."
    )
    with pytest.raises(ValueError, match="reached_step"):
        best_step_position("t", 100, 160, reached_step=120)


def test_the_round_verdicts_judge_a_plateau_where_it_began():
    """study_verdicts with the steps where each trial first reached its best: the plateau's
    trial is not late (step 100 of 160), the one that improved at its last step is."""
    rows = [
        row("explore-0000", metric=10 / 270, best_step=160, max_train_steps=160),
        row("explore-0001", metric=11 / 270, best_step=160, max_train_steps=160),
    ]
    logs = {"explore-0000": error_log(PLATEAU), "explore-0001": error_log([135, 54, 27, 14, 13, 12, 12, 11])}
    reached = reached_best_steps(rows, logs, "validation/error", "min")
    assert reached == {"explore-0000": 100, "explore-0001": 160}
    position, spread = study_verdicts(rows, {}, "min", reached=reached)[:2]
    assert (position.subject, position.facts["position"], position.is_warning) == (
        "explore-0000",
        "middle",
        False,
    )
    assert (spread.facts["late"], spread.facts["top_late"], spread.facts["early"]) == (1, 0, 0)
    assert not spread.is_warning  # 1 of 2 late is not most; the top quarter (explore-0000) is not late
    # without the logs, the checkpoints are read: both late
    position, spread = study_verdicts(rows, {}, "min")[:2]
    assert position.facts["position"] == "late" and spread.facts["late"] == 2 and spread.is_warning


# ----------------------------------------------------------------------------- boundary


def test_range_position_uses_the_dimension_scale():
    assert range_position(0.04, LR_LOG) == pytest.approx(log_position(0.04, 1e-4, 1.0))
    assert range_position(0.04, LR_LOG) == pytest.approx(0.6505, abs=1e-4)  # (log10(0.04) + 4) / 4
    assert range_position(0.04, LR_LINEAR) == pytest.approx((0.04 - 1e-4) / (1 - 1e-4))
    assert range_position(500, WARMUP) == pytest.approx(0.5)
    assert range_position(1.0, HParam(role="nuisance", min=1.0, max=1.0)) is None


def _lr_table(best_lr: float) -> list[dict]:
    return [
        row("explore-0000", metric=0.30, learning_rate=0.3),
        row("explore-0001", metric=0.10, learning_rate=best_lr),
        row("explore-0002", metric=0.50, learning_rate=0.002),
        row("explore-0003", status="DIVERGED", metric=0.0, learning_rate=0.5),  # not a result
    ]


def test_boundary_log_scale_near_lower_bound_warns():
    # 1.1e-4 in [1e-4, 1] log: (log10(1.1e-4) + 4) / 4 = log10(1.1) / 4 = 0.0103 <= 0.05
    (v,) = boundary(_lr_table(1.1e-4), {"learning_rate": LR_LOG}, "min")
    assert (v.kind, v.subject, v.severity) == ("boundary", "learning_rate", "warning")
    assert v.facts["side"] == "lower" and v.facts["trial_name"] == "explore-0001"
    assert v.facts["position"] == pytest.approx(math.log10(1.1) / 4)
    assert v.facts["bound"] == 1e-4 and v.facts["value"] == 1.1e-4
    assert "widen the search space below 0.0001" in v.message
    assert "0.00011" in v.message


def test_boundary_log_scale_value_near_the_lower_end_in_linear_terms_is_not_at_the_edge():
    # 0.04 is 4% of the linear range (a linear implementation would warn) but 65% of the log one.
    (v,) = boundary(_lr_table(0.04), {"learning_rate": LR_LOG}, "min")
    assert v.severity == "ok"
    assert v.facts["positions"] == (pytest.approx(log_position(0.04, 1e-4, 1.0)),)
    assert "65.1%" in v.message
    # the same trials on a linear dimension are at its lower edge
    (lin,) = boundary(_lr_table(0.04), {"learning_rate": LR_LINEAR}, "min")
    assert lin.severity == "warning" and lin.facts["side"] == "lower"


def test_boundary_log_scale_near_upper_bound_warns_where_linear_does_not():
    # 0.9: linear position 0.9 (inside), log position (log10(0.9) + 4) / 4 = 0.9886 (edge)
    (v,) = boundary(_lr_table(0.9), {"learning_rate": LR_LOG}, "min")
    assert v.severity == "warning" and v.facts["side"] == "upper"
    assert v.facts["position"] == pytest.approx(log_position(0.9, 1e-4, 1.0))
    assert "widen the search space above 1" in v.message
    (lin,) = boundary(_lr_table(0.9), {"learning_rate": LR_LINEAR}, "min")
    assert lin.severity == "ok"


def test_boundary_follows_mode():
    rows = [
        row("a", metric=0.9, momentum=0.98),  # best when higher is better
        row("b", metric=0.1, momentum=0.7),  # best when lower is better
    ]
    (lo,) = boundary(rows, {"momentum": MOMENTUM}, "min")
    assert lo.severity == "ok" and lo.facts["trial_names"] == ("b",)
    (hi,) = boundary(rows, {"momentum": MOMENTUM}, "max")
    # (0.98 - 0.5) / (0.99 - 0.5) = 0.9796 >= 0.95
    assert hi.severity == "warning" and hi.facts["side"] == "upper" and hi.facts["trial_name"] == "a"
    assert hi.facts["position"] == pytest.approx(0.48 / 0.49)


def test_boundary_margin_is_inclusive_and_configurable():
    rows = [row("a", metric=0.1, warmup_steps=950)]  # position exactly 0.95
    (v,) = boundary(rows, {"warmup_steps": WARMUP}, "min")
    assert v.severity == "warning" and v.facts["side"] == "upper"
    (w,) = boundary(rows, {"warmup_steps": WARMUP}, "min", margin=0.04)
    assert w.severity == "ok"
    (low,) = boundary([row("a", metric=0.1, warmup_steps=50)], {"warmup_steps": WARMUP}, "min")
    assert low.severity == "warning" and low.facts["side"] == "lower" and low.facts["position"] == 0.05
    (inside,) = boundary([row("a", metric=0.1, warmup_steps=51)], {"warmup_steps": WARMUP}, "min")
    assert inside.severity == "ok"


def test_boundary_top_k_names_the_trial_at_the_edge():
    rows = [
        row("explore-0000", metric=0.10, learning_rate=0.01, warmup_steps=500),
        row("explore-0001", metric=0.11, learning_rate=0.95, warmup_steps=20),
        row("explore-0002", metric=0.12, learning_rate=0.02, warmup_steps=10),
        row("explore-0003", metric=0.50, learning_rate=1.5e-4, warmup_steps=400),
    ]
    space = {"learning_rate": LR_LOG, "warmup_steps": WARMUP}
    only_best = boundary(rows, space, "min")
    assert [v.severity for v in only_best] == ["ok", "ok"]
    found = by_subject(boundary(rows, space, "min", top_k=3), "boundary")
    (lr,) = found["learning_rate"]
    assert lr.severity == "warning" and lr.facts["side"] == "upper"
    assert (lr.facts["trial_name"], lr.facts["rank"]) == ("explore-0001", 2)
    assert "number 2 of the 3 best trials" in lr.message
    (warmup,) = found["warmup_steps"]
    # ranks 2 and 3 are both within 5% of 0; the closer one (10 steps, rank 3) is named
    assert warmup.facts["side"] == "lower" and warmup.facts["trial_name"] == "explore-0002"
    assert warmup.facts["position"] == pytest.approx(0.01)
    # explore-0003 at the lower lr edge is 4th: outside the top 3
    assert boundary(rows, space, "min", top_k=4)[0].facts["side"] == "lower"


def test_boundary_top_k_can_warn_on_both_sides():
    rows = [
        row("a", metric=0.10, learning_rate=1.2e-4),
        row("b", metric=0.20, learning_rate=0.95),
    ]
    sides = [v.facts["side"] for v in boundary(rows, {"learning_rate": LR_LOG}, "min", top_k=2)]
    assert sides == ["lower", "upper"]


def test_boundary_choices_by_numeric_order_and_non_numeric_skipped():
    space = {"width": TUNED_WIDTH, "activation": ACTIVATION, "depth": FIXED}
    assert boundary([row("a", metric=0.1, width=64, activation="relu")], space, "min") == [
        boundary([row("a", metric=0.1, width=64, activation="relu")], {"width": TUNED_WIDTH}, "min")[0]
    ]
    (upper,) = boundary([row("a", metric=0.1, width=64)], space, "min")
    assert upper.severity == "warning" and upper.facts["side"] == "upper" and upper.facts["value"] == 64
    assert "widen the search space above 64" in upper.message
    (lower,) = boundary([row("a", metric=0.1, width=16)], space, "min")
    assert lower.facts["side"] == "lower" and "below 16" in lower.message
    (inner,) = boundary([row("a", metric=0.1, width=32)], space, "min")
    assert inner.severity == "ok"
    # the order of the values in the study file does not matter: 64 is still the largest
    shuffled = {"width": HParam(role="nuisance", type="choice", values=(64, 16, 32))}
    (v,) = boundary([row("a", metric=0.1, width=64)], shuffled, "min")
    assert v.facts["side"] == "upper"
    (v,) = boundary([row("a", metric=0.1, width=32)], shuffled, "min")
    assert v.severity == "ok"


def test_boundary_choice_top_k():
    rows = [row("a", metric=0.1, width=32), row("b", metric=0.2, width=16)]
    assert boundary(rows, {"width": TUNED_WIDTH}, "min")[0].severity == "ok"
    (v,) = boundary(rows, {"width": TUNED_WIDTH}, "min", top_k=2)
    assert v.facts["side"] == "lower" and (v.facts["trial_name"], v.facts["rank"]) == ("b", 2)


def test_boundary_judges_nuisance_dimensions_only():
    # The best trial sits at the largest width and at the upper end of the momentum range. As a
    # nuisance dimension width earns "widen above 64"; as the scientific one (the values the
    # study compares) it earns nothing, and a fixed one is not searched.
    rows = [
        row("t0", metric=0.1, width=64, momentum=0.99),
        row("t1", metric=0.2, width=16, momentum=0.7),
    ]
    scientific_momentum = dataclasses.replace(MOMENTUM, role="scientific")
    assert WIDTH.role == "scientific"
    assert boundary(rows, {"width": WIDTH, "momentum": scientific_momentum}, "min") == []
    found = by_subject(boundary(rows, {"width": TUNED_WIDTH, "momentum": MOMENTUM}, "min"), "boundary")
    assert [v.facts["side"] for v in found["width"]] == ["upper"]
    assert "widen the search space above 64" in found["width"][0].message
    assert [v.facts["side"] for v in found["momentum"]] == ["upper"]


def test_boundary_without_results_says_nothing():
    rows = [row("a", status="RUNNING", learning_rate=1e-4), row("b", status="FINISHED", metric=math.nan)]
    assert boundary(rows, {"learning_rate": LR_LOG}, "min") == []


# ----------------------------------------------------------------------------- infeasible region


def test_infeasible_region_upper_threshold():
    rows = [
        row("t0", metric=0.3, learning_rate=0.01),
        row("t1", status="DIVERGED", learning_rate=0.02),  # scattered: below a feasible trial
        row("t2", metric=0.2, learning_rate=0.05),
        row("t3", metric=0.1, learning_rate=0.1),
        row("t4", status="DIVERGED", learning_rate=0.3),
        row("t5", status="DIVERGED", learning_rate=0.9),
        row("t6", status="DIVERGED", learning_rate=0.5),
        row("t7", status="FAILED", metric=0.5, learning_rate=0.95),  # a crash, not a feasibility result
        row("t8", status="RUNNING", metric=0.5, learning_rate=0.7),
    ]
    (v,) = infeasible_region(rows, {"learning_rate": LR_LOG})
    # smallest diverged value above the largest feasible one (0.1): 0.3, with 0.3, 0.5, 0.9 above
    assert (v.kind, v.subject, v.severity) == ("infeasible_region", "learning_rate", "warning")
    assert v.facts["side"] == "upper" and v.facts["threshold"] == 0.3 and v.facts["num_diverged"] == 3
    assert v.facts["last_feasible"] == 0.1
    assert v.message.startswith("Every trial with learning_rate >= 0.3 diverged (3 trials)")
    assert "the feasible region ends below it" in v.message
    # one finished trial above breaks the threshold down to the value above it
    rows.append(row("t9", metric=0.4, learning_rate=0.4))
    (v,) = infeasible_region(rows, {"learning_rate": LR_LOG})
    assert v.facts["threshold"] == 0.5 and v.facts["num_diverged"] == 2


def test_infeasible_region_lower_threshold_and_ties():
    rows = [
        row("t0", status="DIVERGED", momentum=0.5),
        row("t1", status="DIVERGED", momentum=0.6),
        row("t2", status="DIVERGED", momentum=0.7),  # tied with a feasible trial: not below it
        row("t3", metric=0.2, momentum=0.7),
        row("t4", metric=0.1, momentum=0.9),
    ]
    (v,) = infeasible_region(rows, {"momentum": MOMENTUM})
    assert v.facts["side"] == "lower" and v.facts["threshold"] == 0.6 and v.facts["num_diverged"] == 2
    assert v.message.startswith("Every trial with momentum <= 0.6 diverged (2 trials)")
    assert "the feasible region ends above it" in v.message


def test_infeasible_region_both_sides_and_per_dimension():
    rows = [
        row("t0", status="DIVERGED", learning_rate=1e-4, width=16),
        row("t1", metric=0.2, learning_rate=0.01, width=32),
        row("t2", status="DIVERGED", learning_rate=0.8, width=32),
        row("t3", metric=0.1, learning_rate=0.05, width=64),
    ]
    found = by_subject(
        infeasible_region(rows, {"learning_rate": LR_LOG, "width": WIDTH}), "infeasible_region"
    )
    assert [(v.facts["side"], v.facts["threshold"]) for v in found["learning_rate"]] == [
        ("upper", 0.8),
        ("lower", 1e-4),
    ]
    (width,) = found["width"]
    assert width.facts["side"] == "lower" and width.facts["threshold"] == 16


def test_infeasible_region_scattered_divergence_gives_no_warning():
    rows = [
        row("t0", metric=0.3, learning_rate=0.01),
        row("t1", status="DIVERGED", learning_rate=0.05),
        row("t2", metric=0.2, learning_rate=0.1),
        row("t3", status="DIVERGED", learning_rate=0.3),
        row("t4", metric=0.1, learning_rate=0.5),
    ]
    (v,) = infeasible_region(rows, {"learning_rate": LR_LOG})
    assert v.severity == "ok" and v.facts["num_diverged"] == 2 and v.facts["num_trials"] == 5
    (none,) = infeasible_region([row("t0", metric=0.1, learning_rate=0.1)], {"learning_rate": LR_LOG})
    assert none.severity == "ok" and none.facts["num_diverged"] == 0


def test_infeasible_region_all_diverged_and_skipped_dimensions():
    rows = [row("t0", status="DIVERGED", learning_rate=0.1, activation="relu")]
    rows.append(row("t1", status="DIVERGED", learning_rate=0.2, activation="gelu"))
    space = {"learning_rate": LR_LOG, "activation": ACTIVATION, "depth": FIXED}
    (v,) = infeasible_region(rows, space)
    assert v.subject == "learning_rate" and v.severity == "warning" and v.facts["side"] == "all"
    assert v.facts["num_diverged"] == 2


def test_infeasible_region_counts_one_trial_as_one():
    (v,) = infeasible_region([row("t0", metric=0.1, learning_rate=0.1)], {"learning_rate": LR_LOG})
    assert v.message == "The one trial did not diverge along learning_rate."
    (v,) = infeasible_region(
        [row("t0", metric=0.1, learning_rate=0.1), row("t1", metric=0.2, learning_rate=0.2)],
        {"learning_rate": LR_LOG},
    )
    assert v.message == "None of the 2 trials diverged along learning_rate."
    scattered = [row("t0", status="DIVERGED", learning_rate=0.1), row("t1", metric=0.2, learning_rate=0.05)]
    scattered.append(row("t2", metric=0.2, learning_rate=0.2))
    (v,) = infeasible_region(scattered, {"learning_rate": LR_LOG})
    assert v.message.startswith("1 of 3 trials diverged, but there is no value of learning_rate")


def test_the_best_step_distribution_of_one_trial_speaks_of_one():
    (_, spread) = study_verdicts([row("t0", metric=0.1, best_step=500)], {}, "min")[:2]
    assert spread.message.startswith(
        "Best checkpoint of the 1 trial: 0 (0%) in the first 10% of training, 0 (0%) in the last 25%; of "
        "the top quarter (1 trial by metric): 0 early, 0 late."
    )


# ----------------------------------------------------------------------------- enough trials


def _metric_rows(metrics: list[float]) -> list[dict]:
    return [row(f"explore-{i:04d}", metric=m) for i, m in enumerate(metrics)]


def test_enough_trials_warns_when_one_lucky_trial_carries_the_study():
    # 0.0 once and 1.0 nine times: a resample misses the 0.0 with probability 0.9**10 = 0.349,
    # so the 90th percentile of the bootstrap best is 1.0 and the 10th is 0.0: spread 1.0.
    # The results' 10th-90th range is 0.9 (linear interpolation) to 1.0: allowed 0.25 * 0.1.
    v = enough_trials(_metric_rows([0.0] + [1.0] * 9), "min")
    assert (v.kind, v.subject, v.severity) == ("enough_trials", "study", "warning")
    f = v.facts
    assert f["reason"] == "wide_spread" and f["num_trials"] == 10
    assert (f["bootstrap_p10"], f["bootstrap_p90"], f["spread"]) == (0.0, 1.0, 1.0)
    assert (f["results_p10"], f["results_p90"]) == (pytest.approx(0.9), 1.0)
    assert f["allowed_spread"] == pytest.approx(0.025)
    assert f["p_reach"] == pytest.approx(1 - 0.9**10, abs=0.04)
    assert "run more trials" in v.message


def test_enough_trials_ok_when_the_best_region_is_well_sampled():
    # ten trials share the best value among forty: a resample misses all ten with
    # probability 0.75**40 = 1e-5, so the bootstrap best is 0.1 almost always (spread 0).
    metrics = [0.1] * 10 + [0.2 + 0.8 * i / 29 for i in range(30)]
    v = enough_trials(_metric_rows(metrics), "min")
    assert v.severity == "ok" and v.facts["spread"] == 0.0 and v.facts["p_reach"] == 1.0
    assert v.facts["observed_best"] == 0.1


def test_enough_trials_mode_max_mirrors_mode_min():
    metrics = [0.0] + [1.0] * 9
    lo = enough_trials(_metric_rows(metrics), "min")
    hi = enough_trials(_metric_rows([1 - m for m in metrics]), "max")
    assert hi.severity == "warning" and hi.facts["observed_best"] == 1.0
    assert (hi.facts["bootstrap_p10"], hi.facts["bootstrap_p90"]) == (0.0, 1.0)
    assert hi.facts["p_reach"] == lo.facts["p_reach"]


def test_enough_trials_probability_of_reaching_the_best_matches_theory():
    # distinct values: a resample reaches the best iff it draws it, 1 - (1 - 1/n)**n
    n = 8
    v = enough_trials(_metric_rows([0.1 * i for i in range(n)]), "min", num_bootstrap=20000)
    assert v.facts["p_reach"] == pytest.approx(1 - (1 - 1 / n) ** n, abs=0.015)
    # within a tolerance of 0.1, drawing the best or the second best is enough: 1 - (1 - 2/n)**n
    t = enough_trials(_metric_rows([0.1 * i for i in range(n)]), "min", num_bootstrap=20000, tolerance=0.1001)
    assert t.facts["p_reach"] == pytest.approx(1 - (1 - 2 / n) ** n, abs=0.015)


def test_enough_trials_tolerance_sets_the_allowed_spread():
    metrics = [0.0, 0.01, 0.02] + [1.0] * 7
    relative = enough_trials(_metric_rows(metrics), "min")
    # bootstrap best: P(best > 0.02) = 0.7**10 = 0.028, so the 90th percentile is <= 0.02,
    # well inside a quarter of the results' 10th-90th range (0.25 * (1.0 - 0.009))
    assert relative.severity == "ok" and relative.facts["bootstrap_p90"] <= 0.02
    strict = enough_trials(_metric_rows(metrics), "min", tolerance=0.005)
    assert strict.severity == "warning" and strict.facts["allowed_spread"] == 0.005


def test_enough_trials_is_deterministic_for_a_seed():
    metrics = [0.1 * ((7 * i) % 13) + 0.01 * i for i in range(12)]
    a = enough_trials(_metric_rows(metrics), "min", seed=3)
    b = enough_trials(_metric_rows(metrics), "min", seed=3)
    assert a == b
    others = {enough_trials(_metric_rows(metrics), "min", seed=s).facts["p_reach"] for s in range(4)}
    assert len(others) > 1  # the seed is used


def test_enough_trials_few_trials_warns():
    rows = _metric_rows([0.1, 0.1, 0.1, 0.1])  # no spread at all, but only four
    rows += [row("r", status="RUNNING"), row("d", status="DIVERGED", metric=0.0)]
    rows += [row("n", metric=math.inf), row("m", metric=None)]
    v = enough_trials(rows, "min")
    assert v.severity == "warning" and v.facts["reason"] == "few_trials" and v.facts["num_trials"] == 4
    assert "Only 4 trials" in v.message
    five = enough_trials(_metric_rows([0.1] * 5), "min")
    assert five.severity == "ok"
    empty = enough_trials([row("r", status="RUNNING")], "min")
    assert empty.severity == "warning" and empty.facts["num_trials"] == 0


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        enough_trials(_metric_rows([0.1]), "lowest")
    with pytest.raises(ValueError, match="mode"):
        boundary(_metric_rows([0.1]), {}, "lowest")


# ----------------------------------------------------------------------------- study_verdicts


def test_study_verdicts_order_and_best_trial():
    rows = [
        row("explore-0000", metric=0.30, best_step=900, learning_rate=0.01, width=32),
        row("explore-0001", metric=0.10, best_step=50, learning_rate=0.02, width=64),
        row("explore-0002", metric=0.20, best_step=500, learning_rate=0.03, width=16),
        row("explore-0003", status="DIVERGED", metric=0.0, best_step=10, learning_rate=0.9, width=32),
    ]
    space = {"learning_rate": LR_LOG, "width": WIDTH, "depth": FIXED}
    verdicts = study_verdicts(rows, space, "min")
    assert [(v.kind, v.subject) for v in verdicts] == [
        ("best_step_position", "explore-0001"),
        ("best_step_distribution", "study"),
        ("boundary", "learning_rate"),  # width is scientific: no boundary verdict
        ("infeasible_region", "learning_rate"),
        ("infeasible_region", "width"),
        ("enough_trials", "study"),
    ]
    assert verdicts[0].facts["position"] == "early"  # step 50 of 1000
    # steps 50, 500, 900 of 1000: one early, one late, none of them most; the top quarter
    # (ceil(3/4) = 1 trial) is explore-0001, early: the whole top quarter, so a warning.
    spread = verdicts[1].facts
    assert (spread["early"], spread["late"], spread["top_early"]) == (1, 1, 1)
    assert verdicts[1].is_warning
    assert verdicts[3].facts["threshold"] == 0.9
    assert verdicts[5].facts["reason"] == "few_trials"
    assert study_verdicts(rows, space, "min") == verdicts
    assert ranked_results(rows, "max")[0]["trial_name"] == "explore-0000"


# ----------------------------------------------------------------------------- scientific


SCIENCE_ROWS = [
    row("t0", metric=0.034, width=16, learning_rate=0.1),
    row("t1", metric=0.050, width=16, learning_rate=0.3),
    row("t2", metric=0.021, width=32, learning_rate=0.1),
    row("t3", metric=0.060, width=32, learning_rate=0.01),
    row("t4", metric=0.090, width=32, learning_rate=0.5),
    row("t5", metric=0.045, width=64, learning_rate=0.05),
    row("t6", status="DIVERGED", metric=0.001, width=64, learning_rate=0.9),
    row("t7", status="RUNNING", width=16, learning_rate=0.2),
]


def test_best_per_scientific_mode_min():
    groups = best_per_scientific(SCIENCE_ROWS, {"width": WIDTH, "learning_rate": LR_LOG}, "min")
    assert groups == [
        {"scientific": {"width": 32}, "best_metric": 0.021, "trial_name": "t2", "num_trials": 3},
        {"scientific": {"width": 16}, "best_metric": 0.034, "trial_name": "t0", "num_trials": 2},
        {"scientific": {"width": 64}, "best_metric": 0.045, "trial_name": "t5", "num_trials": 1},
    ]


def test_best_per_scientific_mode_max():
    groups = best_per_scientific(SCIENCE_ROWS, {"width": WIDTH, "learning_rate": LR_LOG}, "max")
    assert [(g["scientific"]["width"], g["best_metric"], g["trial_name"]) for g in groups] == [
        (32, 0.090, "t4"),
        (16, 0.050, "t1"),
        (64, 0.045, "t5"),
    ]


def test_best_per_scientific_groups_floats_by_exact_value_and_several_dimensions():
    wd = HParam(role="scientific", type="choice", values=(1e-4, 1e-3))
    rows = [
        row("a", metric=0.2, weight_decay=1e-4, width=16),
        row("b", metric=0.1, weight_decay=1e-4, width=16),
        row("c", metric=0.3, weight_decay=1e-3, width=16),
        row("d", metric=0.4, weight_decay=1e-4, width=32),
        row("e", metric=0.5, weight_decay=1.0000001e-4, width=16),
    ]
    groups = best_per_scientific(rows, {"width": WIDTH, "weight_decay": wd}, "min")
    assert [(g["scientific"], g["trial_name"], g["num_trials"]) for g in groups] == [
        ({"width": 16, "weight_decay": 1e-4}, "b", 2),
        ({"width": 16, "weight_decay": 1e-3}, "c", 1),
        ({"width": 32, "weight_decay": 1e-4}, "d", 1),
        ({"width": 16, "weight_decay": 1.0000001e-4}, "e", 1),
    ]


def test_best_per_scientific_without_scientific_dimension_is_one_group():
    groups = best_per_scientific(SCIENCE_ROWS, {"learning_rate": LR_LOG}, "min")
    assert groups == [{"scientific": {}, "best_metric": 0.021, "trial_name": "t2", "num_trials": 6}]
    assert best_per_scientific([], {"width": WIDTH}, "min") == []


def test_summary_sentence():
    groups = [
        {"scientific": {"width": 32}, "best_metric": 0.021, "trial_name": "t2", "num_trials": 6},
        {"scientific": {"width": 16}, "best_metric": 0.034, "trial_name": "t0", "num_trials": 5},
    ]
    assert summary_sentence(groups, "validation/error") == (
        "width=32 is best (validation/error 0.021, best of 6 trials over the nuisance "
        "hyperparameters); width=16: 0.034 (5 trials)"
    )
    computed = best_per_scientific(SCIENCE_ROWS, {"width": WIDTH, "learning_rate": LR_LOG}, "min")
    assert summary_sentence(computed, "validation/error") == (
        "width=32 is best (validation/error 0.021, best of 3 trials over the nuisance "
        "hyperparameters); width=16: 0.034 (2 trials); width=64: 0.045 (1 trial)"
    )
    one = best_per_scientific(SCIENCE_ROWS, {"learning_rate": LR_LOG}, "min")
    assert summary_sentence(one, "validation/error") == (
        "The best trial is t2 (validation/error 0.021, best of 6 trials over the nuisance hyperparameters)"
    )
    assert summary_sentence([], "validation/error") == "No finished trial has a finite validation/error yet."
