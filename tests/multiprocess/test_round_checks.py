"""The round verdicts that need the study (best steps across trials, the eval sample's noise, the
compute budget) on hand-made trial tables with known answers, and the warnings `playbook
validate` prints for them."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from service.analysis.eval_noise import eval_noise, rate_standard_error, standard_error
from service.analysis.report_lines import round_verdicts
from service.analysis.round_checks import budget_spent, verdicts_for_round
from service.analysis.verdicts import study_verdicts
from service.cli import main
from service.core.errors import SpecError
from service.distributed.topology import Topology
from service.evaluation import predictions
from service.planning.plan_size import check_budget
from service.planning.trial import TrialPlan
from service.study import spec
from service.study.search import HParam
from service.trainer.loop import train
from tests.helpers.gloo import run_gloo

LR = HParam(role="nuisance", type="float", min=1e-3, max=1.0, scale="log")


def row(name, metric, best_step=None, max_train_steps=1000, round="explore", step=None, **hp) -> dict:
    r = {
        "trial_name": name,
        "round": round,
        "status": "FINISHED",
        "best_metric": metric,
        "best_step": best_step,
        "max_train_steps": max_train_steps,
        "step": max_train_steps if step is None else step,
    }
    r.update({f"hp/{k}": v for k, v in hp.items()})
    return r


def study_dict(tmp_path, **training) -> dict:
    return {
        "name": "checks",
        "workload": "digits",
        "data": {"train": str(tmp_path / "data/train"), "validation": str(tmp_path / "data/validation")},
        "storage": str(tmp_path / "studies"),
        "training": {"max_train_steps": 300, "batch_size": 64, "eval_every_steps": 30, **training},
        "search": {"learning_rate": {"role": "nuisance", "type": "float", "min": 0.01, "max": 1.0}},
        "rounds": [
            {"name": "explore", "num_trials": 6},
            {"name": "exploit", "kind": "extend", "num_trials": 1},
        ],
    }


def by_hand(steps_and_totals):
    """(early, late) counts by the playbook's rule in integer arithmetic: early when
    step <= 10% of the total, late when step > 75% of it."""
    early = sum(1 for s, t in steps_and_totals if 10 * s <= t)
    late = sum(1 for s, t in steps_and_totals if 4 * s > 3 * t)
    return early, late


def distribution(verdicts):
    (v,) = [v for v in verdicts if v.kind == "best_step_distribution"]
    return v


# ----------------------------------------------------------------------------- best steps across trials


# metric, best step (of 1000): the best trial's checkpoint is mid-training (550), so the old
# verdict on the best trial alone is ok; but 5 of the 8 trials peak in the last 25%.
LATE_ROUND = [
    row("t0", 0.10, 550),
    row("t1", 0.11, 800),
    row("t2", 0.12, 751),
    row("t3", 0.13, 1000),
    row("t4", 0.14, 900),
    row("t5", 0.15, 760),
    row("t6", 0.16, 750),  # exactly 75%: not late
    row("t7", 0.17, 300),
]


def test_most_trials_late_warns_although_the_best_trial_is_mid_training():
    verdicts = study_verdicts(LATE_ROUND, {"learning_rate": LR}, "min")
    (position,) = [v for v in verdicts if v.kind == "best_step_position"]
    assert not position.is_warning  # the best trial alone says nothing
    v = distribution(verdicts)
    early, late = by_hand([(r["best_step"], r["max_train_steps"]) for r in LATE_ROUND])
    assert (early, late) == (0, 5)
    assert (v.facts["num_trials"], v.facts["early"], v.facts["late"]) == (8, early, late)
    assert v.facts["late_fraction"] == late / 8
    # top quarter: ceil(8 / 4) = 2 best by metric, t0 (550) and t1 (800): one late
    assert (v.facts["top_trials"], v.facts["top_early"], v.facts["top_late"]) == (2, 0, 1)
    assert v.is_warning and "Most are late: train longer and retune the decay" in v.message
    assert "5 (62.5%) in the last 25%" in v.message


def test_most_of_the_top_quarter_early_warns_even_when_few_trials_are():
    # 2 of 8 trials peak in the first 10% -- the two best ones: the whole top quarter.
    rows = [
        row(f"t{i}", 0.1 + i / 100, step) for i, step in enumerate([100, 40, 500, 600, 700, 200, 300, 650])
    ]
    v = distribution(study_verdicts(rows, {}, "min"))
    assert by_hand([(r["best_step"], 1000) for r in rows]) == (2, 0)
    assert (v.facts["early"], v.facts["top_trials"], v.facts["top_early"]) == (2, 2, 2)
    assert v.is_warning and "max_train_steps is probably too high" in v.message
    # the same table ranked the other way (mode max): the top quarter is t7, t6 -- not early
    v = distribution(study_verdicts(rows, {}, "max"))
    assert (v.facts["top_early"], v.severity) == (0, "ok")


def test_each_trial_is_judged_against_its_own_max_train_steps():
    rows = [row("a", 0.1, 90, max_train_steps=1000), row("b", 0.2, 90, max_train_steps=300)]
    v = distribution(study_verdicts(rows, {}, "min"))
    assert by_hand([(90, 1000), (90, 300)]) == (1, 0)
    assert v.facts["early"] == 1


def test_first_evaluation_after_ten_percent_is_said():
    # the demo's layout: evaluations every 50 of 300 steps, the first at 16.7%
    rows = [row(f"t{i}", 0.1 * (i + 1), 50 * (i + 1), max_train_steps=300) for i in range(4)]
    v = distribution(study_verdicts(rows, {}, "min", eval_every_steps=50))
    assert v.facts["early_visible"] is False
    assert "The first evaluation is at step 50 of 300 (16.7%)" in v.message
    assert "evaluate every 30 steps or fewer" in v.message
    v = distribution(study_verdicts(rows, {}, "min", eval_every_steps=30))  # 30 <= 10% of 300
    assert v.facts["early_visible"] is True and "cannot be seen" not in v.message


def test_compute_bound_late_best_steps_are_expected():
    late = [dict(r, best_step=900) for r in LATE_ROUND]  # the best trial late as well
    verdicts = study_verdicts(late, {}, "min", compute_bound=True)
    v = distribution(verdicts)
    assert v.severity == "ok" and "as expected when compute-bound" in v.message
    (position,) = [v for v in verdicts if v.kind == "best_step_position"]
    assert position.facts["position"] == "late" and position.severity == "ok"
    assert "as expected when compute-bound" in position.message
    assert [v.severity for v in study_verdicts(late, {}, "min") if v.kind.startswith("best")] == [
        "warning",
        "warning",
    ]


def test_no_results_no_distribution():
    assert [v for v in study_verdicts([row("a", None, None)], {}, "min") if v.kind.startswith("best")] == []


# ----------------------------------------------------------------------------- eval sample noise


def test_standard_error_is_the_sample_std_over_sqrt_n():
    x = np.array([0, 1, 0, 0, 1, 0, 0, 0, 0, 1], dtype=float)
    assert standard_error(x) == pytest.approx(np.std(x, ddof=1) / math.sqrt(10))
    assert rate_standard_error(0.1, 200) == pytest.approx(math.sqrt(0.1 * 0.9 / 200))
    assert math.isnan(standard_error(np.array([1.0])))


NOISY_ROUND = [
    row("t0", 0.100, 500),
    row("t1", 0.105, 500),
    row("t2", 0.115, 500),
    row("t3", 0.200, 500),
    row("t4", 0.300, 500),
]


def test_eval_noise_warns_when_the_standard_error_exceeds_the_gap_to_the_next_trial():
    se = math.sqrt(0.1 * 0.9 / 200)  # 0.0212: an error rate of 0.1 on 200 examples
    v = eval_noise(NOISY_ROUND, "min", "validation/error", 200, se, "binomial")
    gap = 0.105 - 0.100
    within = sum(1 for r in NOISY_ROUND[1:] if abs(r["best_metric"] - 0.100) <= se)
    assert within == 2  # t1 (0.005 away) and t2 (0.015 away); t3 is 0.1 away
    assert v.is_warning
    assert v.facts["gap"] == pytest.approx(gap) and v.facts["num_within_se"] == within
    assert (v.facts["best_trial"], v.facts["next_trial"]) == ("t0", "t1")
    assert f"about {math.ceil(200 * (se / gap) ** 2)} examples" in v.message
    assert "training.validation_sample_size" in v.message
    # a gap larger than the standard error: ok
    wide = [row("t0", 0.10, 500), row("t1", 0.15, 500)]
    assert eval_noise(wide, "min", "validation/error", 200, se, "binomial").severity == "ok"
    assert eval_noise(wide[:1], "min", "validation/error", 200, se, "binomial") is None
    # a tie at 0 errors: a standard error of 0, and still the sample does not separate them
    tie = [row("t0", 0.0, 500), row("t1", 0.0, 500), row("t2", 0.02, 500)]
    v = eval_noise(tie, "min", "validation/error", 100, 0.0, "saved")
    assert v.is_warning and "a tie: no sample size separates them" in v.message


def write_sample_predictions(study, trial, step, values):
    plan = TrialPlan(study, trial, "explore")
    n = len(values)
    rows = {
        "example_id": np.arange(n),
        "label": np.zeros(n),
        "prediction": np.zeros(n),
        "score": np.ones(n),
        "weight": np.ones(n),
        "metric/error": np.asarray(values, dtype=float),
    }
    predictions.write(plan.predictions_uri("validation-sample", step), rows, "validation-sample", step)


def test_round_verdict_measures_the_standard_error_on_the_saved_sample_predictions(tmp_path):
    study = spec.load_dict(study_dict(tmp_path, validation_sample_size=100))
    rows = [dict(r, max_train_steps=300, step=300, best_step=150) for r in NOISY_ROUND]
    # no predictions saved: the binomial standard error of the best error rate 0.1 on 100
    (v,) = [v for v in verdicts_for_round(study, "explore", rows) if v.kind == "eval_noise"]
    assert v.facts["se"] == pytest.approx(math.sqrt(0.1 * 0.9 / 100))
    assert v.facts["sample_size"] == 100 and v.is_warning
    # the best trial's sample predictions at its best step: 10 errors in 80 examples
    values = np.zeros(80)
    values[:10] = 1
    write_sample_predictions(study, "t0", 150, values)
    (v,) = [v for v in verdicts_for_round(study, "explore", rows) if v.kind == "eval_noise"]
    assert v.facts["se"] == pytest.approx(np.std(values, ddof=1) / math.sqrt(80))
    assert v.facts["sample_size"] == 80
    assert "saved validation-sample predictions of t0 at step 150" in v.message
    saved = round_verdicts(study, "explore", rows)["verdicts"]
    assert any(d["kind"] == "eval_noise" and d["severity"] == "warning" for d in saved)


def test_a_sample_as_large_as_the_set_is_judged_on_the_full_predictions(tmp_path):
    # validation_sample_size >= the set's rows: every eval is on the full set (no sample file)
    study = spec.load_dict(study_dict(tmp_path, validation_sample_size=5000))
    rows = [dict(r, max_train_steps=300, step=300, best_step=150) for r in NOISY_ROUND]
    values = np.zeros(270)
    values[:27] = 1
    plan = TrialPlan(study, "t0", "explore")
    n = len(values)
    full = {"example_id": np.arange(n), "label": np.zeros(n), "prediction": np.zeros(n), "score": np.ones(n)}
    full.update({"weight": np.ones(n), "metric/error": values})
    predictions.write(plan.predictions_uri("validation", 150), full, "validation", 150)
    (v,) = [v for v in verdicts_for_round(study, "explore", rows) if v.kind == "eval_noise"]
    assert v.facts["sample_size"] == 270
    assert v.facts["se"] == pytest.approx(np.std(values, ddof=1) / math.sqrt(270))
    assert "saved validation predictions of t0" in v.message


def test_no_eval_noise_verdict_without_a_sample_or_in_an_extend_round(tmp_path):
    study = spec.load_dict(study_dict(tmp_path))
    rows = [dict(r, max_train_steps=300, step=300, best_step=150) for r in NOISY_ROUND]
    assert "eval_noise" not in {v.kind for v in verdicts_for_round(study, "explore", rows)}
    sampled = spec.load_dict(study_dict(tmp_path, validation_sample_size=100))
    extend = [dict(r, round="exploit") for r in rows]
    kinds = {v.kind for v in verdicts_for_round(sampled, "exploit", extend)}
    assert kinds == {"best_step_position", "best_step_distribution"}


# ----------------------------------------------------------------------------- budget


def budget_study(tmp_path, **budget):
    d = study_dict(tmp_path)
    d["budget"] = {"compute_bound": True, **budget}
    return d


def test_budget_plan_over_the_budget_is_refused(tmp_path):
    # 6 x 300 + 1 x 600 = 2400 steps planned
    check_budget(spec.load_dict(budget_study(tmp_path, max_total_steps=2400)))
    with pytest.raises(SpecError, match=r"^budget.max_total_steps: the rounds plan 2400 training steps"):
        check_budget(spec.load_dict(budget_study(tmp_path, max_total_steps=2399)))
    with pytest.raises(SpecError, match=r"^budget.max_total_steps: required with compute_bound: true"):
        spec.load_dict(budget_study(tmp_path))
    d = study_dict(tmp_path)
    d["budget"] = {"compute_bound": False, "max_total_steps": 5000}
    with pytest.raises(SpecError, match=r"^budget.max_total_steps: only applies with compute_bound: true"):
        spec.load_dict(d)
    d["budget"] = {"compute_bound": False, "first_round_share": 0.3}
    with pytest.raises(SpecError, match=r"^budget.first_round_share: only applies with compute_bound: true"):
        spec.load_dict(d)
    with pytest.raises(SpecError, match=r"^budget.first_round_share: must be in \(0, 1\]"):
        spec.load_dict(budget_study(tmp_path, max_total_steps=5000, first_round_share=1.5))


def test_budget_verdict_round_one_over_its_share(tmp_path):
    study = spec.load_dict(budget_study(tmp_path, max_total_steps=3000))  # round 1's share: 1500
    rows = [row(f"explore-{i}", 0.1 + i / 100, 200, max_train_steps=300) for i in range(6)]
    rows[5]["step"] = 120  # diverged or stopped early: 120 steps spent, not 300
    spent = 5 * 300 + 120
    v = budget_spent(study, "explore", rows)
    assert v.facts["spent"] == spent == 1620
    assert v.is_warning and "Round explore spent 1620 of the budget's 3000 training steps (54%)" in v.message
    assert f"leaving {3000 - spent} steps" in v.message
    assert not budget_spent(
        spec.load_dict(budget_study(tmp_path, max_total_steps=3240)), "explore", rows
    ).is_warning
    # round 2: the rounds so far against the whole budget
    later = rows + [row("exploit-0", 0.09, 500, max_train_steps=600, round="exploit")]
    v = budget_spent(study, "exploit", later)
    assert v.facts["spent"] == spent + 600 and not v.is_warning
    kinds = [v.kind for v in verdicts_for_round(study, "explore", rows)]
    assert kinds.count("budget") == 1
    assert "budget" not in {
        v.kind for v in verdicts_for_round(spec.load_dict(study_dict(tmp_path)), "explore", rows)
    }


# ----------------------------------------------------------------------------- playbook validate


def validate(tmp_path, capsys, d) -> tuple[int, str, str]:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d))
    code = main(["validate", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_warns_when_the_first_evaluation_is_after_ten_percent(tmp_path, capsys):
    code, out, err = validate(tmp_path, capsys, study_dict(tmp_path, eval_every_steps=50))
    assert code == 0 and out.startswith("ok: study checks")
    assert (
        "warning: training.eval_every_steps: round explore: the first evaluation is at step 50 of 300 "
        "(16.7%), after the first 10% of training" in err
    )
    assert "round exploit" not in err  # 50 of 600 steps: 8.3%
    code, out, err = validate(tmp_path, capsys, study_dict(tmp_path, eval_every_steps=30))
    assert code == 0 and "eval_every_steps" not in err


def test_validate_notes_the_sample_standard_error(tmp_path, capsys):
    code, _, err = validate(tmp_path, capsys, study_dict(tmp_path, validation_sample_size=400))
    assert code == 0
    bound = 0.5 / math.sqrt(400)
    assert (
        f"note: training.validation_sample_size: a rate metric (such as an error rate) on 400 examples "
        f"has a standard error of up to {bound:.3g}" in err
    )


def test_validate_budget_findings(tmp_path, capsys):
    code, _, err = validate(tmp_path, capsys, budget_study(tmp_path, max_total_steps=3000))
    assert code == 0
    assert "warning: budget.first_round_share: round explore plans 1800 training steps" in err
    d = budget_study(tmp_path, max_total_steps=20000)
    d["rounds"][1] = {"name": "again", "num_trials": 2, "max_train_steps": 300}
    code, _, err = validate(tmp_path, capsys, d)
    assert code == 0 and "first_round_share" not in err
    assert "warning: rounds[1].max_train_steps: round again trains 300 steps, not longer than" in err
    code, out, err = validate(tmp_path, capsys, budget_study(tmp_path, max_total_steps=1000))
    assert code == 2 and out == ""
    assert err.strip() == (
        "playbook: error: budget.max_total_steps: the rounds plan 2400 training steps (trials x "
        "max_train_steps, summed; a repeat round's num_trials per scientific value), more than the "
        "budget of 1000"
    )


def test_validate_not_compute_bound_keeps_one_max_train_steps(tmp_path, capsys):
    d = study_dict(tmp_path)
    d["budget"] = {"compute_bound": False}
    d["rounds"].append({"name": "more", "num_trials": 4, "max_train_steps": 500})
    code, _, err = validate(tmp_path, capsys, d)
    assert code == 0
    assert (
        "warning: rounds[2].max_train_steps: round more trains 500 steps, not training.max_train_steps 300"
        in err
    )
    assert "rounds[1]" not in err  # the extend round trains longer on purpose
    d["rounds"][2]["max_train_steps"] = 300
    assert "max_train_steps" not in validate(tmp_path, capsys, d)[2]


# ----------------------------------------------------------------------------- real trials


def sampled_study(digits_dir, storage) -> spec.Study:
    return spec.load_dict(
        {
            "name": "noise",
            "workload": "digits",
            "data": {s: f"{digits_dir}/{s}" for s in ("train", "validation")},
            "storage": storage,
            "training": {
                "max_train_steps": 20,
                "batch_size": 30,
                "eval_batch_size": 60,
                "eval_every_steps": 2,
                "metric": "validation/error",
                "validation_sample_size": 60,
            },
            "search": {"learning_rate": {"role": "nuisance", "type": "float", "min": 0.01, "max": 1.0}},
            "rounds": [{"name": "r1", "num_trials": 2}],
        }
    )


class NullReporter:
    def report(self, metrics, checkpoint_dir):
        pass

    def restore(self):
        return None


def train_two(rank, world, digits_dir, storage):
    topo = Topology(world_rank=0, world_size=1, local_rank=0, workers_per_host=1)
    out = []
    for i, lr in enumerate((0.05, 0.3)):
        plan = TrialPlan(
            sampled_study(digits_dir, storage), f"r1-{i}", "r1", {"learning_rate": lr, "width": 4}
        )
        result = train(plan, topo, NullReporter())
        out.append({k: result[k] for k in ("trial_name", "best_step", "best_metric", "last_step")})
    return out


def test_eval_noise_of_real_trials_uses_their_saved_sample_predictions(digits_dir, tmp_path):
    storage = str(tmp_path / "storage")
    (results,) = run_gloo(train_two, 1, tmp_path, str(digits_dir), storage)
    study = sampled_study(digits_dir, storage)
    rows = [
        dict(
            r,
            round="r1",
            status="FINISHED",
            step=r["last_step"],
            max_train_steps=20,
            **{"hp/learning_rate": lr},
        )
        for r, lr in zip(results, (0.05, 0.3), strict=True)
    ]
    best = min(rows, key=lambda r: (r["best_metric"], r["trial_name"]))
    saved = TrialPlan(study, best["trial_name"], "r1").predictions_uri("validation-sample", best["best_step"])
    errors = pq.read_table(saved).column("metric/error").to_numpy()
    assert len(errors) == 60 and errors.mean() == pytest.approx(best["best_metric"])
    (v,) = [v for v in verdicts_for_round(study, "r1", rows) if v.kind == "eval_noise"]
    se = np.std(errors, ddof=1) / math.sqrt(60)
    gap = abs(rows[0]["best_metric"] - rows[1]["best_metric"])
    assert v.facts["se"] == pytest.approx(se) and v.facts["gap"] == pytest.approx(gap)
    assert v.is_warning == (se > gap)
