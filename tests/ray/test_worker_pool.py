"""Multi-worker trials on a reused pool (`scaling.reuse_workers`), on the session's Ray cluster:
a round of 2-worker trials runs on the same processes trial after trial, and each trial's
results (every evaluation row, the final weights, optimizer state and every rank's RNG state)
are bitwise those of the same trial run alone, in a Tune run of its own."""

from __future__ import annotations

import json
import os

import pytest

from service.distributed.checkpoint_store import CheckpointStore
from service.trainer.loop import TIMING_FIELDS
from tests.helpers.studies import make_study, run_within_timeout, same_nested

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
STEPS, EVERY = 12, 6
# Dropout and augmentation draw from every rank's generators; BatchNorm keeps running statistics.
FIXED = {"momentum": 0.9, "width": 4, "dropout": 0.25, "augment": True}


def pooled_study(digits_dir, storage, learning_rates: list[float]):
    """A grid round of 2-worker trials, one per learning rate, on a reused pool."""
    search = {k: {"role": "fixed", "value": v} for k, v in FIXED.items()}
    search["learning_rate"] = {"role": "nuisance", "type": "choice", "values": learning_rates}
    return make_study(
        digits_dir,
        storage,
        name="pool",
        scaling={"num_hosts": 1, "workers_per_host": 2, "reuse_workers": True},
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY},
        search=search,
        rounds=[{"name": "explore", "kind": "grid", "num_trials": len(learning_rates)}],
    )


def trial_files(study, row) -> tuple[list[dict], list[int], object]:
    """(evaluation rows without timings, every rank's pid, the latest checkpoint's state)."""
    trial_dir = os.path.join(study.study_uri, "trials", row["trial_name"])
    with open(os.path.join(trial_dir, "metrics.jsonl")) as f:
        log = [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in f]
    with open(os.path.join(trial_dir, "topology.json")) as f:
        pids = [r["pid"] for r in sorted(json.load(f)["ranks"], key=lambda r: r["world_rank"])]
    tr = study.training
    store = CheckpointStore(trial_dir, tr.num_checkpoints_to_keep, tr.metric, tr.mode)
    return log, pids, store.latest_state()


def test_a_round_reuses_its_workers_and_each_trial_equals_itself_alone(ray_cluster, digits_dir, tmp_path):
    rates = [0.3, 0.05, 0.1]
    study = pooled_study(digits_dir, tmp_path / "round", rates)
    rows = sorted(run_within_timeout(study), key=lambda r: r["trial_name"])
    assert [r["status"] for r in rows] == ["FINISHED"] * len(rates)
    runs = [trial_files(study, row) for row in rows]
    assert len(runs[0][1]) == 2 and len(set(runs[0][1])) == 2
    assert all(pids == runs[0][1] for _, pids, _ in runs), "a trial ran on new processes"

    for i in (1, 2):  # the trials that ran after another one on the same processes
        alone_study = pooled_study(digits_dir, tmp_path / f"alone-{i}", [rates[i]])
        (alone_row,) = run_within_timeout(alone_study)
        log, pids, state = runs[i]
        alone_log, alone_pids, alone_state = trial_files(alone_study, alone_row)
        # new processes (not one pid in common could fail by chance: the round's processes have
        # ended and pids are reused; both ranks' pids again, in order, cannot)
        assert alone_pids != pids
        assert log == alone_log
        assert [rows[i][k] for k in ("best_step", "best_metric")] == [
            alone_row[k] for k in ("best_step", "best_metric")
        ]
        assert state.step == alone_state.step == STEPS
        assert same_nested(state.model, alone_state.model)
        assert same_nested(state.optimizer, alone_state.optimizer)
        assert same_nested(state.rng_states, alone_state.rng_states)
