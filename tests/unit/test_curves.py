"""Training-curve and optimization verdicts (service/analysis/curves.py) on hand-made metric
histories whose answers are worked out by hand: an overfitting curve and its onset step, a
curve still improving, a noisy tail, a saturated curve, a rising training loss, an early loss
spike and an early divergence, the clipping threshold and the clipped share; the round's
verdicts, the thresholds read from the study file, and the round verdicts read from the
metrics logs a study stored."""

from __future__ import annotations

import json
import os

import pytest

from service.analysis import curve_summary, curves
from service.analysis.report_lines import round_verdicts
from service.analysis.verdicts import best_step_position
from service.core.errors import SpecError
from service.study import spec
from service.study.sections import Curves
from tests.helpers.studies import MINIMAL_STUDY, make_study

TH = Curves()
STEPS = list(range(10, 101, 10))  # ten evaluations of a 100-step trial


def history(metric: list[float], train: list[float], steps=STEPS, key="validation/loss") -> list[dict]:
    return [{"step": s, key: m, "train/loss": t} for s, m, t in zip(steps, metric, train, strict=True)]


def row(name="t-0", status="FINISHED", total=100, **extra) -> dict:
    return {"trial_name": name, "status": status, "max_train_steps": total, **extra}


def verdicts(h, r=None, metric="validation/loss", mode="min", th=TH) -> dict:
    return {v.kind: v for v in curves.trial_verdicts(r or row(), h, metric, mode, th)}


FALLING = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05]
OVERFIT = [1.0, 0.6, 0.4, 0.3, 0.25, 0.27, 0.3, 0.34, 0.38, 0.42]
"""Best 0.25 at step 50; improvement 0.75; ends 0.17 worse (22.7% of it, over the 10%)."""


def test_overfitting_names_its_onset_step_and_the_evidence():
    v = verdicts(history(OVERFIT, FALLING))["overfitting"]
    assert v.is_warning and v.subject == "t-0"
    f = v.facts
    assert (f["onset_step"], f["best_value"], f["last_step"], f["last_value"]) == (50, 0.25, 100, 0.42)
    assert (f["train_loss_at_onset"], f["train_loss_last"]) == (0.4, 0.05)
    assert "overfits from step 50" in v.message and "22.7%" in v.message


def test_overfitting_advises_fewer_steps_only_before_the_last_quarter():
    """Onset at step 50: "(or fewer steps)"; onset at step 80, in the last 25%, where
    best_step_position says "train longer": regularization only, and still_improving agrees."""
    assert "(or fewer steps)" in verdicts(history(OVERFIT, FALLING))["overfitting"].message
    late = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.25, 0.3]  # best 0.2 at step 80, ends 0.1 worse
    found = verdicts(history(late, FALLING))
    assert found["overfitting"].facts["onset_step"] == 80 and "still_improving" in found
    assert "fewer steps" not in found["overfitting"].message
    assert found["overfitting"].message.endswith("more regularization or data augmentation would help.")


def test_overfitting_starts_where_the_curve_leaves_its_best_plateau():
    plateau = [1.0, 0.6, 0.4, 0.3, 0.25, 0.25, 0.3, 0.34, 0.38, 0.42]  # best at steps 50 and 60
    assert verdicts(history(plateau, FALLING))["overfitting"].facts["onset_step"] == 60


def test_overfitting_on_a_metric_to_maximize():
    accuracy = [1 - x for x in OVERFIT]
    v = verdicts(
        history(accuracy, FALLING, key="validation/accuracy"), metric="validation/accuracy", mode="max"
    )
    assert v["overfitting"].facts["onset_step"] == 50


def test_no_overfitting_within_the_threshold_or_when_training_loss_rises_too():
    within = OVERFIT[:-1] + [0.32]  # 0.07 worse: 9.3% of 0.75, under the 10%
    assert "overfitting" not in verdicts(history(within, FALLING))
    assert "overfitting" in verdicts(history(within, FALLING), th=Curves(overfit_rise=0.09))
    assert "overfitting" not in verdicts(history(OVERFIT, FALLING), th=Curves(overfit_rise=0.3))
    rising = FALLING[:5] + [0.45, 0.5, 0.55, 0.6, 0.65]  # training got worse as well
    assert "overfitting" not in verdicts(history(OVERFIT, rising))


def rate_history(
    errors: list[int], n: int, train: list[float], steps: list[int], supports=None
) -> list[dict]:
    """A validation/error curve counted in examples: `errors[i]` wrong of `n` at `steps[i]`,
    with the evaluation's `validation/count` and, given `supports`, its per-class supports."""
    out = []
    for s, e, t in zip(steps, errors, train, strict=True):
        h = {"step": s, "validation/error": e / n, "validation/count": n, "train/loss": t}
        if supports is not None:
            h["validation/per_class"] = [{"class": k, "support": c} for k, c in enumerate(supports)]
        out.append(h)
    return out


NEVER_TRAINED = dict(
    errors=[248, 247, 245, 246], train=[2.297, 2.2965, 2.2955, 2.295], steps=[20, 40, 60, 80]
)
"""The user's model that never trained, on 270 validation examples of 10 classes (27 each): best
245/270 = 0.9074 at step 60, ends 246/270 = 0.9111 at step 80 -- one example, 33.3% of the
improvement 3/270 -- while train/loss still fell. The binomial standard error at the best,
sqrt(0.9074 x 0.0926 / 270) = 0.01764 (4.8 examples), is larger than both the give-back and the
improvement. Chance (predicting the most frequent class) is an error of 1 - 27/270 = 0.9."""


def test_no_overfitting_when_the_give_back_is_within_the_evaluations_noise():
    h = rate_history(NEVER_TRAINED["errors"], 270, NEVER_TRAINED["train"], NEVER_TRAINED["steps"])
    t = curves.trial_curves(row(total=80), h, "validation/error", "min")
    noise, n = curves.metric_noise(t)
    assert n == 270 and noise == pytest.approx(0.01764, abs=5e-6)
    assert noise == pytest.approx(((245 / 270) * (25 / 270) / 270) ** 0.5)
    assert "overfitting" not in verdicts(h, row(total=80), metric="validation/error")
    # the same fractions of 27,000 examples: standard error 0.001764, under the give-back
    # 0.0037 and the improvement 0.0111: overfitting, as before
    big = rate_history([100 * e for e in NEVER_TRAINED["errors"]], 27000, NEVER_TRAINED["train"],
                       NEVER_TRAINED["steps"])  # fmt: skip
    v = verdicts(big, row(total=80), metric="validation/error")["overfitting"]
    assert v.facts["onset_step"] == 60 and v.facts["noise"] == pytest.approx(0.001764, abs=5e-7)
    assert "giving back 33.3% of its improvement" in v.message
    # an improvement of 20 examples (0.0741, beyond the noise) and 3 given back (0.0111, 15% of
    # it): within the noise 0.01764 at p = 25/270 (the same as at 245/270); 6 back (0.0222) is not
    learned = [45, 35, 25, 28]
    assert "overfitting" not in verdicts(
        rate_history(learned, 270, NEVER_TRAINED["train"], NEVER_TRAINED["steps"]), row(total=80),
        metric="validation/error",
    )  # fmt: skip
    learned[-1] = 31
    assert "overfitting" in verdicts(
        rate_history(learned, 270, NEVER_TRAINED["train"], NEVER_TRAINED["steps"]), row(total=80),
        metric="validation/error",
    )  # fmt: skip


def test_a_model_that_never_trained_is_said_to_have_learned_nothing():
    h = rate_history(**NEVER_TRAINED, n=270, supports=[27] * 10)
    found = verdicts(h, row("explore-0000", total=80), metric="validation/error")
    assert set(found) == {"did_not_learn"}
    f = found["did_not_learn"].facts
    assert (f["first_value"], f["best_value"], f["best_step"]) == (248 / 270, 245 / 270, 60)
    assert f["trivial_value"] == pytest.approx(0.9) and f["num_examples"] == 270
    assert found["did_not_learn"].message == (
        "explore-0000 did not learn: validation/error's best, 0.9074 at step 60, is 3 of 270 examples "
        "(0.01111) better than its first evaluation, 0.9185 at step 20, within the evaluation's noise "
        "(0.01764), and no better than predicting the most frequent class (0.9); train/loss went from "
        "2.297 at step 20 to 2.295 at step 80: check the learning rate, the labels and the input pipeline."
    )
    # as accuracy (mode max): the same reading
    acc = [{**r, "validation/accuracy": 1 - r["validation/error"]} for r in h]
    assert "did_not_learn" in verdicts(acc, row(total=80), metric="validation/accuracy", mode="max")

    # learned before its first evaluation: 14/270 = 0.0519, best 12/270 = 0.0444, within the
    # noise sqrt(0.0444 x 0.9556 / 270) = 0.01254 of the first, but far better than chance 0.9
    h = rate_history([14, 13, 12, 13], 270, [0.3, 0.2, 0.1, 0.05], [20, 40, 60, 80], supports=[27] * 10)
    assert "did_not_learn" not in verdicts(h, row(total=80), metric="validation/error")
    # without the per-class supports, chance is not known: nothing is said
    plain = rate_history(**NEVER_TRAINED, n=270)
    assert "did_not_learn" not in verdicts(plain, row(total=80), metric="validation/error")


LINEAR = [1.0 - 0.09 * i for i in range(10)]
"""Still falling steadily: best before the last 25% (steps <= 75) 0.46 at step 70, at the end
0.19 at step 100: 0.27 of the improvement 0.81 (33.3%)."""


def test_a_curve_still_improving_says_train_longer():
    found = verdicts(history(LINEAR, FALLING))
    f = found["still_improving"].facts
    assert (f["before_step"], f["tail_step"]) == (70, 100)
    assert f["before_value"] == pytest.approx(0.46) and f["tail_value"] == pytest.approx(0.19)
    assert f["tail_share"] == pytest.approx(0.27 / 0.81)
    assert "train longer" in found["still_improving"].message
    # a steady trend is not noise, and it is not saturated
    assert "late_noise" not in found and "saturated_early" not in found


def test_a_late_gain_within_the_evaluations_noise_is_not_still_improving():
    """Errors of 270 examples: best 30 before the last 25% (step 60), 28 in it (step 90): a gain
    of 2 examples (0.0074), over 5% of the improvement of 32 (1.6 examples), but within the
    noise at the best, sqrt(28/270 x 242/270 / 270) = 0.01855 (5 examples). The same fractions
    of 27,000 examples (noise 0.001855): still improving."""
    errors, train = [60, 50, 40, 35, 32, 30, 30, 30, 28, 30], FALLING
    small = rate_history(errors, 270, train, STEPS)
    t = curves.trial_curves(row(), small, "validation/error", "min")
    assert curves.metric_noise(t)[0] == pytest.approx((28 / 270 * 242 / 270 / 270) ** 0.5)
    assert "still_improving" not in verdicts(small, metric="validation/error")
    big = rate_history([100 * e for e in errors], 27000, train, STEPS)
    f = verdicts(big, metric="validation/error")["still_improving"].facts
    assert (f["before_step"], f["tail_step"]) == (60, 90) and f["tail_share"] == pytest.approx(2 / 32)


def test_a_flat_tail_is_not_still_improving():
    flat = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.3, 0.3, 0.3, 0.3]
    assert "still_improving" not in verdicts(history(flat, FALLING))


NOISY = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.35, 0.4, 0.3, 0.4]
"""Tail (steps 80, 90, 100): 0.4, 0.3, 0.4, changes -0.1 and +0.1: standard deviation (ddof 1)
sqrt(0.01 + 0.01) = 0.1414, 20.2% of the improvement 0.7."""


def test_a_noisy_tail_warns_with_the_spread_of_its_changes():
    v = verdicts(history(NOISY, FALLING))["late_noise"]
    f = v.facts
    assert f["curves"] == ("validation/loss",) and f["from_step"] == (80,)
    assert f["change_sd"][0] == pytest.approx(0.02**0.5)
    assert "20.2%" in v.message
    assert "late_noise" not in verdicts(history(NOISY, FALLING), th=Curves(noise_ratio=0.25))


SATURATED = [1.0, 0.3, 0.201, 0.2, 0.2005, 0.201, 0.2008, 0.2007, 0.2009, 0.201]
SATURATED_TRAIN = [1.0, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
"""Within 2% of the improvement (0.016 and 0.018) of their best at step 30, of 100; the
metric's best (0.2) at step 40, in the middle of training."""


def test_a_saturated_curve_says_steps_were_wasted():
    found = verdicts(history(SATURATED, SATURATED_TRAIN))
    assert found["saturated_early"].facts["saturation_steps"] == (30, 30)
    assert set(found) == {"saturated_early"}  # flat: no noise, no late gain, no rise, no overfitting
    # the training loss still falling to the end: not saturated
    assert "saturated_early" not in verdicts(history(SATURATED, FALLING))
    # saturated at step 30 is not before 25% of training
    assert "saturated_early" not in verdicts(
        history(SATURATED, SATURATED_TRAIN), th=Curves(saturated_by=0.25)
    )


def test_a_flat_curve_whose_best_step_is_late_is_not_saturated_early():
    """best_step_position reads a best value first reached in the last 25% as "train longer"
    (the playbook: in doubt, train longer); saturated_early ("fewer steps would do") is not said
    of that trial."""
    late_best = SATURATED[:-1] + [0.199]  # best 0.199 at step 100; within 2% of it from step 30
    assert "saturated_early" not in verdicts(history(late_best, SATURATED_TRAIN))
    # best 0.199 first reached at step 80 (> 75), equalled at 90 and 100: late
    late_plateau = SATURATED[:7] + [0.199] * 3
    assert "saturated_early" not in verdicts(history(late_plateau, SATURATED_TRAIN), row(best_step=100))


def test_a_plateau_that_began_before_the_last_quarter_is_not_best_at_the_end():
    """An exact plateau: the best checkpoint (the row's best_step) is the latest of equal best
    values, step 100 of 100, but the best 0.2 was first reached at step 40: not "best at the
    end", so saturated_early is said (both curves within 2% of their improvement by step 30:
    0.201 <= 0.2 + 0.02 x 0.8 = 0.216, 0.1 <= 0.1 + 0.02 x 0.9)."""
    plateau = [1.0, 0.3, 0.201] + [0.2] * 7
    found = verdicts(history(plateau, SATURATED_TRAIN), row(best_step=100))
    assert found["saturated_early"].facts["saturation_steps"] == (30, 30)
    assert curves.best_step(curves.trial_curves(row(best_step=100), history(plateau, SATURATED_TRAIN),
                                                "validation/loss", "min")) == 40  # fmt: skip


def test_the_saturated_early_message_speaks_of_one_trial():
    v = verdicts(history(SATURATED, SATURATED_TRAIN))["saturated_early"]
    assert v.message == (
        "t-0 saturated early: validation/loss had made 98% of its improvement by step 30 and "
        "train/loss by step 30, of 100 steps; the steps after step 30 changed little (a lower "
        "max_train_steps would do)."
    )
    assert "their" not in v.message


DEMO_BEST = [0.4148, 0.1741, 0.0889, 0.0481, 0.0222, 0.0185, 0.0222, 0.0222, 0.0148, 0.0185]
DEMO_TRAIN = [1.7746, 0.3716, 0.1256, 0.0848, 0.0482, 0.0364, 0.0231, 0.0206, 0.0193, 0.02]
"""`make demo`'s best round-1 trial (validation/error every 30 of 300 steps): best 0.0148 at
step 270, in the last 25%; 0.0222 at step 150 is within 2% of the improvement 0.4 (0.008) of
it, and the training loss there within 0.035 of its low: the curve verdict said "saturated
early" while best_step_position said "train longer"."""


def test_the_demos_best_trial_gets_one_reading_train_longer():
    steps = list(range(30, 301, 30))
    h = history(DEMO_BEST, DEMO_TRAIN, steps=steps, key="validation/error")
    r = row("explore-0004", total=300, best_step=270, best_metric=0.0148)
    found = verdicts(h, r, metric="validation/error")
    assert best_step_position("explore-0004", 270, 300).facts["position"] == "late"
    assert "saturated_early" not in found and not any(v.is_warning for v in found.values())
    # the same curve with its best checkpoint at step 150 (the middle) is saturated early
    moved = DEMO_BEST[:4] + [0.0148] + DEMO_BEST[5:8] + [0.0222, 0.0185]
    h = history(moved, DEMO_TRAIN, steps=steps, key="validation/error")
    found = verdicts(h, r | {"best_step": 150}, metric="validation/error")
    assert found["saturated_early"].facts["saturation_steps"] == (150, 150)


def test_a_round_whose_best_checkpoint_is_last_is_not_said_to_have_no_late_improvement():
    """The demo's round: best_step_position says "train longer" of its best trial (step 270 of
    300); its gain over the last 25% (0.0185 -> 0.0148, 0.9% of the improvement 0.4) is under
    still_improving's 5%, so no curve warns, and the all-clear says why the two readings differ
    instead of "no late improvement"."""
    steps = list(range(30, 301, 30))
    r = row("explore-0004", total=300, best_step=270, best_metric=0.0148)
    h = {"explore-0004": history(DEMO_BEST, DEMO_TRAIN, steps=steps, key="validation/error")}
    assert best_step_position("explore-0004", 270, 300).message.endswith("train longer and retune the decay.")
    (v,) = curve_summary.round_verdicts([r], h, "validation/error", "min", TH)
    assert (v.kind, v.severity, v.facts["late_best"]) == ("training_curves", "ok", ("explore-0004",))
    assert "late improvement" not in v.message
    assert v.message.endswith(
        "The best checkpoint of explore-0004 (the best trial) is in the last 25% of training, where its "
        "curve gained less than the still-improving threshold (5% of the whole improvement over the "
        "last 25%) or no more than the evaluation's noise: best_step_position's \"train longer\" stands."
    )
    # best 0.2 at step 70 of 100 (not in the last 25%), then within 1.25% of the improvement 0.8
    middle = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.21, 0.205, 0.21]
    (v,) = curve_summary.round_verdicts(
        [row(best_metric=0.2)], {"t-0": history(middle, FALLING)}, "validation/loss", "min", TH
    )
    assert v.facts["late_best"] == () and "show no overfitting, late noise, late improvement," in v.message


def test_a_plateau_begun_before_the_last_quarter_does_not_say_train_longer_stands():
    """The user's flat curve: validation/error 10/270 = 0.037037 at steps 100 to 160 of 160, its
    best checkpoint at step 160 (the latest of equal values), its best first reached at step 100
    (62.5%): the all-clear names no trial whose best is late (no "train longer stands"); the
    same curve 9/270 at step 160 (strictly better there) is late, and it does."""
    steps = list(range(20, 161, 20))
    train = [2.0, 1.0, 0.5, 0.3, 0.2, 0.15, 0.12, 0.1]
    flat = history([e / 270 for e in [135, 54, 27, 14, 10, 10, 10, 10]], train, steps, "validation/error")
    r = row("explore-0000", total=160, best_step=160, best_metric=10 / 270)
    (v,) = curve_summary.round_verdicts([r], {"explore-0000": flat}, "validation/error", "min", TH)
    assert (v.kind, v.facts["late_best"]) == ("training_curves", ())
    assert "stands" not in v.message and "show no overfitting, late noise, late improvement," in v.message
    better = flat[:-1] + [{**flat[-1], "validation/error": 9 / 270}]
    r = row("explore-0000", total=160, best_step=160, best_metric=9 / 270)
    (v,) = curve_summary.round_verdicts([r], {"explore-0000": better}, "validation/error", "min", TH)
    assert v.facts["late_best"] == ("explore-0000",) and v.message.endswith('"train longer" stands.')


def test_a_rising_training_loss_names_its_lowest_step():
    train = [1.0, 0.5, 0.3, 0.35, 0.45, 0.6, 0.62, 0.64, 0.66, 0.68]
    v = verdicts(history(LINEAR, train))["training_loss_rising"]
    assert (v.facts["low_step"], v.facts["low_value"], v.facts["last_value"]) == (30, 0.3, 0.68)
    assert "training_loss_rising" not in verdicts(history(LINEAR, FALLING))


def test_an_early_loss_spike_is_instability_with_its_step():
    steps = [20, 40, 60, 80, 400, 600, 1000]
    train = [2.3, 1.2, 2.0, 1.0, 0.5, 0.4, 0.3]  # 2.0 > 1.5 x 1.2 at step 60, within 20% of 1000
    found = verdicts(history(train, train, steps=steps), row(total=1000))
    f = found["early_instability"].facts
    assert (f["step"], f["value"], f["low_step"], f["low_value"]) == (60, 2.0, 40, 1.2)
    assert "warmup" in found["early_instability"].message
    under = [2.3, 1.2, 1.79, 1.0, 0.5, 0.4, 0.3]  # 1.79 < 1.8
    assert "early_instability" not in verdicts(history(under, under, steps=steps), row(total=1000))
    late = [2.3, 1.2, 1.1, 1.0, 0.5, 2.0, 0.3]  # a spike at step 600: not early
    assert "early_instability" not in verdicts(history(late, late, steps=steps), row(total=1000))


def test_an_early_divergence_is_instability_and_a_late_one_is_not():
    h = [{"step": 100, "train/loss": 2.0}, {"step": 150, "train/loss": None, "status": "diverged"}]
    early = verdicts(h, row(status="DIVERGED", total=1000, diverged_at_step=150))
    assert early["early_instability"].facts["step"] == 150 and set(early) == {"early_instability"}
    assert verdicts(h, row(status="DIVERGED", total=1000, diverged_at_step=500)) == {}


def clip_history(fractions, steps=STEPS, norms=None):
    norms = norms or list(range(1, len(steps) + 1))
    return [
        {
            "step": s,
            "validation/loss": 0.5,
            "train/loss": 0.5,
            "train/grad_norm": float(n),
            "train/clipped_fraction": c,
        }
        for s, n, c in zip(steps, norms, fractions, strict=True)
    ]


def test_clipping_suggests_the_90th_percentile_and_warns_past_half_clipped():
    # norms 1..10: the 90th percentile at rank 0.9 x 9 = 8.1, 9 + 0.1 x (10 - 9) = 9.1
    v = verdicts(clip_history([1, 1, 1, 1, 1, 1, 0.5, 0, 0, 0]))["clipping"]
    assert v.facts["suggested_clip"] == pytest.approx(9.1)
    assert (v.facts["clipped_updates"], v.facts["updates"]) == (65, 100) and v.is_warning
    half = verdicts(clip_history([0.5] * 10))["clipping"]
    assert half.facts["clipped_share"] == 0.5 and not half.is_warning  # half is not more than half


def test_an_unclipped_trial_gets_a_suggested_threshold_and_the_round_its_best():
    """Without grad_clip_norm the loop logs the norms with clipped fraction 0: the verdict
    suggests the 90th percentile (norms 1..10: 9.1) for a trial that does not clip, ok."""
    h = clip_history([0.0] * 10)
    v = verdicts(h)["clipping"]
    assert v.facts["suggested_clip"] == pytest.approx(9.1) and v.facts["grad_clip_norm"] is None
    assert not v.is_warning and "trains without gradient clipping" in v.message and "9.1" in v.message
    clipped = verdicts(h, row(**{"hp/grad_clip_norm": 5.0}))["clipping"]
    assert clipped.facts["grad_clip_norm"] == 5.0 and "0% of its updates were clipped" in clipped.message
    out = curve_summary.round_verdicts([row(best_metric=0.5)], {"t-0": h}, "validation/loss", "min", TH)
    (tip,) = [x for x in out if x.kind == "clip_threshold"]
    assert tip.facts == {"trial_name": "t-0", "suggested_clip": pytest.approx(9.1)}


def test_clipped_share_weighs_each_interval_by_its_steps():
    # 10 of 10 steps, then 5 of 20: 15 of 30 updates (an unweighted mean of fractions says 62.5%)
    v = verdicts(clip_history([1.0, 0.25], steps=[10, 30], norms=[4, 2]))["clipping"]
    assert (v.facts["clipped_updates"], v.facts["updates"]) == (15, 30) and not v.is_warning
    assert verdicts(history(LINEAR, FALLING)).get("clipping") is None  # no norms logged: nothing said


def test_round_verdicts_name_the_trials_and_the_best_one():
    rows = [
        row("r-0", best_metric=0.25), row("r-1", best_metric=0.19), row("r-2", best_metric=0.3),
        row("r-3", status="RUNNING"),
    ]  # fmt: skip
    hist = {
        "r-0": history(OVERFIT, FALLING),
        "r-1": clip_history([0.0] * 10, norms=list(range(1, 11))),
        "r-2": history(LINEAR, FALLING),
    }
    hist["r-1"] = [{**h, "validation/loss": m} for h, m in zip(hist["r-1"], LINEAR, strict=True)]
    out = {v.kind: v for v in curve_summary.round_verdicts(rows, hist, "validation/loss", "min", TH)}
    assert set(out) == {"overfitting", "still_improving", "clip_threshold"}
    assert out["overfitting"].facts["trials"] == ("r-0",)
    # ranked by best metric: r-1 (0.19) first, then r-2
    assert out["still_improving"].facts["trials"] == ("r-1", "r-2")
    assert out["still_improving"].facts["num_trials"] == 3
    assert out["still_improving"].message.startswith("2 of 3 trials: r-1 (the best trial), r-2. r-1 is")
    for v in out.values():  # the log line and the report show the kind beside the message: once
        assert v.message.lower().count(v.kind.replace("_", " ")) <= 1, v.message
    assert out["clip_threshold"].facts == {"trial_name": "r-1", "suggested_clip": pytest.approx(9.1)}
    clean = curve_summary.round_verdicts(
        rows[2:3], {"r-2": history(FALLING[:5] + [0.3] * 5, FALLING)}, "validation/loss", "min", TH
    )
    assert [(v.kind, v.severity) for v in clean] == [("training_curves", "ok")]


def test_a_round_counts_only_trials_with_curves():
    """A FINISHED trial without a metrics log says nothing (not "no overfitting"); a DIVERGED
    one is judged on its row's divergence step."""
    rows = [row("n-0", best_metric=0.2), row("n-1", status="DIVERGED", total=1000, diverged_at_step=100)]
    assert curve_summary.round_verdicts(rows[:1], {}, "validation/loss", "min", TH) == []
    (v,) = curve_summary.round_verdicts(rows, {}, "validation/loss", "min", TH)
    assert (v.kind, v.facts["trials"], v.facts["num_trials"]) == ("early_instability", ("n-1",), 1)


def test_thresholds_are_a_study_file_section_refused_by_name():
    study = spec.load_dict({**MINIMAL_STUDY, "curves": {"overfit_rise": 0.3, "spike_ratio": 2}})
    assert study.curves == Curves(overfit_rise=0.3, spike_ratio=2.0)
    with pytest.raises(SpecError, match=r"^curves.noise_ratio: must be in \(0, 1\) \(got 1.5\)$"):
        spec.load_dict({**MINIMAL_STUDY, "curves": {"noise_ratio": 1.5}})
    with pytest.raises(SpecError, match=r"^curves.spike_ratio: must be > 1"):
        spec.load_dict({**MINIMAL_STUDY, "curves": {"spike_ratio": 1}})


def test_the_round_summary_reads_the_stored_metrics_logs(digits_dir, tmp_path):
    study = make_study(digits_dir, tmp_path, training={"max_train_steps": 100, "eval_every_steps": 10})
    rows = [{**row("explore-0000", best_metric=0.25, best_step=50), "round": "explore"}]
    log = study.layout.trial("explore-0000").metrics_log
    os.makedirs(os.path.dirname(log))
    with open(log, "w") as f:
        f.writelines(json.dumps(h) + "\n" for h in history(OVERFIT, FALLING))
    summary = round_verdicts(study, "explore", rows)
    (v,) = [v for v in summary["verdicts"] if v["kind"] == "overfitting"]
    assert v["severity"] == "warning" and "explore-0000 overfits from step 50" in v["message"]
