"""Round planning and the round-2 schedule extension: linear keeps its decay length and
lengthens the constant phase, cosine keeps the base LR and stretches; checked step by step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.core.errors import StudyStopped
from service.planning import schedules
from service.planning.rounds import plan_round, row_fields
from service.planning.schedules import extend, lr_factor
from service.study import spec
from service.study.training import Schedule


def linear_reference(step: int, total: int, warmup: int, decay: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    start = total - decay
    return 1.0 if step < start else 1.0 - (step - start) / decay


def test_linear_extension_keeps_decay_length_and_lengthens_constant_phase():
    old = Schedule(kind="linear", warmup_steps=10, decay_steps=None)
    new = extend(old, 100, 300)
    got = np.array([lr_factor(s, 300, new) for s in range(300)])
    want = np.array([linear_reference(s, 300, 10, 90) for s in range(300)])  # decay was 100 - 10
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # 200 constant steps, and the decay phase starts at the base LR: 201 steps at factor 1.
    assert int(np.sum(got[10:] == 1.0)) == 300 - 10 - 90 + 1
    # The decay phase itself is the same curve, step for step, as at the end of the old run.
    old_tail = [lr_factor(s, 100, old) for s in range(10, 100)]
    np.testing.assert_allclose(got[-90:], old_tail, rtol=1e-12)


def test_cosine_extension_keeps_base_lr_and_stretches():
    old = Schedule(kind="cosine", warmup_steps=5, final_lr_fraction=0.1)
    new = extend(old, 100, 250)
    got = np.array([lr_factor(s, 250, new) for s in range(250)])
    for s in range(5, 250):
        p = (s - 5) / 245
        assert got[s] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)), abs=1e-12)
    assert got[5] == 1.0  # the base LR is kept
    assert lr_factor(250, 250, new) == pytest.approx(0.1)


def study(**round2) -> spec.Study:
    return spec.load_dict(
        {
            "name": "r",
            "workload": "digits",
            "data": {"train": "a", "validation": "b"},
            "training": {
                "max_train_steps": 100,
                "batch_size": 8,
                "eval_every_steps": 50,
                "seed": 7,
                "schedule": {"kind": "linear", "warmup_steps": 10, "decay_steps": 30},
            },
            "search": {
                "learning_rate": {"role": "nuisance", "min": 0.01, "max": 1.0, "scale": "log"},
                "width": {"role": "fixed", "value": 4},
            },
            "rounds": [
                {"name": "explore", "num_trials": 3},
                {"name": "exploit", "kind": "extend", "num_trials": 2, **round2},
            ],
        }
    )


ROWS = [
    {
        "trial_name": "explore-0000",
        "round": "explore",
        "status": "FINISHED",
        "best_metric": 0.30,
        "hp/learning_rate": 0.1,
        "hp/width": 4,
    },
    {
        "trial_name": "explore-0001",
        "round": "explore",
        "status": "FINISHED",
        "best_metric": 0.10,
        "hp/learning_rate": 0.2,
        "hp/width": 4,
    },
    {
        "trial_name": "explore-0002",
        "round": "explore",
        "status": "DIVERGED",
        "best_metric": None,
        "hp/learning_rate": 0.9,
        "hp/width": 4,
    },
]


def test_extend_round_reruns_the_best_config_longer_with_several_seeds():
    s = study(step_multiplier=3)
    configs = plan_round(s, s.rounds[1], ROWS)
    assert [c["trial_name"] for c in configs] == ["exploit-0000", "exploit-0001"]
    for i, c in enumerate(configs):
        assert c["hparams"] == {"learning_rate": 0.2, "width": 4}  # explore-0001, the best
        assert c["max_train_steps"] == 300
        assert c["seed"] == 7 + i
        assert c["extended_from"] == "explore-0001"
        assert spec.schedule_from_dict(c["schedule"]).decay_steps == 30
        assert "extended to 300 steps" in c["schedule_origin"]


def test_extend_with_mode_max_and_no_finished_source():
    s = study(max_train_steps=500)
    assert plan_round(s, s.rounds[1], ROWS)[0]["max_train_steps"] == 500
    with pytest.raises(StudyStopped, match="round exploit: round explore has no finished trial") as e:
        plan_round(s, s.rounds[1], [r for r in ROWS if r["status"] != "FINISHED"])
    assert e.value.exit_code == 1  # the study file was fine: not bad input's 2


def test_extend_round_rules_in_the_spec():
    with pytest.raises(spec.SpecError, match=r"^rounds\[1\].from_round: no earlier round named 'nope'"):
        study(from_round="nope")
    raw = spec.to_dict(study())
    raw["rounds"] = raw["rounds"][::-1]
    with pytest.raises(spec.SpecError, match=r"^rounds\[0\].kind: the first round cannot extend"):
        spec.load_dict(raw)


# ------------------------------------------------ three rounds with a searched warmup, by hand

T1, MULT2, MULT3 = 100, 3, 2  # round lengths 100, 300, 600


def three_round_study(storage, schedule: dict, searched: dict, warmup_searched: bool = True) -> spec.Study:
    warmup = (
        {"warmup_steps": {"role": "nuisance", "type": "int", "min": 1, "max": 40}} if warmup_searched else {}
    )
    return spec.load_dict(
        {
            "name": "three",
            "workload": "digits",
            "data": {"train": "a", "validation": "b"},
            "storage": str(storage),
            "training": {
                "max_train_steps": T1,
                "batch_size": 8,
                "eval_every_steps": 50,
                "schedule": schedule,
            },
            "search": {
                "learning_rate": {"role": "nuisance", "min": 0.01, "max": 1.0, "scale": "log"},
                **warmup,
                **searched,
                "width": {"role": "fixed", "value": 4},
            },
            "rounds": [
                {"name": "r1", "num_trials": 5, "seed": 3},
                {"name": "r2", "kind": "extend", "num_trials": 2, "step_multiplier": MULT2},
                {"name": "r3", "kind": "extend", "num_trials": 1, "step_multiplier": MULT3},
            ],
        }
    )


def run_three_rounds(study: spec.Study, best_index: dict[str, int]) -> tuple[dict, list[dict]]:
    """Plan each round from the rows of the earlier ones as the coordinator does: each config's
    row recorded (`row_fields`) in a real trial table, read back from trials.parquet for the
    next round; `best_index` names the finished trial each round's best is (by its metric)."""
    from service.planning.trial import TrialPlan
    from service.tracking.trial_table import TrialTable, read_rows

    table, plans = TrialTable(study.study_uri, study.training.metric, "min"), {}
    for rnd in study.rounds:
        configs = plan_round(study, rnd, read_rows(study.study_uri))
        for i, c in enumerate(configs):
            plans[c["trial_name"]] = TrialPlan.from_config(study, c)
            table.update(
                c["trial_name"],
                round=rnd.name,
                status="FINISHED",
                max_train_steps=c["max_train_steps"],
                best_metric=0.1 if i == best_index[rnd.name] else 0.5 + i / 100,
                **row_fields(c),
            )
        table.save()
    return plans, read_rows(study.study_uri)


def by_hand(
    step: int, base: float, total: int, warmup: int, kind: str, decay: int | None, final: float
) -> float:
    """The playbook's schedule written out: a linear ramp whose last warmup update is the base
    LR; linear: the base LR until the last `decay` updates, then straight down towards
    `final` * base; cosine: a half cosine from the base LR over every update after warmup."""
    if step < warmup:
        return base * (step + 1) / warmup
    if kind == "cosine":
        return base * (
            final + (1 - final) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
        )
    decay_start = total - decay
    if step < decay_start:
        return base
    return base * (1 - (1 - final) * (step - decay_start) / decay)


THREE_ROUND_CASES = {
    # id: (schedule, other searched schedule fields)
    "linear": ({"kind": "linear"}, {"final_lr_fraction": {"role": "nuisance", "min": 0.0, "max": 0.2}}),
    "linear-searched-decay": (
        {"kind": "linear", "final_lr_fraction": 0.1},
        {"decay_steps": {"role": "nuisance", "type": "choice", "values": [20, 35, 50]}},
    ),
    "cosine": ({"kind": "cosine", "final_lr_fraction": 0.05}, {}),
}


@pytest.mark.parametrize("case", list(THREE_ROUND_CASES))
def test_three_rounds_lr_at_every_step_by_hand(case, tmp_path):
    schedule, searched = THREE_ROUND_CASES[case]
    study = three_round_study(tmp_path, schedule, searched)
    first_round = plan_round(study, study.rounds[0], [])
    warmups = [c["hparams"]["warmup_steps"] for c in first_round]
    assert len(set(warmups)) == len(warmups)  # the quasi-random points sample distinct warmups
    best1 = warmups.index(max(warmups))  # round 1's best: the longest warmup (not trial 0's)
    plans, rows = run_three_rounds(study, {"r1": best1, "r2": 1, "r3": 0})
    winner = f"r1-{best1:04d}"
    kind = schedule["kind"]

    def expected(trial_hp: dict, total: int, decay_of: int) -> np.ndarray:
        """Every update's LR for a trial with `trial_hp`, whose linear decay is the searched
        one or else covers every post-warmup update of a run of `decay_of` steps."""
        w, base = trial_hp["warmup_steps"], trial_hp["learning_rate"]
        final = trial_hp.get("final_lr_fraction", schedule.get("final_lr_fraction", 0.0))
        decay = trial_hp.get("decay_steps", decay_of - w)
        return np.array([by_hand(s, base, total, w, kind, decay, final) for s in range(total)])

    hp1 = {c["trial_name"]: c["hparams"] for c in first_round}
    for name, plan in plans.items():
        rnd = plan.round_name
        total = {"r1": T1, "r2": T1 * MULT2, "r3": T1 * MULT2 * MULT3}[rnd]
        hp = hp1[name] if rnd == "r1" else hp1[winner]  # later rounds: round 1's best, unchanged
        assert plan.max_train_steps == total
        got = np.array([plan.learning_rate(s) for s in range(total)])
        np.testing.assert_allclose(got, expected(hp, total, decay_of=T1), rtol=1e-12, err_msg=name)

    # Round 3 decays over exactly as many updates as round 1's best trial did, after a longer
    # constant phase; the cosine's peak stays round 1's base LR.
    w, base = hp1[winner]["warmup_steps"], hp1[winner]["learning_rate"]
    r1 = np.array([plans[winner].learning_rate(s) for s in range(T1)])
    r3 = np.array([plans["r3-0000"].learning_rate(s) for s in range(T1 * MULT2 * MULT3)])
    assert np.argmax(r3) == w - 1 and r3.max() == pytest.approx(base, rel=1e-12)
    if kind == "linear":
        assert int(np.sum(r3[w:] < base)) == int(np.sum(r1[w:] < base))
        np.testing.assert_allclose(r3[-(T1 - w) :], r1[w:], rtol=1e-12)  # the same decay, step for step

    # Each trial's row records the schedule it ran, and round 3's origin says what was done.
    row = {r["trial_name"]: r for r in rows}
    r3_row = row["r3-0000"]
    assert r3_row["extended_from"] == "r2-0001" and r3_row["seed"] == 0
    assert r3_row["schedule/warmup_steps"] == w and r3_row["hp/warmup_steps"] == w
    assert row["r2-0000"]["seed"] == 0 and row["r2-0001"]["seed"] == 1
    if kind == "linear":
        decay = hp1[winner].get("decay_steps", T1 - w)
        assert r3_row["schedule/decay_steps"] == decay
        assert r3_row["schedule_origin"].startswith(
            f"linear schedule of r2-0001 ({T1 * MULT2} steps) extended to {T1 * MULT2 * MULT3} steps: "
            f"warmup {w} and decay {decay} steps kept, constant phase {T1 * MULT2 - w - decay} -> "
        )
    else:
        assert r3_row["schedule_origin"].startswith(
            f"cosine schedule of r2-0001 ({T1 * MULT2} steps) stretched"
        )
    for name, plan in plans.items():  # the row's schedule columns are the schedule the trial runs
        assert schedules.from_columns(row[name]) == plan.lr_schedule


def test_warmup_fixed_in_search_drives_every_trial(tmp_path):
    study = three_round_study(tmp_path, {"kind": "cosine"}, {})
    raw = spec.to_dict(study)
    raw["search"]["warmup_steps"] = {"role": "fixed", "value": 17}
    study = spec.load_dict(raw)
    plans, _ = run_three_rounds(study, {"r1": 0, "r2": 0, "r3": 0})
    for plan in plans.values():
        lrs = [plan.learning_rate(s) / plan.hparams["learning_rate"] for s in range(17)]
        np.testing.assert_allclose(lrs, [(s + 1) / 17 for s in range(17)], rtol=1e-12)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_third_round_extends_the_schedule_of_the_trial_it_extends(kind, tmp_path):
    """Warmup in training.schedule (not searched): round 3 extends round 2's trial, whose linear
    decay is round 1's (90 updates), not one recomputed from round 2's 300 steps."""
    study = three_round_study(tmp_path, {"kind": kind, "warmup_steps": 10}, {}, warmup_searched=False)
    plans, rows = run_three_rounds(study, {"r1": 2, "r2": 0, "r3": 0})
    base = plans["r1-0002"].hparams["learning_rate"]
    total = T1 * MULT2 * MULT3
    got = np.array([plans["r3-0000"].learning_rate(s) for s in range(total)])
    want = np.array([by_hand(s, base, total, 10, kind, T1 - 10, 0.0) for s in range(total)])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    if kind == "linear":
        assert int(np.sum(got[10:] < base)) == T1 - 10 - 1  # 90 decay updates, the first at the base LR
        assert {r["trial_name"]: r.get("schedule/decay_steps") for r in rows}["r3-0000"] == T1 - 10


def test_find_steps_sweep_of_a_study_with_schedule_hyperparameters_plans_valid_schedules(tmp_path):
    """The finder's sweep runs a constant schedule: a study's searched decay_steps and
    final_lr_fraction (fixed at their middle there) are not read by it, and its trials' recorded
    schedules stay valid constant ones; the searched warmup still warms each trial up."""
    from service.planning.find_steps import sweep_study
    from service.planning.trial import TrialPlan

    raw = spec.to_dict(three_round_study(tmp_path, {"kind": "linear"}, THREE_ROUND_CASES["linear"][1]))
    raw["search"]["decay_steps"] = {"role": "nuisance", "type": "int", "min": 10, "max": 50}
    raw["find_steps"] = {
        "learning_rates": [0.01, 0.1, 1.0],
        "max_train_steps": 200,
        "train_loss_threshold": 0.1,
    }
    sweep = sweep_study(spec.load_dict(raw))
    for c in plan_round(sweep, sweep.rounds[0], []):
        plan = TrialPlan.from_config(sweep, c)
        w = c["hparams"]["warmup_steps"]
        assert plan.lr_schedule == Schedule(kind="constant", warmup_steps=w)
        assert schedules.from_columns(row_fields(c)) == plan.lr_schedule
        lrs = [plan.learning_rate(s) / c["hparams"]["learning_rate"] for s in range(200)]
        np.testing.assert_allclose(lrs, [min(1.0, (s + 1) / w) for s in range(200)], rtol=1e-12)
