"""A trial that a rerun resumes at its last checkpoint trains nothing and reports no evaluation;
its row must still end as the uninterrupted run's: the `metric` column (the last evaluation's
value) comes from its summary. The interrupted state is the one a driver killed after the
trial's last checkpoint and before its row was written leaves: the row RUNNING, nothing of its
evaluations in it, every checkpoint and the metrics log on storage."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.study import spec
from tests.helpers.studies import study_dict

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
STEPS = 40
TRIAL = "explore-0000"
COMPARED = ("status", "step", "metric", "best_metric", "best_step")


def study_of(digits_dir, storage) -> spec.Study:
    raw = study_dict(
        digits_dir,
        storage,
        name="resumeend",
        training={"max_train_steps": STEPS, "eval_every_steps": 20},
        rounds=[{"name": "explore", "num_trials": 1}],
    )
    return spec.load_dict(raw)


def rows_of(study: spec.Study) -> dict[str, dict]:
    return {r["trial_name"]: r for r in pq.read_table(study.layout.trials_parquet).to_pylist()}


def test_a_trial_resumed_at_its_end_keeps_its_last_metric(ray_cluster, digits_dir, tmp_path):
    from service.orchestration.study_run import run_study

    reference = study_of(digits_dir, tmp_path / "reference")
    run_study(reference)
    want = rows_of(reference)[TRIAL]
    assert want["status"] == "FINISHED" and want["metric"] is not None

    study = study_of(digits_dir, tmp_path / "rerun")
    run_study(study)
    trial = study.layout.trial(TRIAL)
    with open(trial.metrics_log) as f:
        log = f.read()
    # The table as a driver killed before this trial's reports were written left it.
    rows = list(rows_of(study).values())
    for r in rows:
        r.update(
            status="RUNNING", step=None, metric=None, best_metric=None, best_step=None, best_checkpoint=None
        )
    pq.write_table(pa.Table.from_pylist(rows), study.layout.trials_parquet)

    run_study(study)
    with open(os.path.join(os.path.dirname(trial.metrics_log), "topology.json")) as f:
        assert json.load(f)["ranks"][0]["resumed_from_step"] == STEPS  # it trained nothing
    with open(trial.metrics_log) as f:
        assert f.read() == log
    got = rows_of(study)[TRIAL]
    assert {k: got.get(k) for k in COMPARED} == {k: want.get(k) for k in COMPARED}
