"""A real three-round digits study on the shared Ray cluster: quasi-random with a searched
warmup, then extend, extend. The metrics logs (the learning rate of the last update before each
evaluation, evaluated after every step) show each trial's sampled warmup, and round 3 decaying
over as many steps as round 1's best trial did; checked against the schedule written out here."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers.studies import make_study

pytestmark = pytest.mark.ray
T1 = 10  # round 1; rounds 2 and 3 double it: 20, 40


@pytest.fixture(scope="module")
def three_rounds(ray_cluster, digits_dir, tmp_path_factory):
    from service.orchestration.study_run import run_study

    study = make_study(
        digits_dir,
        tmp_path_factory.mktemp("storage"),
        name="three-rounds",
        training={
            "max_train_steps": T1,
            "eval_every_steps": 1,  # every update's learning rate reaches the metrics log
            "num_checkpoints_to_keep": 1,
            "schedule": {"kind": "linear"},
        },
        search={
            "learning_rate": {"role": "nuisance", "type": "float", "min": 0.01, "max": 0.5, "scale": "log"},
            "warmup_steps": {"role": "nuisance", "type": "int", "min": 1, "max": 7},
            "width": {"role": "fixed", "value": 4},
        },
        rounds=[
            {"name": "r1", "num_trials": 3},
            {"name": "r2", "kind": "extend", "num_trials": 2},
            {"name": "r3", "kind": "extend", "num_trials": 1},
        ],
    )
    run_study(study)
    rows = pq.read_table(os.path.join(study.study_uri, "trials.parquet")).to_pylist()
    return study, {r["trial_name"]: r for r in rows}


def logged_lr(study, trial: str) -> np.ndarray:
    """The learning_rate of every evaluation, in step order (evaluation k follows update k-1)."""
    with open(os.path.join(study.study_uri, "trials", trial, "metrics.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == list(range(1, len(log) + 1))
    return np.array([r["learning_rate"] for r in log])


def linear_by_hand(base: float, total: int, warmup: int, decay: int) -> np.ndarray:
    """Warmup (update s at (s+1)/warmup of the base LR), the base LR, then the last `decay`
    updates going down by base/decay each (towards 0 at step `total`)."""
    ramp = [base * (s + 1) / warmup for s in range(warmup)]
    flat = [base] * (total - warmup - decay)
    down = [base * (1 - i / decay) for i in range(decay)]
    return np.array(ramp + flat + down)


def test_each_round_one_trial_runs_its_sampled_warmup(three_rounds):
    study, rows = three_rounds
    r1 = [rows[f"r1-000{i}"] for i in range(3)]
    assert len({r["hp/warmup_steps"] for r in r1}) > 1  # the sampled warmups differ
    for r in r1:
        assert r["status"] == "FINISHED" and r["max_train_steps"] == T1
        w, base = r["hp/warmup_steps"], r["hp/learning_rate"]
        got = logged_lr(study, r["trial_name"])
        np.testing.assert_allclose(got, linear_by_hand(base, T1, w, T1 - w), rtol=1e-12)
        assert r["schedule/warmup_steps"] == w and r["schedule/kind"] == "linear"


def test_rounds_two_and_three_keep_round_one_best_warmup_and_decay_length(three_rounds):
    study, rows = three_rounds
    done = [rows[f"r1-000{i}"] for i in range(3)]
    best1 = min(done, key=lambda r: (r["best_metric"], r["trial_name"]))
    w, base, decay = best1["hp/warmup_steps"], best1["hp/learning_rate"], T1 - best1["hp/warmup_steps"]
    r1_lr = logged_lr(study, best1["trial_name"])
    for name, total in (("r2-0000", 2 * T1), ("r2-0001", 2 * T1), ("r3-0000", 4 * T1)):
        row = rows[name]
        assert row["status"] == "FINISHED" and row["max_train_steps"] == total
        assert row["hp/warmup_steps"] == w and row["hp/learning_rate"] == base
        got = logged_lr(study, name)
        np.testing.assert_allclose(got, linear_by_hand(base, total, w, decay), rtol=1e-12, err_msg=name)
        # As many updates below the base LR after warmup as round 1's best, the same ones.
        assert int(np.sum(got[w:] < base)) == int(np.sum(r1_lr[w:] < base)) == decay - 1
        np.testing.assert_allclose(got[-decay:], r1_lr[-decay:], rtol=1e-12)
        assert row["schedule/decay_steps"] == decay  # the row records the schedule it ran
    assert rows["r2-0000"]["seed"] == 0 and rows["r2-0001"]["seed"] == 1
    r2_best = min((rows["r2-0000"], rows["r2-0001"]), key=lambda r: (r["best_metric"], r["trial_name"]))
    r3 = rows["r3-0000"]
    assert r3["extended_from"] == r2_best["trial_name"]
    assert r3["schedule_origin"] == (
        f"linear schedule of {r2_best['trial_name']} ({2 * T1} steps) extended to {4 * T1} steps: "
        f"warmup {w} and decay {decay} steps kept, constant phase {T1} -> {3 * T1} steps"
    )


def test_round_sentences_name_the_seed_repeats(three_rounds):
    study, rows = three_rounds
    with open(os.path.join(study.study_uri, "verdicts.json")) as f:
        sentences = {v["round"]: v["scientific"] for v in json.load(f)}
    r1_best = min((rows[f"r1-000{i}"] for i in range(3)), key=lambda r: (r["best_metric"], r["trial_name"]))
    assert f"best of 2 seed repeats of {r1_best['trial_name']}, seeds 0, 1)" in sentences["r2"]
    assert "the only finished seed repeat of r2-000" in sentences["r3"]
