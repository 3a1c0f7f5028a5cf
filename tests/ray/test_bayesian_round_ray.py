"""A real three-round digits study on the shared Ray cluster: quasi-random, a bayesian round
through Ray Tune's OptunaSearch, then a repeat round. Each bayesian trial's hyperparameters are
what optuna's TPE, built here by hand (optuna only, not the service's planning) and
warm-started with the trials before it in the trial table, suggests for the round's seed; the
first differs from the same sampler's suggestion without round 1's history. The repeat round
reruns the best bayesian trial with the next seeds, and its sentence gives their spread."""

from __future__ import annotations

import json
import os

import numpy as np
import optuna
import pyarrow.parquet as pq
import pytest

from service.core.formatting import fmt
from tests.helpers.studies import make_study, run_within_timeout

pytestmark = pytest.mark.ray
SEED = 5
LR = (0.01, 0.5)
MOMENTUM = (0.5, 0.95)


@pytest.fixture(scope="module")
def bayesian_study(ray_cluster, digits_dir, tmp_path_factory):
    study = make_study(
        digits_dir,
        tmp_path_factory.mktemp("storage"),
        name="bayesian-round",
        training={
            "max_train_steps": 4,
            "eval_every_steps": 2,
            "num_checkpoints_to_keep": 1,
            "schedule": {"kind": "constant"},
        },
        search={
            "learning_rate": {
                "role": "nuisance",
                "type": "float",
                "min": LR[0],
                "max": LR[1],
                "scale": "log",
            },
            "momentum": {"role": "nuisance", "type": "float", "min": MOMENTUM[0], "max": MOMENTUM[1]},
            "width": {"role": "fixed", "value": 4},
        },
        rounds=[
            {"name": "r1", "num_trials": 3},
            {"name": "r2", "kind": "bayesian", "num_trials": 2, "seed": SEED},
            {"name": "rep", "kind": "repeat", "num_trials": 2},
        ],
    )
    run_within_timeout(study)
    rows = pq.read_table(os.path.join(study.study_uri, "trials.parquet")).to_pylist()
    with open(os.path.join(study.study_uri, "verdicts.json")) as f:
        sentences = {v["round"]: v["scientific"] for v in json.load(f)}
    return {r["trial_name"]: r for r in rows}, sentences


DISTS = {
    "learning_rate": optuna.distributions.FloatDistribution(*LR, log=True),
    "momentum": optuna.distributions.FloatDistribution(*MOMENTUM),
}


def tpe_suggestions(history: list[dict], results: list[float]) -> list[dict]:
    """TPE's suggestions, built with optuna alone: warm-started with `history` (finished trial
    rows), then asked once per value in `results`, each told that value before the next ask."""
    sampler = optuna.samplers.TPESampler(seed=SEED, n_startup_trials=0)
    study = optuna.create_study(sampler=sampler, direction="minimize")
    for r in history:
        params = {k: r[f"hp/{k}"] for k in DISTS}
        study.add_trial(optuna.trial.create_trial(value=r["best_metric"], params=params, distributions=DISTS))
    out = []
    for value in results:
        trial = study.ask()
        out.append({k: trial.suggest_float(k, d.low, d.high, log=d.log) for k, d in DISTS.items()})
        study.tell(trial, value)
    return out


def test_bayesian_trials_are_tpe_suggestions_conditioned_on_the_trials_before(bayesian_study):
    rows, _ = bayesian_study
    r1 = [rows[f"r1-000{i}"] for i in range(3)]
    r2 = [rows["r2-0000"], rows["r2-0001"]]
    for r in r1 + r2:
        assert r["status"] == "FINISHED", r
    assert [r["round"] for r in r2] == ["r2", "r2"] and all(r["max_train_steps"] == 4 for r in r2)
    assert all(r["hp/width"] == 4 for r in r2)
    got = [{k: r[f"hp/{k}"] for k in DISTS} for r in r2]
    # r2-0001 was suggested after r2-0000's result was told.
    assert got == tpe_suggestions(r1, [r["best_metric"] for r in r2])
    assert got[0] != tpe_suggestions([], [0.0])[0]  # round 1 changed the first suggestion


def test_repeat_round_reruns_the_best_bayesian_trial_with_other_seeds(bayesian_study):
    rows, sentences = bayesian_study
    best = min((rows["r2-0000"], rows["r2-0001"]), key=lambda r: (r["best_metric"], r["trial_name"]))
    reps = [rows["rep-0000"], rows["rep-0001"]]
    for i, r in enumerate(reps):
        assert r["status"] == "FINISHED" and r["repeat_of"] == best["trial_name"]
        assert r["seed"] == best["seed"] + 1 + i and r["max_train_steps"] == best["max_train_steps"]
        assert all(r[f"hp/{k}"] == best[f"hp/{k}"] for k in ("learning_rate", "momentum", "width"))
    values = [r["best_metric"] for r in reps]
    mean, std = float(np.mean(values)), float(np.std(values, ddof=1))
    assert sentences["rep"].startswith(f"Seed repeats of the best configuration: validation/loss {fmt(mean)}")
    assert f"± {fmt(std)} over 2 seeds" in sentences["rep"]
