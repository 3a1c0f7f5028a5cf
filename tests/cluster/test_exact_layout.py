"""Studies on a Ray cluster sized exactly to their layout (2 CPUs for 2 workers x 1 CPU): the
pre-flight check passes, the study runs to completion (a trial's own Tune process holds no
CPU), and on a metric that ties at every evaluation the reported best checkpoint is the later
tied one, kept on disk, on the multi-worker (Ray Train) path and on the single-worker path."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from service.distributed import checkpoint
from service.study import spec
from tests.helpers.studies import run_within_timeout

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
STEPS, EVERY = 6, 2


@pytest.fixture(scope="module")
def two_cpus():
    """A Ray cluster of its own with exactly 2 CPUs."""
    import ray

    from service.orchestration.coordinator import NAMESPACE

    ray.init(address="local", num_cpus=2, namespace=NAMESPACE, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def tied_study(digits_dir, storage, name: str, workers: int) -> spec.Study:
    """A linear model at learning rate 0: its weights never change, so every evaluation's
    validation/error is the same and every evaluation ties; one checkpoint kept."""
    return spec.load_dict(
        {
            "name": name,
            "workload": "tests.helpers.linear_workload:LinearDigits",
            "data": {s: str(digits_dir / s) for s in ("train", "validation")},
            "storage": str(storage),
            "scaling": {"num_hosts": 1, "workers_per_host": workers, "cpus_per_worker": 1},
            "training": {
                "max_train_steps": STEPS,
                "batch_size": 32,
                "eval_batch_size": 64,
                "eval_every_steps": EVERY,
                "num_checkpoints_to_keep": 1,
                "metric": "validation/error",
                "mode": "min",
            },
            "search": {"learning_rate": {"role": "fixed", "value": 0.0}},
            "rounds": [{"name": "r1", "num_trials": 1}],
        }
    )


def check_tied_best(study, rows) -> None:
    (row,) = rows
    assert row["status"] == "FINISHED"
    trial_dir = os.path.join(study.study_uri, "trials", row["trial_name"])
    with open(os.path.join(trial_dir, "metrics.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == list(range(EVERY, STEPS + 1, EVERY))
    assert len({r["validation/error"] for r in log}) == 1  # every evaluation ties
    # The best is the later tied evaluation; its checkpoint is the one kept, and it is whole.
    assert row["best_step"] == STEPS
    assert row["best_checkpoint"] is not None
    assert os.path.isdir(row["best_checkpoint"])
    assert checkpoint.load(row["best_checkpoint"]).step == STEPS
    kept = [os.path.join(trial_dir, d) for d in os.listdir(trial_dir) if d.startswith("checkpoint_")]
    assert [d for d in kept if os.path.isdir(d)] == [row["best_checkpoint"]]
    (stored,) = pq.read_table(os.path.join(study.study_uri, "trials.parquet")).to_pylist()
    assert stored["best_checkpoint"] == row["best_checkpoint"]


def test_two_workers_on_two_cpus_run_and_report_a_kept_best_on_ties(two_cpus, digits_dir, tmp_path):
    from service.orchestration.coordinator import trials_that_fit
    from service.study.checks import check_resources

    study = tied_study(digits_dir, tmp_path, "exact-ties-2w", workers=2)
    check_resources(study, two_cpus.nodes())
    assert trials_that_fit(study, two_cpus.cluster_resources()) == 1
    check_tied_best(study, run_within_timeout(study))


def test_one_worker_reports_a_kept_best_on_ties(two_cpus, digits_dir, tmp_path):
    study = tied_study(digits_dir, tmp_path, "exact-ties-1w", workers=1)
    check_tied_best(study, run_within_timeout(study))
